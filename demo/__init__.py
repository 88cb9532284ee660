"""The demo: an example system built on stepstream's public API, kept apart from the product.

``orders_service`` (the remote order service the agents call: a real HTTP server with faults to switch on),
``orders_client`` (start, stop and steer it: tests, benchmarks, ``stepstream up``), ``order_agents`` (one
agent per operation of that service), ``workflows`` (the ``orders`` workflow, the scheduler's default
registry) and ``run`` (``stepstream demo``: a batch of orders through a whole local system). Nothing in
the six core packages imports it; a user's own agents and workflows take its place.
"""
