"""The HTTP front: the one app that serves the state store's reads, the writes (submissions and operator
commands), the dashboard and ``/metrics``, composed in ``app`` from modules of one job each.

``reads`` (query routes over the store), ``writes`` (write routes) behind ``auth`` (bearer tokens), the
``writer`` (produce, then wait for the scheduler's answer, watched by ``decisions``), ``admission`` (the
global in-flight bound), ``metrics``, ``dashboard`` (the page and its static files), ``settings``
(``STEPSTREAM_API_*``) and ``server`` (``stepstream serve api``). It belongs to the front layer because it
writes to the log and composes the read model: ``projections`` offers the queries and knows nothing of HTTP.
Nothing is imported here, so the CLI can read the settings without loading FastAPI.
"""
