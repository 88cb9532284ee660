"""Agents: the runtime that calls remote services for the scheduler, and its fault handling.

``handler`` (what a Python handler's author imports: the call, the two errors, a test harness), ``call``
(the call a handler gets), ``runtime`` (the attempt loop), ``faults`` (transient vs permanent), ``retry``
(back-off maths), ``budget`` (retries per dependency per window), ``breaker`` (circuit breaker per
dependency), ``pace`` (how many calls a throttling dependency gets at once), ``dependencies`` (their shared
per-process state, and per-dependency counts and logs), ``policy`` (the central, hot-reloaded
configuration), ``http`` (a handler that sends a request to a service), ``sealed_inputs`` (opening a
request's sealed values for the step granted them), ``redaction`` (masking those values in whatever
leaves the agent) and ``reporting`` (each process's report on its dependencies, for the console). A project
declares its agents in ``stepstream.toml``.
"""
