"""The demo: an example system built on stepstream's public API, kept apart from the product.

``orders_service`` (the remote order service the agents call: a real HTTP server with faults to switch on),
``orders_client`` (start, stop and steer it: tests and benchmarks), ``workflows`` (the ``orders`` workflow)
and ``run`` (``stepstream demo``: a batch of orders through a whole local system). Its agents, one per
operation of the order service, are declared as data in the front's built-in configuration
(``stepstream/project/demo.toml``), which names this package's modules as any ``stepstream.toml`` names a
project's. Nothing in the six core packages imports it, nor does the front beyond ``stepstream demo``.
"""
