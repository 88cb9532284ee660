"""A small travel-booking system run by stepstream: its own HTTP service (``service``) and a workflow that
books a flight, a hotel and charges a card, undone in reverse order when a step fails for good
(``workflows``). ``../stepstream.toml`` declares its agents."""
