"""The demo: an example system built on stepstream's public API, kept apart from the product.

``orders_service`` (the remote order service the agents call: a real HTTP server with faults to switch on),
``orders_client`` (start, stop and steer it: tests and benchmarks), ``workflows`` (the ``orders`` workflow)
and ``run`` (``stepstream demo``: a batch of orders through a whole local system). Its agents, one per
operation of the order service, are declared as data in its project file (``stepstream.toml`` here), which
names this package's modules as any project's file names a project's; stepstream uses it where no project
file is found. Nothing in the six core packages or the front imports it: ``stepstream demo`` runs it as a
process (``python -m demo``).
"""
