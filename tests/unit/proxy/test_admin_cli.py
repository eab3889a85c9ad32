"""``kvdisagg admin`` (issue 19) against the real proxy: its admin application on a loopback
listener, fake vLLM upstreams behind it. Each subcommand's effect is asserted on the proxy's
registry, each failure on the exit status and the message."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvdisagg.local.servers import free_port
from kvdisagg.proxy import make_app
from kvdisagg.proxy.admin_cli import AdminExit, add_arguments
from kvdisagg.proxy.admin_cli import run as admin_run
from kvdisagg.proxy.app import ADMIN, REGISTRY
from kvdisagg.proxy.config import (
    AdminConfig,
    HealthConfig,
    InstanceSpec,
    ProxyConfig,
    TimeoutConfig,
)
from kvdisagg.proxy.fleet.registry import Registry, State
from kvdisagg.proxy.types import Role
from tests.support.fake_vllm import FakeVllm

ROOT = Path(__file__).resolve().parents[3]
GEN = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
KEY = "s3cret-admin-key"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvdisagg admin")
    add_arguments(p)
    return p


class Fleet:
    def __init__(self, client: TestClient, admin_url: str, registry: Registry,
                 fakes: dict[str, FakeVllm], urls: dict[str, str], key_file: Path) -> None:
        self.client, self.admin_url, self.registry = client, admin_url, registry
        self.fakes, self.urls, self.key_file = fakes, urls, key_file

    async def admin(self, *argv: str, key: bool = True) -> tuple[int, str, str]:
        """``kvdisagg admin ARGV --proxy <this proxy> --key-file <its key>`` in a thread (the
        CLI is synchronous; the proxy runs on this loop)."""
        words = [*argv, "--proxy", self.admin_url]
        if key:
            words += ["--key-file", str(self.key_file)]
        args = parser().parse_args(words)
        out, err = io.StringIO(), io.StringIO()
        code = await asyncio.to_thread(admin_run, args, out, err)
        return code, out.getvalue(), err.getvalue()


@contextlib.asynccontextmanager
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    fakes = {n: FakeVllm(n) for n in ("p0", "d0", "d1")}
    servers = {n: TestServer(f.app(), host="127.0.0.1") for n, f in fakes.items()}
    for s in servers.values():
        await s.start_server()
    urls = {n: str(s.make_url("")).rstrip("/") for n, s in servers.items()}
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    cfg = ProxyConfig(
        instances=[InstanceSpec(url=urls["p0"], role=Role.PREFILL),
                   InstanceSpec(url=urls["d0"], role=Role.DECODE)],
        admin=AdminConfig(key_file=str(key_file), allowed_targets=["127.0.0.0/8"]),
        health=HealthConfig(interval_s=0.2, timeout_s=0.5, startup_timeout_s=2.0),
        timeouts=TimeoutConfig(prefill_s=2.0, decode_connect_s=2.0, decode_total_s=10.0,
                               decode_idle_s=5.0))
    app = make_app(config=cfg)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    admin = TestServer(app[ADMIN], host="127.0.0.1")
    await client.start_server()
    await admin.start_server()
    try:
        yield Fleet(client, f"http://127.0.0.1:{admin.port}", app[REGISTRY], fakes, urls,
                    key_file)
    finally:
        await admin.close()
        await client.close()
        for s in servers.values():
            await s.close()


def test_every_subcommand_changes_the_proxy(tmp_path: Path) -> None:
    async def t() -> None:
        async with fleet(tmp_path) as f:
            reg, d1 = f.registry, f.urls["d1"]
            code, out, err = await f.admin("list")
            assert code == AdminExit.OK, err
            lines = out.splitlines()
            assert lines[0].split()[:4] == ["URL", "ROLE", "STATE", "HEALTHY"]
            assert {ln.split()[0] for ln in lines[1:]} == {f.urls["p0"], f.urls["d0"]}
            code, out, _ = await f.admin("list", "--json")
            assert code == AdminExit.OK
            assert len(json.loads(out)["instances"]) == 2
            # add: probed, then routed to
            code, out, err = await f.admin("add", "--url", d1, "--role", "decode")
            assert code == AdminExit.OK, err
            assert f"added {d1} as decode: healthy" in out
            assert reg.get(d1).role is Role.DECODE and reg.get(d1).healthy
            for _ in range(4):
                assert (await f.client.post("/v1/completions", json=GEN)).status == 200
            assert len(f.fakes["d1"].seen) == 2
            # drain with a request in flight on it: waits for it, then it takes no new work
            f.fakes["d1"].delay_s = f.fakes["d0"].delay_s = 0.6
            reqs = [asyncio.create_task(f.client.post("/v1/completions", json=GEN))
                    for _ in range(2)]
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            code, out, err = await f.admin("drain", "--url", d1, "--timeout", "5")
            assert code == AdminExit.OK, err
            assert time.monotonic() - t0 > 0.2 and f"drained {d1}: idle" in out
            assert [(await q).status for q in reqs] == [200, 200]
            assert reg.get(d1).state is State.DRAINING
            f.fakes["d1"].delay_s = f.fakes["d0"].delay_s = 0.0
            n = len(f.fakes["d1"].seen)
            assert (await f.client.post("/v1/completions", json=GEN)).status == 200
            assert len(f.fakes["d1"].seen) == n  # drained: no new work
            # undrain
            code, out, _ = await f.admin("undrain", "--url", d1)
            assert code == AdminExit.OK and "active" in out
            assert reg.get(d1).state is State.ACTIVE
            # a drain that runs out of time: exit 4, not removed, no new work
            f.fakes["d1"].delay_s = f.fakes["d0"].delay_s = 1.5
            reqs = [asyncio.create_task(f.client.post("/v1/completions", json=GEN))
                    for _ in range(2)]
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            code, out, _ = await f.admin("drain", "--url", d1, "--timeout", "0.3", "--remove")
            assert code == AdminExit.NOT_DRAINED and time.monotonic() - t0 < 1.2
            assert "legs still in flight after 0.3s: 1" in out and "not removed" in out
            assert reg.get(d1).state is State.DRAINING
            assert [(await q).status for q in reqs] == [200, 200]
            # now idle: drain --remove takes it out
            code, out, _ = await f.admin("drain", "--url", d1, "--timeout", "1", "--remove")
            assert code == AdminExit.OK and "removed" in out and d1 not in reg.instances
            # an instance the proxy does not know
            code, _, err = await f.admin("remove", "--url", d1)
            assert code == AdminExit.REFUSED and f"HTTP 404: no instance {d1} in the fleet" in err
            for cmd in ("remove", "drain"):
                code, _, err = await f.admin(cmd, "--url", d1, "--missing-ok")
                assert code == AdminExit.OK and "ignored: --missing-ok" in err
            code, _, err = await f.admin("add", "--url", "http://10.9.9.9:8000", "--role",
                                         "decode")
            assert code == AdminExit.REFUSED and "HTTP 403" in err and "allowed_targets" in err
            # remove a static member
            code, out, _ = await f.admin("remove", "--url", f.urls["d0"])
            assert code == AdminExit.OK and f.urls["d0"] not in reg.instances
            assert set(reg.instances) == {f.urls["p0"]}
    asyncio.run(t())


def test_key_errors_and_unreachable_proxies_exit_with_their_status(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVDISAGG_ADMIN_KEY", raising=False)

    async def t() -> None:
        async with fleet(tmp_path) as f:
            before = set(f.registry.instances)
            code, _, err = await f.admin("remove", "--url", f.urls["d0"], key=False)
            assert code == AdminExit.REFUSED and "HTTP 401" in err and "Bearer" in err
            monkeypatch.setenv("KVDISAGG_ADMIN_KEY", "wrong")
            code, _, err = await f.admin("remove", "--url", f.urls["d0"], key=False)
            assert code == AdminExit.REFUSED and "HTTP 401" in err
            assert set(f.registry.instances) == before  # nothing changed
            monkeypatch.setenv("KVDISAGG_ADMIN_KEY", KEY)  # the key from the environment
            code, _, err = await f.admin("list", key=False)
            assert code == AdminExit.OK, err
            monkeypatch.delenv("KVDISAGG_ADMIN_KEY")
            f.key_file = tmp_path / "missing"
            code, _, err = await f.admin("list")
            assert code == AdminExit.USAGE and "--key-file: cannot read" in err
            (tmp_path / "empty").write_text("\n")
            f.key_file = tmp_path / "empty"
            code, _, err = await f.admin("list")
            assert code == AdminExit.USAGE and "is empty" in err
            f.key_file = tmp_path / "key"
            code, _, err = await f.admin("list", "--key", KEY)
            assert code == AdminExit.USAGE and "--key is not accepted" in err
            code, _, err = await f.admin("list", "--timeout", "0")
            assert code == AdminExit.USAGE and "--timeout" in err
            f.admin_url = "ftp://127.0.0.1:1"
            code, _, err = await f.admin("list")
            assert code == AdminExit.USAGE and "--proxy" in err

        # refused connection: at once
        args = parser().parse_args(["list", "--proxy", f"http://127.0.0.1:{free_port()}"])
        err = io.StringIO()
        assert admin_run(args, io.StringIO(), err) == AdminExit.UNREACHABLE
        assert "cannot reach the proxy's admin API" in err.getvalue()
        # a proxy that accepts and never answers: bounded by --timeout
        held: list[asyncio.StreamWriter] = []

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            held.append(writer)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            args = parser().parse_args(["list", "--proxy", f"http://127.0.0.1:{port}",
                                        "--timeout", "0.5"])
            err = io.StringIO()
            t0 = time.monotonic()
            code = await asyncio.to_thread(admin_run, args, io.StringIO(), err)
            assert code == AdminExit.UNREACHABLE and time.monotonic() - t0 < 2.0
            assert "no answer within 0.5s" in err.getvalue()
        finally:
            for w in held:
                w.close()
            server.close()
            await server.wait_closed()
    asyncio.run(t())


def test_the_console_command_runs_as_a_hook_would(tmp_path: Path) -> None:
    """``kvdisagg admin`` as a process (the preStop hook's form): the exit status reaches the
    caller, the proxy is named by the environment, no key on the command line."""
    async def t() -> None:
        async with fleet(tmp_path) as f:
            env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + str(ROOT),
                   "KVDISAGG_PROXY_ADMIN": f.admin_url, "KVDISAGG_ADMIN_KEY": KEY,
                   "HTTP_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"}
            cmd = [sys.executable, "-m", "kvdisagg.cli", "admin", "drain", "--url",
                   f.urls["d0"], "--timeout", "5"]
            proc = await asyncio.create_subprocess_exec(
                *cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
            assert f"drained {f.urls['d0']}: idle" in out.decode()  # env proxies ignored
            assert f.registry.get(f.urls["d0"]).state is State.DRAINING
    asyncio.run(t())


def test_exit_statuses_are_documented() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for e in AdminExit:
        assert f"| {e.value} |" in doc, f"docs/configuration.md: exit status {e.value} ({e.name})"


def test_admin_is_a_kvdisagg_command() -> None:
    from kvdisagg.cli import COMMANDS
    from kvdisagg.proxy import admin_cli, config
    assert COMMANDS["admin"].module == "kvdisagg.proxy.admin_cli"
    # the client and the proxy read one variable
    assert admin_cli.ADMIN_KEY_ENV == config.ADMIN_KEY_ENV == "KVDISAGG_ADMIN_KEY"


def test_each_address_drains_at_every_proxy_replica(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--each-address``: one name (a headless Service) resolving to two proxies on one port
    (127.0.0.1 and 127.0.0.2) and to a third address where nothing listens: the drain reaches
    both proxies at once, each answer is printed after its address, and the unreachable one
    sets the exit status."""
    from kvdisagg.proxy import admin_cli

    async def t() -> None:
        async with fleet(tmp_path) as f:
            second = make_app(config=ProxyConfig(
                instances=[InstanceSpec(url=f.urls["d0"], role=Role.DECODE)],
                admin=AdminConfig(key_file=str(f.key_file)),
                health=HealthConfig(interval_s=0.2, timeout_s=0.5, startup_timeout_s=2.0)))
            client = TestClient(TestServer(second, host="127.0.0.1"))
            await client.start_server()
            port = int(f.admin_url.rsplit(":", 1)[1])
            admin2 = TestServer(second[ADMIN], host="127.0.0.2", port=port)
            await admin2.start_server()
            resolved: list[tuple[str, int]] = []

            def resolve(host: str, p: int) -> list[str]:
                resolved.append((host, p))
                return ["127.0.0.1", "127.0.0.2"]
            monkeypatch.setattr(admin_cli, "resolve_addresses", resolve)
            try:
                f.admin_url = f"http://kvdisagg-proxy-admin:{port}"
                d0 = f.urls["d0"]
                code, out, err = await f.admin("drain", "--url", d0, "--timeout", "5",
                                               "--each-address")
                assert code == AdminExit.OK, err
                assert resolved == [("kvdisagg-proxy-admin", port)]
                for ip in ("127.0.0.1", "127.0.0.2"):
                    assert f"http://{ip}:{port}: drained {d0}: idle" in out
                assert f.registry.get(d0).state is State.DRAINING
                assert second[REGISTRY].get(d0).state is State.DRAINING
                # a replica that does not answer: the others are still drained, exit 3
                code, out, _ = await f.admin("undrain", "--url", d0, "--each-address")
                assert code == AdminExit.OK and out.count("active") == 2
                monkeypatch.setattr(admin_cli, "resolve_addresses",
                                    lambda h, p: ["127.0.0.1", "127.0.0.2", "127.0.0.3"])
                code, out, err = await f.admin("drain", "--url", d0, "--timeout", "5",
                                               "--each-address")
                assert code == AdminExit.UNREACHABLE
                assert out.count("idle") == 2 and f"http://127.0.0.3:{port}: " in err
                assert second[REGISTRY].get(d0).state is State.DRAINING
                # no address at all; https refused (a certificate names a host)
                def nothing(h: str, p: int) -> list[str]:
                    raise admin_cli.Unreachable(f"{h}: Name or service not known")
                monkeypatch.setattr(admin_cli, "resolve_addresses", nothing)
                code, _, err = await f.admin("list", "--each-address")
                assert code == AdminExit.UNREACHABLE and "Name or service not known" in err
                f.admin_url = f"https://kvdisagg-proxy-admin:{port}"
                code, _, err = await f.admin("list", "--each-address")
                assert code == AdminExit.USAGE and "--each-address" in err
            finally:
                await admin2.close()
                await client.close()
    asyncio.run(t())


def test_resolve_addresses_is_getaddrinfo() -> None:
    from kvdisagg.proxy import admin_cli
    assert admin_cli.resolve_addresses("127.0.0.1", 8001) == ["127.0.0.1"]
    with pytest.raises(admin_cli.Unreachable, match="no-such-host.invalid"):
        admin_cli.resolve_addresses("no-such-host.invalid", 8001)
