"""A request's handoff as one OpenTelemetry trace: proxy, prefill and decode processes.

Optional: spans are made only when an OTLP endpoint is configured (``otlp_traces_endpoint`` of
the proxy and of the connector) and opentelemetry-sdk is installed (``kvdisagg[tracing]``);
otherwise every call here is a no-op. Each process keeps its own TracerProvider (never the
global one, which vLLM's own ``--otlp-traces-endpoint`` may set).

The context crosses processes as a W3C ``traceparent`` string: from the client's HTTP header to
the proxy, from the proxy in ``kv_transfer_params[TRACE_PARAMS_KEY]`` of each leg to the
connector's scheduler, and from there in the step metadata to the workers. A string that does
not match the W3C form is dropped, never parsed further.

    kvdisagg.request (proxy)
    ├── prefill_leg (proxy)            └── kvdisagg.serve (prefill worker: Read .. Done)
    └── decode_leg (proxy: events first_token, first_byte)
        └── kvdisagg.load (decode scheduler: load planned .. engine noticed it)
            └── kvdisagg.pull (decode worker) ── queue, connect, read, transfer, done
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

logger = logging.getLogger(__name__)

OtlpEndpoint = Annotated[str, msgspec.Meta(pattern=r"^(https?://\S+)?$")]
"""A config value naming an OTLP/HTTP collector, or '' for none."""
TRACE_PARAMS_KEY = "kvdisagg_trace"
TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-0[01]")
EXPORT_DELAY_MS = 500  # a span reaches the collector within about this


def valid_traceparent(value: Any) -> str:
    """``value`` if it is a W3C traceparent (version 00, sampled or not), else ''."""
    return value if isinstance(value, str) and TRACEPARENT.fullmatch(value) else ""


def now_ns() -> int:
    return time.time_ns()


class Tracer:
    """Spans of one process. ``Tracer.disabled()`` makes none."""

    def __init__(self, otel_tracer: Any = None, provider: Any = None) -> None:
        self._tracer = otel_tracer
        self._provider = provider

    @classmethod
    def disabled(cls) -> Tracer:
        return cls()

    @classmethod
    def otlp(cls, endpoint: str, service: str) -> Tracer:
        """Export to an OTLP/HTTP collector (``http://host:4318``); disabled if the SDK is
        missing (logged once)."""
        if not endpoint:
            return cls()
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            logger.warning("kvdisagg: tracing to %s is off: %s (pip install "
                           "'kvdisagg[tracing]')", endpoint, exc)
            return cls()
        url = endpoint.rstrip("/")
        if not url.endswith("/v1/traces"):
            url += "/v1/traces"
        return cls.with_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=5),
                                                     schedule_delay_millis=EXPORT_DELAY_MS),
                                  service)

    @classmethod
    def with_processor(cls, processor: Any, service: str) -> Tracer:
        """Spans go to ``processor`` (tests: a SimpleSpanProcessor of an in-memory exporter)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(processor)
        return cls(provider.get_tracer("kvdisagg"), provider)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def start(self, name: str, parent: str = "", start_ns: int | None = None,
              attributes: Mapping[str, Any] | None = None, server: bool = False) -> Any:
        """A live span (end it with ``end``), child of ``parent`` (a traceparent; '' starts a
        trace); None when disabled."""
        if self._tracer is None:
            return None
        from opentelemetry.trace import SpanKind

        return self._tracer.start_span(name, context=_context(parent), start_time=start_ns,
                                       attributes=dict(attributes or {}),
                                       kind=SpanKind.SERVER if server else SpanKind.INTERNAL)

    def record(self, name: str, parent: str, start_ns: int, end_ns: int,
               attributes: Mapping[str, Any] | None = None) -> str:
        """A span of work already done; returns its traceparent ('' when disabled)."""
        span = self.start(name, parent, start_ns, attributes)
        if span is None:
            return ""
        span.end(end_time=end_ns)
        return traceparent_of(span)

    def shutdown(self) -> None:
        """Flush what is buffered (a process about to exit)."""
        if self._provider is not None:
            self._provider.shutdown()


def end(span: Any, end_ns: int | None = None, **attributes: Any) -> None:
    if span is not None:
        if attributes:
            span.set_attributes(attributes)
        span.end(end_time=end_ns)


def event(span: Any, name: str, at_ns: int | None = None) -> None:
    if span is not None:
        span.add_event(name, timestamp=at_ns)


def traceparent_of(span: Any) -> str:
    """The W3C traceparent naming ``span`` as a parent ('' for None)."""
    if span is None:
        return ""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _context(parent: str) -> Any:
    if not parent:
        return None
    from opentelemetry import trace

    _, trace_id, span_id, flags = parent.split("-")
    return trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
        int(trace_id, 16), int(span_id, 16), is_remote=True,
        trace_flags=trace.TraceFlags(int(flags, 16)))))
