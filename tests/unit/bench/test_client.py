"""kvdisagg bench against fake OpenAI streaming servers on loopback (tests.support.fake_vllm):
what the client measures, how it fails (bounded), the proxy comparison, and the CLI's files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvdisagg.bench.client import ClientConfig, send
from kvdisagg.bench.records import RequestRecord, Slo
from kvdisagg.bench.runner import Endpoint, run_once
from kvdisagg.bench.workload import LengthDist, RequestSpec, build
from kvdisagg.proxy import make_app
from kvdisagg.proxy.config import DecisionConfig, InstanceSpec, ProxyConfig, SloConfig
from kvdisagg.proxy.types import Role
from tests.support.fake_vllm import FakeVllm

CFG = ClientConfig(model="tiny", idle_s=2.0, total_s=5.0, connect_s=1.0)


@contextlib.asynccontextmanager
async def serve(fake: FakeVllm) -> AsyncIterator[str]:
    server = TestServer(fake.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def fake(tokens: int = 6, token_delay_s: float = 0.0, **attrs: Any) -> FakeVllm:
    f = FakeVllm("f", tokens=tokens)
    f.token_delay_s = token_delay_s
    f.use_max_tokens = True
    for k, v in attrs.items():
        setattr(f, k, v)
    return f


async def one(f: FakeVllm, spec: RequestSpec, cfg: ClientConfig = CFG) -> RequestRecord:
    rec = RequestRecord(endpoint="e", run="r", index=0, rate=None, scheduled_at_s=0.0,
                        sent_at_s=0.0, prompt_len=spec.prompt_len, output_len=spec.output_len)
    async with serve(f) as url, aiohttp.ClientSession() as s:
        return await send(s, url, spec, cfg, rec, time.perf_counter())


SPEC = RequestSpec(0, 0.0, 3, 5, [11, 12, 13])


def test_stream_timing_and_request_body() -> None:
    f = fake(token_delay_s=0.03, delay_s=0.1)
    r = asyncio.run(one(f, SPEC))
    assert r.ok and r.error is None and r.status == 200
    assert r.output_tokens == 5 and len(r.itl_s) == 4
    assert 0.12 <= r.ttft_s < 0.5  # server delay + first token's delay
    assert all(0.02 < g < 0.2 for g in r.itl_s)
    assert r.tpot_s == pytest.approx(sum(r.itl_s) / 4)
    assert r.e2e_s >= r.ttft_s + sum(r.itl_s) and r.done_at_s is not None
    body = f.seen[0]["body"]
    assert body == {"model": "tiny", "stream": True, "temperature": 0.0, "max_tokens": 5,
                    "ignore_eos": True, "prompt": [11, 12, 13]}


def test_chat_body() -> None:
    f = fake()
    r = asyncio.run(one(f, RequestSpec(0, 0.0, 2, 3, "hi there"),
                        ClientConfig(model="m", api="chat")))
    assert r.ok and r.output_tokens == 3
    assert f.seen[0]["path"] == "/v1/chat/completions"
    assert f.seen[0]["body"]["messages"] == [{"role": "user", "content": "hi there"}]


def test_http_error_is_recorded_with_message() -> None:
    r = asyncio.run(one(fake(status=503), SPEC))
    assert not r.ok and r.status == 503
    assert r.error is not None and r.error.startswith("HTTP 503") and "f says no" in r.error


def test_broken_stream_is_a_failure() -> None:
    r = asyncio.run(one(fake(die_after=2), SPEC))
    assert not r.ok and r.output_tokens == 0 and r.error


def test_silent_stream_times_out_within_bound() -> None:
    t0 = time.monotonic()
    r = asyncio.run(one(fake(hang_after=1), SPEC, ClientConfig(model="m", idle_s=0.3,
                                                              total_s=3.0)))
    assert not r.ok and r.error is not None and r.error.startswith("timeout")
    assert time.monotonic() - t0 < 2.5


def test_unreachable_endpoint_is_a_failure() -> None:
    from kvdisagg.local.servers import free_port

    async def go() -> RequestRecord:
        rec = RequestRecord(endpoint="e", run="r", index=0, rate=None, scheduled_at_s=0.0,
                            sent_at_s=0.0, prompt_len=1, output_len=1)
        async with aiohttp.ClientSession() as s:
            return await send(s, f"http://127.0.0.1:{free_port()}", SPEC, CFG, rec,
                              time.perf_counter())
    r = asyncio.run(go())
    assert not r.ok and "Connect" in (r.error or "")


def test_open_loop_sends_on_schedule_despite_slow_answers() -> None:
    """Every request takes ~0.5 s; arrivals every 0.05 s must not wait for earlier answers."""
    async def go():
        f = fake(delay_s=0.5)
        specs = [RequestSpec(i, i * 0.05, 2, 2, [20, 21]) for i in range(8)]
        async with serve(f) as url:
            return await run_once(Endpoint("e", url), specs, CFG, Slo(ttft_s=0.3, tpot_s=0.1),
                                  run="e@20", rate=20.0)
    out = asyncio.run(go())
    lags = [r.sent_at_s - r.scheduled_at_s for r in out.records]
    assert max(lags) < 0.05
    assert out.summary.ok == 8 and out.summary.attainment == 0.0  # TTFT ~0.5 s > 0.3 s
    assert out.summary.proxy is None  # a plain server has no kvdisagg_proxy_* metrics


def test_proxy_accounting_matches_bench() -> None:
    """Through a real kvdisagg proxy app (fake upstreams), a third of the requests slow: the
    proxy's SLO counters and goodput gauge agree with what bench measured."""
    out = asyncio.run(go_slow())
    s, pv = out.summary, out.summary.proxy
    assert pv is not None
    good = sum(r.met_both for r in out.records)
    assert s.ok == 24 and 0 < good < 24
    assert pv.judged == 24 and pv.met_both == good
    assert pv.bench_met_both_per_event == good  # one token per event: the definitions agree
    assert pv.attainment == pytest.approx(s.attainment)
    assert pv.goodput_rps == pytest.approx(s.goodput_rps)
    assert pv.gauge_goodput_rps is not None and pv.bench_window_goodput_rps is not None
    assert abs(pv.gauge_goodput_rps - pv.bench_window_goodput_rps) <= 1.0 + 1e-9  # 1 req/1 s


class SlowSome(FakeVllm):
    """Decode fake that holds back requests whose prompt starts with token 1."""

    async def generate(self, request):  # type: ignore[override]
        body = json.loads(await request.read())
        if body.get("stream") and body["prompt"][0] == 1:
            await asyncio.sleep(0.3)
        return await super().generate(request)


async def go_slow():
    p = FakeVllm("p")
    d = SlowSome("d", tokens=4)
    d.token_delay_s, d.use_max_tokens = 0.01, True
    async with serve(p) as purl, serve(d) as durl:
        cfg = ProxyConfig(instances=[InstanceSpec(url=purl, role=Role.PREFILL),
                                     InstanceSpec(url=durl, role=Role.DECODE)],
                          slo=SloConfig(ttft_s=0.2, tpot_s=0.05, window_s=1.0),
                          decision=DecisionConfig(enabled=False))
        proxy = TestServer(make_app(config=cfg), host="127.0.0.1")
        await proxy.start_server()
        try:
            url = str(proxy.make_url("")).rstrip("/")
            specs = build(24, 20.0, seed=2, salt=1, prompt_len=LengthDist("8"),
                          output_len=LengthDist("uniform:2:6"))
            specs = [s._replace(prompt=[1 if s.index % 3 == 0 else 2, *s.prompt[1:]])
                     for s in specs]
            return await run_once(Endpoint("px", url, gpus=2), specs, CFG,
                                  Slo(ttft_s=0.2, tpot_s=0.05), run="px@20", rate=20.0,
                                  proxy_window_s=1.0)
        finally:
            await proxy.close()


def test_cli_compares_endpoints_and_writes_records_summary_plots(tmp_path: Path) -> None:
    """``kvdisagg bench`` as a user runs it: two fake endpoints, two rates, in a subprocess."""
    from kvdisagg.local.servers import free_port

    ports = [free_port(), free_port()]
    root = Path(__file__).resolve().parents[3]  # where ``tests.support`` is importable
    fakes = [subprocess.Popen([sys.executable, "-m", "tests.support.fake_vllm", "--port",
                               str(p), "--tokens", "4"], cwd=root) for p in ports]
    try:
        for p in ports:
            _wait_port(p)
        out = tmp_path / "out"
        res = subprocess.run(
            [sys.executable, "-m", "kvdisagg.cli", "bench", "--url", f"a=http://127.0.0.1:{ports[0]}",
             "--url", f"b=http://127.0.0.1:{ports[1]}", "--gpus", "1", "2", "--rate", "10", "40",
             "--num-requests", "12", "--ttft-slo", "0.5", "--tpot-slo", "0.05", "--quiet",
             "--json", "--out", str(out)], capture_output=True, text=True, timeout=60)
    finally:
        for f in fakes:
            f.kill()
            f.wait()
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert [(r["endpoint"], r["rate"]) for r in summary["runs"]] == [
        ("a", 10.0), ("b", 10.0), ("a", 40.0), ("b", 40.0)]
    assert all(r["requests"] == 12 and r["attainment"] == 1.0 for r in summary["runs"])
    b = summary["sweeps"][1]
    assert b["endpoint"] == "b" and b["censored"] and b["max_rate_per_gpu"] == 20.0
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == 48 and json.loads(lines[0])["output_tokens"] == 4
    assert json.loads((out / "summary.json").read_text()) == summary
    for png in ("attainment_vs_rate.png", "latency_cdf.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "SLO attainment" in res.stderr and "Goodput" in res.stderr


def test_cli_refuses_bad_arguments() -> None:
    from kvdisagg.cli import main

    with pytest.raises(SystemExit, match="--gpus has 2 values for 1 --url"):
        main(["bench", "--url", "http://127.0.0.1:1", "--gpus", "1", "2", "--rate", "1",
              "--model", "m"])
    with pytest.raises(SystemExit, match="must start with http"):
        main(["bench", "--url", "x=ftp://h", "--rate", "1", "--model", "m"])
    with pytest.raises(SystemExit, match="--rate R"):
        main(["bench", "--url", "http://127.0.0.1:1", "--model", "m"])
    with pytest.raises(SystemExit, match="unknown kind"):
        main(["bench", "--url", "http://127.0.0.1:1", "--model", "m", "--rate", "1",
              "--prompt-len", "zipf:2"])


def _wait_port(port: int, timeout_s: float = 20.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"fake server on {port} did not start")


def test_endpoint_names_and_gpus() -> None:
    import argparse

    from kvdisagg.bench.cli import _endpoints

    eps = _endpoints(argparse.Namespace(url=["a=http://h:1/v?x=2", "http://h:2/"], gpus=[3]))
    assert [(e.name, e.url, e.gpus) for e in eps] == [("a", "http://h:1/v?x=2", 3),
                                                      ("ep1", "http://h:2", 3)]
    with pytest.raises(SystemExit, match="names must differ"):
        _endpoints(argparse.Namespace(url=["a=http://h:1", "a=http://h:2"], gpus=[1]))


class ScriptedMetrics:
    """An instance's /metrics that answers each scrape as scripted: a status code, or "slow"
    (past the scrape's timeout). Each readable page reports 3 more transfers than the last."""

    def __init__(self, script: list[int | str]) -> None:
        self.script, self.pages = list(script), 0

    async def metrics(self, request: Any) -> Any:
        from aiohttp import web

        step = self.script.pop(0) if self.script else 200
        if step == "slow":
            await asyncio.sleep(30)
        if step != 200:
            return web.Response(status=int(step))
        self.pages += 1
        n = 3 * self.pages
        return web.Response(text=f'vllm:kvdisagg_phase_seconds_count{{phase="transfer"}} {n}\n'
                                 f'vllm:kvdisagg_phase_seconds_sum{{phase="transfer"}} {n}\n')


async def phases_with(script: list[int | str]) -> Any:
    from aiohttp import web

    scripted = ScriptedMetrics(script)
    app = web.Application()
    app.router.add_get("/metrics", scripted.metrics)
    async with serve(fake()) as url:
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            inst = str(server.make_url("")).rstrip("/")
            out = await run_once(Endpoint("e", url), [RequestSpec(0, 0.0, 2, 2, [20, 21])], CFG,
                                 Slo(ttft_s=1, tpot_s=1), run="e@1", rate=1.0,
                                 phase_urls=[inst])
            return inst, out.summary
        finally:
            await server.close()


def test_a_busy_instances_metrics_are_read_again() -> None:
    """Two 503s, then the page: the run's phases are the delta of two readings (3 transfers)."""
    inst, s = asyncio.run(phases_with([503, 503, 200]))
    assert [(p.where, p.phase, p.count) for p in s.phases] == [(inst, "transfer", 3)]
    assert s.metrics_unread == []


def test_an_unreadable_start_leaves_the_phases_unknown_not_counted_from_zero(monkeypatch) -> None:
    """Each try at the opening scrape past its timeout: no phases for the instance (its totals
    since start are not the run's) and the URL in metrics_unread; the endpoint's own are read."""
    from kvdisagg.bench import scrape

    real = scrape.fetch
    monkeypatch.setattr(scrape, "fetch", lambda s, u, timeout_s=5.0, attempts=3:
                        real(s, u, timeout_s=0.3, attempts=attempts))
    inst, s = asyncio.run(phases_with(["slow", "slow", "slow", 200]))
    assert s.phases == [] and s.metrics_unread == [inst]
    assert s.ok == 1
