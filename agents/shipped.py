"""The agents shipped with stepstream: one per operation of the demo's order service."""

from __future__ import annotations

import threading

from agents.http import http_post_handler
from agents.runtime import Agent, RetryPolicy

# agent name -> path on the order service
ORDER_OPERATIONS: dict[str, str] = {
    "inventory": "inventory/reserve",
    "payments": "payments/charge",
    "shipping": "shipping/create",
    "inventory-release": "inventory/release",
    "payments-refund": "payments/refund",
    "shipping-cancel": "shipping/cancel",
}


def shipped_agent(name: str, service_url: str, policy: RetryPolicy | None = None,
                  stopping: threading.Event | None = None) -> Agent:
    try:
        path = ORDER_OPERATIONS[name]
    except KeyError:
        known = ", ".join(sorted(ORDER_OPERATIONS))
        raise ValueError(f"no shipped agent named {name!r}; known: {known}") from None
    return Agent(name, http_post_handler(service_url, path), policy, stopping)
