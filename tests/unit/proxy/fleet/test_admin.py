"""The admin API (proxy/fleet/admin.py) against fake vLLM upstreams on loopback: add, drain, remove,
list; its own listener, its key, the targets it may add."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from kvdisagg.proxy.config import AdminConfig, ProxyConfig
from tests.support.fake_vllm import FakeVllm
from tests.support.proxy_harness import GEN, proxy, run

LOOPBACK_ADDS = AdminConfig(allowed_targets=["127.0.0.0/8"])


def test_admin_add_drain_remove_list() -> None:
    async def t() -> None:
        async with proxy(n_decode=1, admin=LOOPBACK_ADDS) as env:
            extra = FakeVllm("d-extra")
            srv = TestServer(extra.app(), host="127.0.0.1")
            await srv.start_server()
            url = str(srv.make_url("")).rstrip("/")
            try:
                r = await env.admin.post("/admin/add", json={"url": url, "role": "decode"})
                assert r.status == 201 and (await r.json())["healthy"] is True
                r = await env.admin.post("/admin/add", json={"url": url, "role": "decode"})
                assert r.status == 409
                r = await env.admin.post("/admin/add", json={"url": "ftp://x", "role": "decode"})
                assert r.status == 400
                for _ in range(4):
                    assert (await env.client.post("/v1/completions", json=GEN)).status == 200
                assert len(extra.seen) == 2
                # drain while a request is in flight on it: drain waits, the request succeeds
                extra.delay_s = 0.5
                env.decode[0].delay_s = 0.5
                reqs = [asyncio.create_task(env.client.post("/v1/completions", json=GEN))
                        for _ in range(2)]
                await asyncio.sleep(0.1)
                t0 = time.monotonic()
                r = await env.admin.post("/admin/drain", json={"url": url, "remove": True})
                body = await r.json()
                assert body["drained"] is True and time.monotonic() - t0 > 0.2
                assert [(await q).status for q in reqs] == [200, 200]
                r = await env.admin.get("/admin/list")
                assert url not in [i["url"] for i in (await r.json())["instances"]]
                n = len(extra.seen)
                assert (await env.client.post("/v1/completions", json=GEN)).status == 200
                assert len(extra.seen) == n
                r = await env.admin.post("/admin/remove", json={"url": url})
                assert r.status == 404
            finally:
                await srv.close()
    run(t())


ADMIN_CALLS = [("get", "/admin/list", None),
               ("post", "/admin/add", {"url": "http://127.0.0.1:9", "role": "decode"}),
               ("post", "/admin/drain", {"url": "http://127.0.0.1:9"}),
               ("post", "/admin/undrain", {"url": "http://127.0.0.1:9"}),
               ("post", "/admin/remove", {"url": "http://127.0.0.1:9"})]


def test_admin_api_is_not_on_the_serving_port() -> None:
    """A client of the OpenAI routes reaches no admin route, whatever it sends."""
    async def t() -> None:
        async with proxy(admin=LOOPBACK_ADDS) as env:
            for method, path, body in ADMIN_CALLS:
                for headers in ({}, {"Authorization": "Bearer anything"}):
                    r = await getattr(env.client, method)(path, json=body, headers=headers)
                    assert r.status in (404, 405), (path, r.status)
            r = await env.admin.get("/admin/list")
            assert len((await r.json())["instances"]) == 2  # nothing was added or removed
            r = await env.client.post("/v1/completions", json=GEN)
            assert r.status == 200
            assert len(env.decode[0].seen) == 1
    run(t())


def test_admin_key_from_file_or_environment_guards_every_route(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "admin-key"
    key_file.write_text("s3cret\n")

    async def t(admin: AdminConfig) -> None:
        async with proxy(admin=admin) as env:
            for method, path, body in ADMIN_CALLS:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                    r = await getattr(env.admin, method)(path, json=body, headers=headers)
                    assert r.status == 401, (path, headers, r.status)
                    assert "Authorization: Bearer" in (await r.json())["error"]["message"]
            r = await env.admin.get("/admin/list", headers={"Authorization": "Bearer s3cret"})
            assert r.status == 200 and len((await r.json())["instances"]) == 2
            assert (await env.client.post("/v1/completions", json=GEN)).status == 200
    monkeypatch.delenv("KVDISAGG_ADMIN_KEY", raising=False)
    run(t(AdminConfig(key_file=str(key_file), allowed_targets=["127.0.0.0/8"])))
    monkeypatch.setenv("KVDISAGG_ADMIN_KEY", "s3cret")
    run(t(AdminConfig(allowed_targets=["127.0.0.0/8"])))


def test_admin_add_only_for_allowed_targets() -> None:
    async def t() -> None:
        async with proxy(admin=AdminConfig(allowed_targets=["10.1.0.0/16", "*.vllm.svc"])) as env:
            for url in ("http://127.0.0.1:9", "http://169.254.169.254:80", "http://10.2.0.1:8000",
                        "http://metadata.internal:80", "http://vllm.svc:8000",
                        "http://2130706433:8000"):
                r = await env.admin.post("/admin/add", json={"url": url, "role": "decode"})
                assert r.status == 403, url
                assert "admin.allowed_targets" in (await r.json())["error"]["message"]
            assert len((await (await env.admin.get("/admin/list")).json())["instances"]) == 2
        async with proxy() as env:  # the default allows nothing
            extra = FakeVllm("d-extra")
            srv = TestServer(extra.app(), host="127.0.0.1")
            await srv.start_server()
            try:
                r = await env.admin.post("/admin/add", json={
                    "url": str(srv.make_url("")).rstrip("/"), "role": "decode"})
                assert r.status == 403
            finally:
                await srv.close()
            assert not extra.seen  # not even probed
    run(t())
    allowed = AdminConfig(allowed_targets=["10.1.0.0/16", "*.vllm.svc", "decode-0"])
    assert allowed.allows("http://10.1.2.3:8000") and allowed.allows("http://a.b.vllm.svc:80")
    assert allowed.allows("http://DECODE-0:8000") and not allowed.allows("http://decode-00:80")
    assert not allowed.allows("http://[::1]:8000") and not allowed.allows("http://x.svc:80")


def test_admin_beyond_loopback_needs_a_key_and_argv_keys_are_refused(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from kvdisagg.errors import ConfigError
    from kvdisagg.proxy.cli import add_arguments, config_from_args

    monkeypatch.delenv("KVDISAGG_ADMIN_KEY", raising=False)
    with pytest.raises(ConfigError, match="beyond loopback and no admin key"):
        ProxyConfig(admin=AdminConfig(host="0.0.0.0", port=8001)).validate()
    with pytest.raises(ConfigError, match="listener of its own"):
        ProxyConfig(port=8000, admin=AdminConfig(port=8000)).validate()
    with pytest.raises(ConfigError, match=r"admin.allowed_targets\[0\]"):
        ProxyConfig(admin=AdminConfig(allowed_targets=["10.0.0.0/33"])).validate()
    with pytest.raises(ConfigError, match="admin.key_file"):
        ProxyConfig(admin=AdminConfig(host="0.0.0.0", port=8001,
                                      key_file=str(tmp_path / "missing"))).validate()
    monkeypatch.setenv("KVDISAGG_ADMIN_KEY", "k")
    ProxyConfig(admin=AdminConfig(host="0.0.0.0", port=8001)).validate()

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match="--admin-key is not accepted"):
        config_from_args(parser.parse_args(["--decode", "http://127.0.0.1:1", "--admin-key", "k"]))
    cfg = config_from_args(parser.parse_args([
        "--decode", "http://127.0.0.1:1", "--admin-port", "8001", "--admin-allow", "10.0.0.0/8",
        "--admin-allow", "*.svc"]))
    assert cfg.admin.port == 8001 and cfg.admin.host == "127.0.0.1"
    assert cfg.admin.allowed_targets == ["10.0.0.0/8", "*.svc"]
