"""The demo's agents (the ones ``stepstream run agent NAME`` runs): one per operation of its order service.

They all call the same service, so they share one dependency name, ``orders``: the central policy
configures it once (``[dependencies.orders]``), and the breaker and retry budget are about that service
rather than about one of its endpoints.
"""

from __future__ import annotations

import threading

from agents.dependencies import DependencyRegistry
from agents.http import http_post_handler, pooled_client
from agents.policy import AgentPolicy, DependencyPolicy, PolicyProvider
from agents.retry import RetryPolicy
from agents.runtime import Agent

#: The dependency name of the order service in the central policy.
ORDERS_DEPENDENCY = "orders"

# agent name -> path on the order service
ORDER_OPERATIONS: dict[str, str] = {
    "inventory": "inventory/reserve",
    "payments": "payments/charge",
    "shipping": "shipping/create",
    "inventory-release": "inventory/release",
    "payments-refund": "payments/refund",
    "shipping-cancel": "shipping/cancel",
}


def shipped_agent(name: str, service_url: str,
                  policy: PolicyProvider | AgentPolicy | DependencyPolicy | RetryPolicy | None = None,
                  stopping: threading.Event | None = None, *, dependency: str = ORDERS_DEPENDENCY,
                  dependencies: DependencyRegistry | None = None, connections: int = 1) -> Agent:
    """The agent ``name``; ``connections``: how many calls it may have in flight (its HTTP pool)."""
    try:
        path = ORDER_OPERATIONS[name]
    except KeyError:
        known = ", ".join(sorted(ORDER_OPERATIONS))
        raise ValueError(f"no shipped agent named {name!r}; known: {known}") from None
    return Agent(name, http_post_handler(service_url, path, pooled_client(connections)), policy, stopping,
                 dependency=dependency, dependencies=dependencies)
