"""One client request and what serving it needs: the per-request object every stage is given.

An ``Exchange`` is made by the front door (serving.py) for each request the proxy admits, with
its collaborators passed in explicitly (config, registry, metrics, tracer, the decider, the
cache index and tokenizer) and the request's own state (id, body, path, headers, start time,
span, the prompt tokens each instance caches). The stages (pipeline.py and the modules it runs)
are small classes built on an exchange; they read it and return typed results, and a request
they cannot serve ends with ``responses.Refusal``. A prompt of a several-prompt request and the
continuation of a stream are exchanges of their own (``with_body``), sharing the original's id,
headers and span.

Imports the proxy's lower layers only (config, registry, metrics, routing); never a stage.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import uuid
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from kvdisagg.proxy.config import ProxyConfig
from kvdisagg.proxy.fleet.registry import Registry
from kvdisagg.proxy.metrics import Metrics
from kvdisagg.proxy.responses import Refusal
from kvdisagg.proxy.routing.body import ClientBody
from kvdisagg.proxy.routing.decide import CacheView, Decider
from kvdisagg.proxy.routing.policies import NO_HITS
from kvdisagg.proxy.routing.tokens import RequestTokenizer
from kvdisagg.tracing import Tracer, traceparent_of

__all__ = ["Exchange", "RequestIds"]

_RID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class RequestIds:
    """Each request's id (the client's ``X-Request-Id`` when it is sane, else a new unique one)
    and the headers its legs carry."""

    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key
        # Unique request ids without uuid4 per request: a random per-process prefix + a counter.
        self._prefix = f"kvd-{uuid.uuid4().hex[:12]}-"
        self._seq = itertools.count(1)

    def request_id(self, request: web.Request) -> str:
        rid = request.headers.get("X-Request-Id", "")
        return rid if _RID.fullmatch(rid) else f"{self._prefix}{next(self._seq):x}"

    def headers_for(self, request: web.Request, rid: str) -> bytes:
        """The upstream legs' headers: content type, request id, the client's (or the
        configured) Authorization."""
        auth = (f"Bearer {self.api_key}" if self.api_key
                else request.headers.get("Authorization"))
        h = f"Content-Type: application/json\r\nX-Request-Id: {rid}\r\n"
        if auth:
            h += f"Authorization: {auth}\r\n"
        return h.encode("latin-1", "replace")


class Exchange:
    """One request's state, and its collaborators. Stages replace ``body`` (the exact prompt
    length once known) and ``hits`` (set by the decision); the rest is fixed."""

    __slots__ = ("cfg", "registry", "metrics", "tracer", "decider", "cache", "tokenizer",
                 "_tasks", "rid", "body", "path", "headers", "t0", "root", "hits")

    def __init__(self, cfg: ProxyConfig, registry: Registry, metrics: Metrics, tracer: Tracer,
                 decider: Decider, cache: CacheView | None, tokenizer: RequestTokenizer | None,
                 tasks: set[asyncio.Future[Any]], rid: str, body: ClientBody, path: str,
                 headers: bytes, t0: float, root: Any) -> None:
        self.cfg, self.registry, self.metrics, self.tracer = cfg, registry, metrics, tracer
        self.decider, self.cache, self.tokenizer = decider, cache, tokenizer
        self._tasks = tasks
        self.rid, self.body, self.path, self.headers = rid, body, path, headers
        self.t0, self.root = t0, root
        self.hits: Mapping[str, int] = NO_HITS  # prompt tokens each instance caches (predicted)

    def with_body(self, body: ClientBody) -> Exchange:
        """The same request serving ``body`` instead (one prompt of several, a continuation)."""
        return Exchange(self.cfg, self.registry, self.metrics, self.tracer, self.decider,
                        self.cache, self.tokenizer, self._tasks, self.rid, body, self.path,
                        self.headers, self.t0, self.root)

    def leg_headers(self, span: Any) -> bytes:
        """The legs' headers, with the leg's W3C ``traceparent``: vLLM's own tracing
        (``--otlp-traces-endpoint``) then nests its request span under the leg."""
        if span is None:
            return self.headers
        return self.headers + b"traceparent: %s\r\n" % traceparent_of(span).encode()

    def leg_span(self, name: str, instance: str, mode: str | None = None) -> Any:
        """A span for one upstream leg to ``instance`` (a handoff's ``mode``, for decode's),
        a child of the request's; None without tracing, its attributes then never built."""
        if self.root is None:
            return None
        attributes = {"kvdisagg.instance": instance}
        if mode is not None:
            attributes["kvdisagg.mode"] = mode
        return self.tracer.start(name, traceparent_of(self.root), attributes=attributes)

    def reject(self, status: int, reason: str, message: str, type_: str = "service_unavailable",
               retry_after_s: float = 1.0) -> Refusal:
        """Turned away before any leg: counted by reason, with a Retry-After to come back."""
        self.metrics.rejected(reason)
        return Refusal.retry_later(status, message, type_, retry_after_s)

    def keep(self, task: asyncio.Future[Any]) -> None:
        """Hold a leg left to finish on its own (an early handoff's prefill leg) until done:
        the loop keeps only weak references to tasks."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
