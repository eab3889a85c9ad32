"""The aiohttp application: endpoints, wiring, and the staged shutdown.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``serving.py``),
``GET /health`` (liveness), ``GET /readiness`` (can it route a request now), ``GET /metrics``
(Prometheus), and the routes of ``passthrough.py`` (``/v1/models``, ``/tokenize``,
``/v1/responses``...: served by a decode instance as is). The admin API (``admin.py``) is an
application of its own (``app[ADMIN]``), served on its own listener when ``admin.port`` is set.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import msgspec
from aiohttp import web

from kvdisagg.proxy.config import ProxyConfig
from kvdisagg.proxy.fleet import admin
from kvdisagg.proxy.fleet.discovery import Discovery
from kvdisagg.proxy.fleet.registry import Instance, MemberEvent, Registry
from kvdisagg.proxy.handoff import passthrough
from kvdisagg.proxy.handoff.serving import Serving
from kvdisagg.proxy.metrics import Metrics
from kvdisagg.proxy.routing.cache_index import CacheIndex
from kvdisagg.proxy.routing.policies import make_policy
from kvdisagg.proxy.routing.tokens import RequestTokenizer
from kvdisagg.proxy.types import Side
from kvdisagg.tracing import Tracer

log = logging.getLogger("kvdisagg.proxy")

REGISTRY = web.AppKey("registry", Registry)
SERVING = web.AppKey("serving", Serving)
METRICS = web.AppKey("metrics", Metrics)
CONFIG = web.AppKey("config", ProxyConfig)
DISCOVERY = web.AppKey("discovery", Discovery)
ADMIN = web.AppKey("admin", web.Application)
_encode = msgspec.json.Encoder().encode

HANDLED_SIGNALS = (
    signal.SIGINT,  # Unix signal 2. Sent by Ctrl+C.
    signal.SIGTERM,  # Unix signal 15. Sent by `kill <pid>`.
)


def make_app(*, config: ProxyConfig | None = None,
             tracer: Tracer | None = None) -> web.Application:
    """The proxy's application for ``config`` (validated here; default: no instances).

    ``tracer``: where request spans go (default: ``otlp_traces_endpoint``'s collector)."""
    cfg = (config or ProxyConfig()).validate()
    registry = Registry(cfg)
    for spec in cfg.instances:
        registry.add(spec)
    metrics = Metrics(cfg.slo)
    if tracer is None:
        tracer = Tracer.otlp(cfg.otlp_traces_endpoint, "kvdisagg-proxy")
    index = CacheIndex(cfg.cache_index) if cfg.cache_index.enabled else None
    tokenizer = RequestTokenizer(cfg.cache_index.tokenizer) if index is not None else None
    metrics.cache = index
    serving = Serving(cfg, registry, metrics,
                      make_policy(cfg.policy.prefill, cfg.policy, cfg.slo),
                      make_policy(cfg.policy.decode, cfg.policy, cfg.slo), tracer,
                      index, tokenizer)
    app = web.Application(client_max_size=cfg.max_body_bytes)
    app[CONFIG], app[REGISTRY], app[METRICS], app[SERVING] = cfg, registry, metrics, serving
    discovery = Discovery(cfg.discovery, registry, cfg.drain_timeout_s,
                          on_error=lambda s: metrics.discovery_error(s.role.value, s.label))
    app[DISCOVERY] = discovery
    app[ADMIN] = admin.make_admin_app(cfg, registry, discovery.found)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await serving.serve(request, chat=False)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await serving.serve(request, chat=True)

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readiness(_request: web.Request) -> web.Response:
        p = len(registry.candidates(Side.PREFILL))
        d = len(registry.candidates(Side.DECODE))
        ready = (not serving.shutting_down and d > 0
                 and (p > 0 or cfg.retry.decode_only_fallback))
        body = {"ready": ready, "shutting_down": serving.shutting_down,
                "prefill": {"healthy": p, "total": len(registry.members(Side.PREFILL))},
                "decode": {"healthy": d, "total": len(registry.members(Side.DECODE))}}
        return web.Response(body=_encode(body), status=200 if ready else 503,
                            content_type="application/json")

    async def metrics_(_request: web.Request) -> web.Response:
        return web.Response(text=metrics.render(registry),
                            content_type="text/plain", charset="utf-8")

    loop: asyncio.AbstractEventLoop | None = None

    def follow(event: MemberEvent, inst: Instance) -> None:
        """The cache index follows the fleet: new members watched, removed ones dropped, one
        that came back (maybe restarted) resynced."""
        assert index is not None and loop is not None  # registered at start-up
        if event is MemberEvent.ADDED:
            loop.create_task(index.watch(inst.url, inst.role.value))
        elif event is MemberEvent.REMOVED:
            loop.create_task(index.unwatch(inst.url))
        else:
            index.reset(inst.url)

    async def on_startup(_app: web.Application) -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        if index is not None and tokenizer is not None:
            await tokenizer.start()  # a bad cache_index.tokenizer.model stops start-up
            for inst in registry.instances.values():
                await index.watch(inst.url, inst.role.value)
            registry.listeners.append(follow)
        if discovery.sources:  # first answer before the start-up probes wait for a decode
            await discovery.start()
        await registry.start()

    async def on_cleanup(_app: web.Application) -> None:
        await discovery.close()
        await registry.close()
        if index is not None:
            await index.close()
        tracer.shutdown()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/readiness", readiness)
    app.router.add_get("/metrics", metrics_)
    for method, path in passthrough.ROUTES:
        app.router.add_route(method, path, serving.forward)
    return app


async def serve(cfg: ProxyConfig) -> int:
    """Serve until a signal; then stop accepting, drain in-flight requests, close clients.

    A second signal during the drain forces exit.
    """
    app = make_app(config=cfg)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, backlog=2048)
    await site.start()
    log.info("kvdisagg proxy listening on http://%s:%d", cfg.host, cfg.port)
    admin_runner = None
    if cfg.admin.port is not None:
        admin_runner = web.AppRunner(app[ADMIN], access_log=None)
        await admin_runner.setup()
        await web.TCPSite(admin_runner, cfg.admin.host, cfg.admin.port).start()
        log.info("admin API on http://%s:%d (%s)", cfg.admin.host, cfg.admin.port,
                 "key required" if cfg.admin.key() else "loopback, no key")
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            force.set()
        stop.set()

    for sig in HANDLED_SIGNALS:
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    app[SERVING].shutting_down = True
    log.info("Shutting down: no longer accepting connections.")
    await site.stop()  # the listener closes; connections being served stay
    serving = app[SERVING]
    log.info("Waiting for %d in-flight requests (at most %.0fs; signal again to force quit).",
             app[METRICS].in_flight, cfg.drain_timeout_s)
    drained = loop.create_task(serving.idle.wait())
    forced = loop.create_task(force.wait())
    done, _ = await asyncio.wait({drained, forced}, timeout=cfg.drain_timeout_s,
                                 return_when=asyncio.FIRST_COMPLETED)
    for t in (drained, forced):
        t.cancel()
    if forced in done:
        log.warning("Forced exit with %d requests in flight.", app[METRICS].in_flight)
        return 1
    log.info("Closing upstream clients.")
    if admin_runner is not None:
        await admin_runner.cleanup()
    await runner.cleanup()
    return 0


def serve_until_signalled(cfg: ProxyConfig) -> int:
    """``serve(cfg)`` on uvloop (where installed), logging to stderr: ``kvdisagg proxy``."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(serve(cfg))
    return uvloop.run(serve(cfg))
