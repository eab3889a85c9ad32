"""The admin API: change membership at run time and look at each instance.

It is an application of its own, served on ``admin.host:admin.port`` (loopback by default) and
never on the serving port, so that a client of the OpenAI routes cannot reach it; with no
``admin.port`` there is none.

    GET  /admin/list                          every instance: health, breaker, load, counters
    POST /admin/add     {"url", "role"}       probe once, then route to it if healthy
    POST /admin/drain   {"url", "timeout_s"?, "remove"?}
                                              no new work; wait (bounded) for in-flight legs
    POST /admin/undrain {"url"}               take new work again
    POST /admin/remove  {"url"}               out of the fleet now; in-flight legs still finish

Bodies are msgspec Structs (unknown keys refused). With a key (``admin.key_file`` or
``KVDISAGG_ADMIN_KEY``; required beyond loopback), every call needs ``Authorization: Bearer
<key>``. ``/admin/add`` only takes targets in ``admin.allowed_targets`` or found by discovery.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

import msgspec
from aiohttp import web

from kvdisagg.errors import ConfigError
from kvdisagg.proxy.config import InstanceSpec, ProxyConfig
from kvdisagg.proxy.fleet.registry import Instance, Registry
from kvdisagg.proxy.responses import error_response
from kvdisagg.proxy.types import Role

_encode = msgspec.json.Encoder().encode


class _Target(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    url: str


class _Drain(_Target, kw_only=True):
    timeout_s: float | None = None
    remove: bool = False


async def add_instance(registry: Registry, spec: InstanceSpec,
                       allowed: Callable[[str], bool] = lambda url: True) -> Instance:
    """Validate ``spec`` like the config file, add it, probe it once (routed to if healthy).
    ConfigError: a bad URL; PermissionError: not ``allowed``; ValueError: already in the
    fleet. Used by discovery too (whatever it finds is allowed)."""
    ProxyConfig(instances=[spec]).validate()  # same URL rules as the config file
    if not allowed(spec.key):
        raise PermissionError(f"{spec.url} is not an allowed target: add its CIDR or host name "
                              "to admin.allowed_targets (--admin-allow)")
    inst = registry.add(spec)
    await registry.probe(inst)
    return inst


async def drain_instance(registry: Registry, url: str, timeout_s: float, remove: bool,
                         force: bool = False) -> tuple[bool, Instance]:
    """Drain ``url`` (bounded); remove it if asked and idle, or regardless with ``force``
    (discovery: the member is gone). KeyError: no such instance."""
    drained = await registry.drain(url, timeout_s)
    if remove and (drained or force):
        return drained, registry.remove(url)
    return drained, registry.get(url)


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json")


def make_admin_app(cfg: ProxyConfig, registry: Registry,
                   discovered: Callable[[str], bool] = lambda url: False) -> web.Application:
    """The admin application; ``discovered(url)``: whether discovery found that member (an
    add of it is allowed whatever ``allowed_targets`` say)."""
    key = cfg.admin.key()
    expected = f"Bearer {key}".encode() if key else b""
    app = web.Application(client_max_size=64 << 10)

    def authorized(request: web.Request) -> bool:
        if not key:
            return True
        got = request.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), expected)

    async def parse(request: web.Request, typ: type) -> object:
        try:
            return msgspec.json.decode(await request.read(), type=typ)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise web.HTTPBadRequest(body=_encode({"error": {
                "message": f"bad admin request: {exc}", "type": "invalid_request_error",
                "param": None, "code": 400}}), content_type="application/json") from None

    def guarded(handler):
        async def wrapper(request: web.Request) -> web.StreamResponse:
            if not authorized(request):
                return error_response(401, "admin API needs Authorization: Bearer <admin key>",
                                      "authentication_error")
            try:
                return await handler(request)
            except KeyError as exc:
                return error_response(404, str(exc.args[0]), "not_found")
        return wrapper

    async def list_(request: web.Request) -> web.Response:
        return _json({"instances": [i.info() for i in registry.instances.values()]})

    async def add(request: web.Request) -> web.Response:
        spec = await parse(request, InstanceSpec)
        assert isinstance(spec, InstanceSpec)
        try:
            inst = await add_instance(registry, spec,
                                      lambda url: cfg.admin.allows(url) or discovered(url))
        except ConfigError as exc:
            return error_response(400, str(exc))
        except PermissionError as exc:
            return error_response(403, str(exc), "permission_error")
        except ValueError as exc:
            return error_response(409, str(exc), "conflict")
        return _json(inst.info(), 201)

    async def drain(request: web.Request) -> web.Response:
        req = await parse(request, _Drain)
        assert isinstance(req, _Drain)
        drained, inst = await drain_instance(registry, req.url,
                                             req.timeout_s or cfg.drain_timeout_s, req.remove)
        return _json({"drained": drained, "instance": inst.info()})

    async def undrain(request: web.Request) -> web.Response:
        req = await parse(request, _Target)
        assert isinstance(req, _Target)
        return _json(registry.undrain(req.url).info())

    async def remove(request: web.Request) -> web.Response:
        req = await parse(request, _Target)
        assert isinstance(req, _Target)
        return _json(registry.remove(req.url).info())

    app.router.add_get("/admin/list", guarded(list_))
    app.router.add_post("/admin/add", guarded(add))
    app.router.add_post("/admin/drain", guarded(drain))
    app.router.add_post("/admin/undrain", guarded(undrain))
    app.router.add_post("/admin/remove", guarded(remove))
    return app


__all__ = ["make_admin_app", "add_instance", "drain_instance", "Role"]
