"""Structured (JSON) logs on stderr for every service; transient faults go out at WARNING.

A piece of work holding values that must not be logged (an agent's attempt, with the sealed values it
opened) sets a mask for its context with :func:`masking`; every log line written in that context, its
rendered exception included, passes through it before it is rendered.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import structlog

#: Masks a value of a log line (a string, or anything holding strings); None: nothing to mask here.
Mask = Callable[[Any], Any]

_mask: ContextVar[Mask | None] = ContextVar("stepstream_log_mask", default=None)


@contextmanager
def masking(mask: Mask | None) -> Iterator[None]:
    """Pass every log line written in this context through ``mask`` (nested: the inner mask applies)."""
    token = _mask.set(mask)
    try:
        yield
    finally:
        _mask.reset(token)


def masked(value: Any) -> Any:
    """``value`` through the context's mask: for what is recorded elsewhere than a log line (a span)."""
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


def configure_logging(level: str = "INFO", json: bool = True) -> None:
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            mask_values,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
