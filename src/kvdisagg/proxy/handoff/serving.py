"""The front door: admission, one ``Exchange`` per request, and the one place a refusal
becomes the client's HTTP error.

    serve:   admission (shutting down, max_in_flight), the request's span and counters
    parse:   body.parse (400 on a bad body); several prompts -> fanout.py (``FanOut``)
    open:    pipeline.py (``Pipeline``): plan, prefill, decode, until a decode leg answered
    answer:  relay.py (``Relay``): the whole body, or the stream (migrations, prefill's first
             token)

Turned away before any leg (``max_in_flight`` reached, slo_aware shedding, nothing routable,
shutting down): 429/503 with ``Retry-After``, counted in ``kvdisagg_proxy_rejected_total``. Any
stage that cannot serve a request raises ``responses.Refusal``; ``_refused`` turns it into
the response.

Holds what lives as long as the proxy (the collaborators it gives each exchange, the tasks left
to finish, the drain state); imports the handoff's top stages, and only the app imports it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from kvdisagg.errors import BodyError
from kvdisagg.proxy.config import ProxyConfig
from kvdisagg.proxy.fleet.registry import Registry
from kvdisagg.proxy.handoff.exchange import Exchange, RequestIds
from kvdisagg.proxy.handoff.fanout import FanOut
from kvdisagg.proxy.handoff.first_token import Led
from kvdisagg.proxy.handoff.passthrough import Passthrough
from kvdisagg.proxy.handoff.pipeline import Pipeline
from kvdisagg.proxy.handoff.relay import Relay, Served, whole
from kvdisagg.proxy.metrics import Metrics
from kvdisagg.proxy.responses import Refusal
from kvdisagg.proxy.routing import body as bodies
from kvdisagg.proxy.routing.decide import CacheView, Decider
from kvdisagg.proxy.routing.policies import Policy
from kvdisagg.proxy.routing.tokens import RequestTokenizer
from kvdisagg.tracing import Tracer, end, valid_traceparent

_now = time.perf_counter


class Serving:
    def __init__(self, cfg: ProxyConfig, registry: Registry, metrics: Metrics,
                 prefill_policy: Policy, decode_policy: Policy,
                 tracer: Tracer = Tracer.disabled(), cache: CacheView | None = None,
                 tokenizer: RequestTokenizer | None = None) -> None:
        self.cfg = cfg
        self.tracer = tracer
        self.registry = registry
        self.metrics = metrics
        self.decider = Decider(cfg, registry, prefill_policy, decode_policy)
        self.cache = cache  # what each instance caches (None: no index)
        self.tokenizer = tokenizer
        self.ids = RequestIds(cfg.api_key)
        self.passthrough = Passthrough(cfg, registry, metrics, decode_policy, self.ids)
        self.idle = asyncio.Event()
        self.idle.set()
        self.shutting_down = False
        self._tasks: set[asyncio.Future[Any]] = set()  # legs left to finish on their own

    async def serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        m = self.metrics
        endpoint = "chat" if chat else "completions"
        if self.shutting_down:  # a kept-alive client after the listener closed: go elsewhere
            m.request_done(endpoint, "shed")
            refused = self._turned_away("shutting_down", "proxy is shutting down")
            refused.headers["Connection"] = "close"
            return refused
        limit = self.cfg.max_in_flight
        if limit and m.in_flight >= limit:
            m.request_done(endpoint, "shed")
            return self._turned_away("max_in_flight", f"proxy is serving its max_in_flight "
                                     f"({limit}) requests; retry shortly")
        t0 = _now()
        m.in_flight += 1
        self.idle.clear()
        outcome = "error"
        # The request's trace: joins the client's (W3C traceparent header) when it sent one.
        root = self.tracer.start("kvdisagg.request", valid_traceparent(
            request.headers.get("traceparent")), server=True,
            attributes={"http.route": request.path}) if self.tracer.enabled else None
        try:
            # (``_answered``'s catch inline: no coroutine of its own on every request)
            try:
                resp, outcome = await self._serve(request, chat, t0, root)
            except Refusal as refusal:
                resp, outcome = self._refused(refusal)
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            outcome = "client_disconnect"
            raise
        finally:
            end(root, outcome=outcome)
            m.in_flight -= 1
            m.request_done(endpoint, outcome)
            if not m.in_flight:
                self.idle.set()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        """A route a decode instance answers as is (passthrough.py)."""
        async def forwarded() -> Served:
            return Served(await self.passthrough.forward(request), "ok")

        return (await self._answered(forwarded())).response

    @classmethod
    async def _answered(cls, serving: Awaitable[Served]) -> Served:
        """``serving``'s answer, a ``Refusal`` made the client's HTTP error."""
        try:
            return await serving
        except Refusal as refusal:
            return cls._refused(refusal)

    @staticmethod
    def _refused(refusal: Refusal) -> Served:
        """The one place a ``Refusal`` becomes the client's HTTP error."""
        return Served(refusal.response(), refusal.outcome)

    def _turned_away(self, reason: str, message: str) -> web.Response:
        """Turned away before anything: counted by reason, with a Retry-After to come back."""
        self.metrics.rejected(reason)
        return Refusal.retry_later(503, message).response()

    async def _serve(self, request: web.Request, chat: bool, t0: float, root: Any) -> Served:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise Refusal.error(413, f"request body over {self.cfg.max_body_bytes} bytes"
                                ) from None
        try:
            body = bodies.parse(raw, chat, self.cfg.policy.prefix_block_chars)
        except BodyError as exc:
            raise Refusal.error(400, str(exc)) from None
        rid = self.ids.request_id(request)
        if root is not None:
            root.set_attribute("kvdisagg.request_id", rid)
        x = Exchange(self.cfg, self.registry, self.metrics, self.tracer, self.decider,
                     self.cache, self.tokenizer, self._tasks, rid, body, request.path,
                     self.ids.headers_for(request, rid), t0, root)
        if body.prompts is not None:
            return await FanOut(x, request).serve()
        opened = await Pipeline(x).open(lead=True)
        if isinstance(opened, Led):
            return await Relay(x, request).stream_led(opened)
        if x.body.stream and opened.ok:
            return await Relay(x, request).stream(opened)
        return whole(x, opened)
