"""Traces: one per task, across the scheduler, the agents and the remote services (OpenTelemetry).

A task's work is spread over many processes and over time: the scheduler handles its commands whenever
they arrive, agents take its attempts, services apply its calls, and a supervisor may recover an attempt
minutes later without any trace context of its own. So a task's trace does not depend on a context
carried from the submission: its trace id is derived from the task id, and so are the span ids of the
task's root span and of each attempt's span. Every process can name the parent it needs; W3C
``traceparent`` headers on Kafka records and HTTP calls carry the finer parent (the span of the agent's
attempt, of one call) where there is one.

- ``task <workflow>``: the root, emitted by the scheduler when it accepts the task;
- ``attempt <step>#n`` / ``undo <step>#n``: one per attempt, emitted by the scheduler when the attempt
  ends, from its start to its end (so a span whose process dies never exists half-open);
- ``agent <name>``: the agent taking the attempt (a child of the attempt span, from the request's header);
- ``call <dependency>``: each call to the service, whose ``traceparent`` the service continues;
- ``scheduler <command>``: the scheduler handling each command of the task.

Exported when ``OTEL_TRACES_EXPORTER`` says so: ``otlp`` (to ``OTEL_EXPORTER_OTLP_ENDPOINT``), ``console``
(JSON, one span per line, to stdout or to a file per process in ``STEPSTREAM_TRACES_DIR``), ``none``
(default: spans cost a few microseconds and go nowhere). The deterministic ids need the id generator
installed by :func:`configure_tracing`; a process that configures its own provider gets random ids.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import IO

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import Span, SpanContext, SpanKind, TraceFlags

TRACEPARENT = "traceparent"
tracer = trace.get_tracer("stepstream")

_forced_ids: ContextVar[tuple[int, int] | None] = ContextVar("stepstream_forced_ids", default=None)


def _digest(*parts: str) -> bytes:
    return hashlib.sha256("\x1f".join(parts).encode()).digest()


def task_trace_id(task_id: str) -> int:
    """The task's trace id: the same in every process, with or without a header to carry it."""
    return int.from_bytes(_digest("trace", task_id)[:16], "big") or 1


def _span_id(*parts: str) -> int:
    return int.from_bytes(_digest("span", *parts)[:8], "big") or 1


def task_root(task_id: str) -> SpanContext:
    """The context of the task's root span."""
    return SpanContext(task_trace_id(task_id), _span_id(task_id), is_remote=True,
                       trace_flags=TraceFlags(TraceFlags.SAMPLED))


def attempt_span(task_id: str, attempt_id: str) -> SpanContext:
    """The context of one attempt's span (forward or undo): what the agent's span hangs from."""
    return SpanContext(task_trace_id(task_id), _span_id(task_id, attempt_id), is_remote=True,
                       trace_flags=TraceFlags(TraceFlags.SAMPLED))


def headers_of(span_context: SpanContext) -> list[tuple[str, bytes]]:
    """A Kafka record's headers carrying ``span_context`` as its W3C ``traceparent``."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(trace.NonRecordingSpan(span_context)))
    return [(name, value.encode()) for name, value in carrier.items()]


def current_headers() -> dict[str, str]:
    """HTTP headers carrying the current span (``traceparent``), for a call the service may trace on."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def parent_of(task_id: str, headers: Sequence[tuple[str, bytes]] | Mapping[str, str] | None) -> Context:
    """The parent for a span about ``task_id``: the record's ``traceparent`` when it belongs to the task's
    trace, else the task's root (a command from a process without a context, or from another trace)."""
    carrier: dict[str, str] = {}
    items = headers.items() if isinstance(headers, Mapping) else (headers or [])
    for name, value in items:
        if name.lower() == TRACEPARENT:
            carrier[TRACEPARENT] = value.decode(errors="replace") if isinstance(value, bytes) else value
    extracted = trace.get_current_span(propagate.extract(carrier)).get_span_context()
    if extracted.is_valid and extracted.trace_id == task_trace_id(task_id):
        return trace.set_span_in_context(trace.NonRecordingSpan(extracted))
    return trace.set_span_in_context(trace.NonRecordingSpan(task_root(task_id)))


def emit_span(name: str, span_context: SpanContext, parent: SpanContext | None, start: datetime,
              end: datetime, attributes: Mapping[str, str | int | bool], *, error: str | None = None) -> None:
    """Record a span that is only known once it ended (an attempt, the task's root), under its fixed id."""
    # No parent means a root, whatever span is current (the scheduler's handling of the command is).
    context = Context() if parent is None else trace.set_span_in_context(trace.NonRecordingSpan(parent))
    token = _forced_ids.set((span_context.trace_id, span_context.span_id))
    try:
        span = tracer.start_span(name, context=context, kind=SpanKind.INTERNAL, attributes=dict(attributes),
                                 start_time=_nanos(start))
    finally:
        _forced_ids.reset(token)
    if error is not None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, error))
    span.end(end_time=max(_nanos(end), _nanos(start)))


@contextmanager
def span_for(task_id: str, name: str, headers: Sequence[tuple[str, bytes]] | Mapping[str, str] | None, *,
             kind: SpanKind = SpanKind.INTERNAL, **attributes: str | int | bool) -> Iterator[Span]:
    """A span of work on ``task_id``, current while the block runs, under the parent ``headers`` name."""
    with tracer.start_as_current_span(name, context=parent_of(task_id, headers), kind=kind,
                                      attributes={"stepstream.task_id": task_id, **attributes}) as span:
        yield span


def _nanos(at: datetime) -> int:
    return int(at.timestamp() * 1_000_000_000)


class _TaskIds(RandomIdGenerator):
    """Random ids, except for spans whose ids follow from the task (see :func:`emit_span`)."""

    def generate_span_id(self) -> int:
        forced = _forced_ids.get()
        return forced[1] if forced is not None else super().generate_span_id()

    def generate_trace_id(self) -> int:
        forced = _forced_ids.get()
        return forced[0] if forced is not None else super().generate_trace_id()


def configure_tracing(service: str, environ: Mapping[str, str] = os.environ) -> TracerProvider | None:
    """Install this process's tracer provider as ``OTEL_TRACES_EXPORTER`` says; None when traces are off."""
    exporter_name = environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    if exporter_name in ("", "none"):
        return None
    exporter: SpanExporter
    if exporter_name == "console":
        exporter = ConsoleSpanExporter(out=_console_stream(service, environ),
                                       formatter=lambda span: span.to_json(indent=None) + "\n")
    elif exporter_name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    else:
        raise ValueError(f"OTEL_TRACES_EXPORTER: {exporter_name!r} is not one of none, console, otlp")
    return install_tracing(environ.get("OTEL_SERVICE_NAME", service),
                           BatchSpanProcessor(exporter, schedule_delay_millis=500))


def install_tracing(service: str, processor: SpanProcessor) -> TracerProvider:
    """Make a provider with the task-derived ids and ``processor`` this process's (tests pass an in-memory
    exporter's). A process has one provider: a second call adds its processor to the first."""
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        current.add_span_processor(processor)
        return current
    provider = TracerProvider(resource=Resource.create({"service.name": service}), id_generator=_TaskIds())
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    return provider


def _console_stream(service: str, environ: Mapping[str, str]) -> IO[str]:
    """Stdout, or a file of this process's own in ``STEPSTREAM_TRACES_DIR`` (so processes never interleave)."""
    folder = environ.get("STEPSTREAM_TRACES_DIR")
    if not folder:
        return sys.stdout
    Path(folder).mkdir(parents=True, exist_ok=True)
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in service)
    return open(Path(folder) / f"{name}-{os.getpid()}.jsonl", "a", buffering=1)


__all__ = [
    "attempt_span",
    "configure_tracing",
    "current_headers",
    "emit_span",
    "headers_of",
    "install_tracing",
    "parent_of",
    "span_for",
    "task_root",
    "task_trace_id",
    "tracer",
]
