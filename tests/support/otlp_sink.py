"""A minimal OTLP/HTTP trace collector on loopback: what the proxy and the vLLM instances export
reaches the tests and benchmarks/handoff.py as plain records (no collector binary needed)."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

MAX_BODY = 64 << 20


@dataclass(frozen=True)
class SpanRecord:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # '' for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)  # name -> time (ns)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpSink:
    """``with OtlpSink() as sink:`` ... ``sink.url`` is the endpoint to configure."""

    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                n = int(self.headers.get("Content-Length") or 0)
                if self.path != "/v1/traces" or not 0 < n <= MAX_BODY:
                    self.send_error(400)
                    return
                body = self.rfile.read(n)
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                sink._add(ExportTraceServiceRequest.FromString(body))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _add(self, req: ExportTraceServiceRequest) -> None:
        records = []
        for rs in req.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes
                            if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    records.append(SpanRecord(
                        service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        s.start_time_unix_nano, s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes},
                        {e.name: e.time_unix_nano for e in s.events}))
        with self._lock:
            self.spans.extend(records)

    def snapshot(self) -> list[SpanRecord]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, done: Callable[[list[SpanRecord]], bool], timeout_s: float = 30.0
                 ) -> list[SpanRecord]:
        """Spans so far, once ``done`` holds for them (exporters batch for half a second)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def __enter__(self) -> OtlpSink:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def by_request(spans: list[SpanRecord]) -> dict[str, list[SpanRecord]]:
    """Each request's spans (its whole trace), by the id the proxy's root span carries
    (the client's X-Request-Id)."""
    traces: dict[str, list[SpanRecord]] = {}
    for s in spans:
        traces.setdefault(s.trace_id, []).append(s)
    return {s.attributes["kvdisagg.request_id"]: traces[s.trace_id] for s in spans
            if s.name == "kvdisagg.request" and "kvdisagg.request_id" in s.attributes}
