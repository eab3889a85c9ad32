"""``kvdisagg doctor``: each check against real components (a prefill transport in its own
process, an HTTP server on a socket); no vLLM processes."""

from __future__ import annotations

import asyncio
import email.utils
import json
import re
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
from aiohttp import web

from kvdisagg.cli import doctor, main
from kvdisagg.local.servers import free_port
from tests.support.fake_vllm import FakeVllm
from tests.support.transport_peer import KV_LAYOUT, PeerProcess

GOOD = {"kv_connector": "DisaggConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"transport": "tcp"}}


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[doctor.Finding]]:
    rc = main(["doctor", "--json", *argv])
    out = capsys.readouterr().out
    return rc, msgspec.json.decode(out, type=list[doctor.Finding])


def only(findings: list[doctor.Finding], check: str) -> list[doctor.Finding]:
    return [f for f in findings if f.check.startswith(check)]


# ---- config and transport --------------------------------------------------------------------


def test_good_config_passes_and_json_parses(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    rc, findings = run_json(capsys, "--kv-transfer-config", json.dumps(GOOD))
    assert rc == 0, findings
    assert {f.status for f in findings} == {"ok"}, findings
    assert only(findings, "config")[0].message == "DisaggConnector, kv_consumer, transport=tcp"
    assert [f.check for f in findings][:2] == ["vllm", "plugin"]


def test_unknown_extra_key_fails_naming_it(capsys):
    bad = {**GOOD, "kv_connector_extra_config": {"transprot": "tcp"}}
    rc, findings = run_json(capsys, "--kv-transfer-config", json.dumps(bad))
    assert rc == 1
    (f,) = only(findings, "config")
    assert f.status == "fail" and "transprot" in f.message and f.fix


def test_wrong_connector_and_role_fail():
    found, config = doctor.check_config(json.dumps(
        {**GOOD, "kv_connector": "NixlConnector", "kv_role": "producer"}))
    assert [f.status for f in found] == ["fail", "fail"]
    assert "'NixlConnector'" in found[0].message and "DisaggConnector" in found[0].message
    assert "'producer'" in found[1].message
    assert config is not None  # the extra config itself is fine


def test_transport_that_cannot_import_fails(capsys):
    extra = {**GOOD, "kv_connector_extra_config": {"transport": "nosuch.module:Transport"}}
    rc, findings = run_json(capsys, "--kv-transfer-config", json.dumps(extra))
    assert rc == 1
    (f,) = only(findings, "transport")
    assert f.status == "fail"
    assert "nosuch.module:Transport" in f.message and "nosuch" in f.message


def test_lmcache_server_down_fails_within_bound():
    from kvdisagg.connector.config import parse_config

    port = free_port()
    config = parse_config({"transport": "lmcache", "lmcache_url": f"lm://127.0.0.1:{port}"})
    found = doctor.check_transport("lmcache", config, timeout_s=1.0)
    assert found[0].status == "ok"  # lmcache imports here
    assert found[-1].status == "fail" and f"lm://127.0.0.1:{port}" in found[-1].message


# ---- CPU core binding ------------------------------------------------------------------------


def test_unset_cpu_binding_warns_on_this_cpu_host(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    (f,) = doctor.check_cpu_binding()
    assert f.status == "warn"
    assert "same cores" in f.message and "VLLM_CPU_OMP_THREADS_BIND=0" in f.fix
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert doctor.check_cpu_binding()[0].status == "warn"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert doctor.check_cpu_binding()[0].status == "ok"


# ---- side channel against a real prefill transport -------------------------------------------


@pytest.fixture(scope="module")
def prefill() -> Iterator[PeerProcess]:
    peer = PeerProcess("tcp", {})
    try:
        yield peer
    finally:
        peer.close()


def test_side_channel_ok_reports_prefill_layout(prefill, capsys):
    address = f"127.0.0.1:{prefill.port}"
    (f,) = doctor.check_side_channel(address, transport="tcp")  # learns the layout
    assert f.status == "ok" and KV_LAYOUT in f.message
    rc, findings = run_json(capsys, "--side-channel", address, "--kv-layout", KV_LAYOUT)
    (f,) = only(findings, "side-channel")
    assert f.status == "ok" and KV_LAYOUT in f.message
    # the control connections set up nothing: prefill still serves its side channel
    assert prefill.ask(op="released") == {"released": []}


def test_side_channel_layout_mismatch_names_both(prefill):
    (f,) = doctor.check_side_channel(f"127.0.0.1:{prefill.port}", transport="tcp",
                                     kv_layout="decode-layout")
    assert f.status == "fail"
    assert "mismatch" in f.message and KV_LAYOUT in f.message and "decode-layout" in f.message


def test_side_channel_wrong_transport_is_refused(prefill):
    (f,) = doctor.check_side_channel(f"127.0.0.1:{prefill.port}", transport="nccl")
    assert f.status == "fail" and "refused" in f.message and "'nccl'" in f.message


def test_side_channel_unreachable_fails_within_bound():
    start = time.monotonic()
    (f,) = doctor.check_side_channel(f"127.0.0.1:{free_port()}", timeout_s=1.0)
    assert time.monotonic() - start < 3.0
    assert f.status == "fail" and "cannot connect" in f.message


# ---- running instances: a real HTTP server whose clock is off --------------------------------


class ConnectorVllm(FakeVllm):
    """FakeVllm whose /metrics carry the connector's counters and /version a version, as a
    vLLM running DisaggConnector does."""

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text='vllm:kvdisagg_handoffs_total{engine="0"} 0.0\n')

    async def version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/version", self.version)
        return app


class Server:
    """A fake vLLM on a socket, served from a thread, its Date header ``skew_s`` off."""

    def __init__(self, skew_s: float, connector: bool) -> None:
        self.app = (ConnectorVllm() if connector else FakeVllm()).app()

        async def skew(_request: web.Request, response: web.StreamResponse) -> None:
            response.headers["Date"] = email.utils.formatdate(time.time() + skew_s, usegmt=True)

        self.app.on_response_prepare.append(skew)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        self.loop.run_until_complete(site.start())
        started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def server_factory() -> Iterator:
    servers: list[Server] = []

    def make(skew_s: float = 0.0, connector: bool = True) -> Server:
        servers.append(Server(skew_s, connector))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_instance_with_clock_10s_off_warns_skew(server_factory, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    server = server_factory(skew_s=10.0)
    rc, findings = run_json(capsys, "--vllm", server.url)
    assert rc == 0  # skew is informative only
    mine = only(findings, "vllm http")
    assert [f.status for f in mine] == ["ok", "ok", "warn"], mine
    assert "vLLM 0.32.0" in mine[0].message
    assert "connector metrics present" in mine[1].message
    assert re.search(r"clock skew about \+(9|10)s", mine[2].message), mine[2].message
    assert "lease_expires" in mine[2].message


def test_instance_in_sync_without_connector(server_factory):
    server = server_factory(skew_s=0.0, connector=False)
    found = doctor.check_instance(server.url)
    assert [f.status for f in found] == ["ok", "warn", "ok"], found
    assert "vllm:kvdisagg_" in found[1].message
    assert "within 1s" in found[2].message


def test_instance_unreachable_fails_within_bound():
    start = time.monotonic()
    found = doctor.check_instance(f"http://127.0.0.1:{free_port()}", timeout_s=1.0)
    assert time.monotonic() - start < 3.0
    assert [f.status for f in found] == ["fail"] and "unreachable" in found[0].message


def test_table_output_and_exit_code(capsys):
    assert main(["doctor", "--transport", "nosuch.module:Transport"]) == 1
    out = capsys.readouterr().out
    assert "kvdisagg doctor" in out and "fail" in out


def test_doctor_prints_plain_lines_without_rich(capsys, monkeypatch):
    """doctor is in the base install (vLLM hosts): without rich its table is plain lines."""
    import builtins

    real = builtins.__import__

    def no_rich(name, *args, **kw):
        if name.partition(".")[0] == "rich":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_rich)
    doctor._print_table([doctor.Finding(check="plugin", status="ok", message="loaded"),
                         doctor.Finding(check="fleet", status="fail", message="down",
                                        fix="start it")])
    assert capsys.readouterr().out.splitlines() == [
        "ok   plugin: loaded", "fail fleet: down (fix: start it)"]
