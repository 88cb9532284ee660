"""Values that must not be recorded while a piece of work runs, masked wherever it records anything.

An agent's attempt holds the sealed values it opened for its call; whatever the attempt writes -- a log
line, a span's status, a piece of a service's answer it keeps -- must not hold them. The attempt sets a
mask for its context (:func:`masking`: this thread, this attempt; concurrent attempts each have their own)
and the places that record pass what they record through :func:`masked`; the log pipeline does it for
every line (:func:`mask_values`, a structlog processor). What the mask is belongs to the agent
(``agents.redaction``); this module only carries it, so the layers below the agent can apply it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

#: Masks a value (a string, or anything holding strings); None: nothing to mask here.
Mask = Callable[[Any], Any]

_mask: ContextVar[Mask | None] = ContextVar("stepstream_mask", default=None)


@contextmanager
def masking(mask: Mask | None) -> Iterator[None]:
    """Mask what is recorded in this context with ``mask`` (nested: the inner mask applies)."""
    token = _mask.set(mask)
    try:
        yield
    finally:
        _mask.reset(token)


def masked(value: Any) -> Any:
    """``value`` through the context's mask (as it is if there is none): for what is recorded elsewhere than
    a log line -- a span's status, the part of a service's answer a fault keeps."""
    mask = _mask.get()
    return value if mask is None else mask(value)


def mask_values(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """The structlog processor applying the context's mask to every field of a log line."""
    mask = _mask.get()
    if mask is None:
        return event
    for name, value in event.items():
        event[name] = mask(value)
    return event
