"""Overload, and what waiting costs: P/D vs a plain vLLM instance, one run, one machine.

    .venv/bin/python benchmarks/overload.py [--binds own-cores|vllm-defaults] [--out out/overload]

1. CPU while waiting (CPU-seconds per second, every process of an instance, from /proc):
   - a prefill instance holding 8 unpulled handoffs: staged in its arena (the default) vs paged
     (``staging_blocks: 0``: vLLM keeps the requests and steps its engine), vs idle;
   - a decode instance with 4 requests waiting for KV (their prefill stalled with SIGSTOP) vs idle.
2. The overload burst of tests/e2e/test_overload.py (40 streamed requests at once, 16 decode
   slots, outputs of 1-2040 tokens) against the plain instance, then through the proxy to the
   1P1D pair: answered, token-identical, makespan, TTFT/TPOT percentiles, SLO attainment and
   goodput per instance (the pair counts as two).

Instances: the plain one, the pair, and a second prefill with staging off (for 1 only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvdisagg.bench.attainment import duration, judge, percentiles
from kvdisagg.bench.client import ClientConfig, send
from kvdisagg.bench.records import RequestRecord, Slo
from kvdisagg.bench.workload import RequestSpec
from kvdisagg.local.fleet import Fleet, kv_transfer_args
from kvdisagg.local.servers import VllmServer
from kvdisagg.local.tiny_model import ensure_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.e2e.conftest import post, prompt_ids
from tests.e2e.test_overload import BURST, SHAPES

TICKS = os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """utime + stime of every live process in process group ``pgid``."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 (pgrp), counted after the command name
            total += int(fields[11]) + int(fields[12])
    return total / TICKS


def cpu_rate(server: VllmServer, window_s: float) -> float:
    assert server.proc is not None
    before = group_cpu_s(server.proc.pid)
    time.sleep(window_s)
    return (group_cpu_s(server.proc.pid) - before) / window_s


def handoffs(prefill: VllmServer, n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        status, body = post(prefill.base_url + "/v1/completions",
                            {"model": "tiny", "prompt": prompt_ids(600, seed=900 + i),
                             "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert status == 200, body
        out.append(body["kv_transfer_params"])
    return out


def waiting_costs(fleet: Fleet, paged: VllmServer, window_s: float) -> dict[str, float]:
    time.sleep(window_s)  # let start-up work settle
    costs = {"prefill idle": cpu_rate(fleet.prefill, window_s),
             "decode idle": cpu_rate(fleet.decode, window_s)}
    held = handoffs(fleet.prefill, 8)
    time.sleep(1.5)  # vLLM's worker spins for ~1 s after its last step
    costs["prefill holding 8 staged handoffs"] = cpu_rate(fleet.prefill, window_s)
    handoffs(paged, 8)
    time.sleep(1.5)
    costs["prefill holding 8 paged handoffs (staging_blocks 0)"] = cpu_rate(paged, window_s)
    # Decode requests whose prefill is stalled: they wait for KV until the transfer timeout.
    fleet.prefill.pause()
    try:
        threads = [threading.Thread(target=post, daemon=True, args=(
            fleet.decode.base_url + "/v1/completions",
            {"model": "tiny", "prompt": prompt_ids(600, seed=900 + i), "max_tokens": 4,
             "kv_transfer_params": params})) for i, params in enumerate(held[:4])]
        for t in threads:
            t.start()
        time.sleep(1.5)
        costs["decode with 4 requests waiting for KV"] = cpu_rate(fleet.decode, window_s)
    finally:
        fleet.prefill.resume()
    for t in threads:
        t.join(timeout=120)
    return costs


async def burst(base_url: str, slo: Slo, run: str) -> list[RequestRecord]:
    cfg = ClientConfig(model="tiny", idle_s=600, total_s=1800,
                       extra_body={"return_token_ids": True})
    specs = [RequestSpec(i, 0.0, p, o, prompt_ids(p, seed=4000 + i))
             for i, (p, o) in ((i, SHAPES[i % len(SHAPES)]) for i in range(BURST))]
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        records = await asyncio.gather(*(send(
            session, base_url, s, cfg, RequestRecord(
                endpoint=run, run=run, index=s.index, rate=None, scheduled_at_s=0.0,
                sent_at_s=0.0, prompt_len=s.prompt_len, output_len=s.output_len), t0)
            for s in specs))
    return [judge(r, slo) for r in records]


def summary(records: list[RequestRecord], instances: int) -> dict[str, Any]:
    span = duration(records)
    good = sum(r.met_both for r in records)
    return {"answered": sum(r.ok for r in records), "of": len(records),
            "makespan_s": round(span, 1),
            "output_tokens_per_s": round(sum(r.output_tokens for r in records) / span, 1),
            "ttft_p50_s": percentiles([r.ttft_s for r in records if r.ttft_s]).p50,
            "ttft_p99_s": percentiles([r.ttft_s for r in records if r.ttft_s]).p99,
            "tpot_p50_ms": 1e3 * (percentiles([r.tpot_s for r in records if r.tpot_s]).p50 or 0),
            "tpot_p99_ms": 1e3 * (percentiles([r.tpot_s for r in records if r.tpot_s]).p99 or 0),
            "attainment": good / len(records),
            "goodput_per_instance": good / span / instances}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--binds", choices=["own-cores", "vllm-defaults"], default="own-cores")
    p.add_argument("--out", type=Path, default=Path("out/overload"))
    p.add_argument("--window", type=float, default=5.0, help="CPU sampling window, seconds")
    p.add_argument("--slo-ttft", type=float, default=20.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = ensure_tiny_model()
    defaults = args.binds == "vllm-defaults"
    binds = {"prefill": None, "decode": None, "reference": None} if defaults else {}
    fleet = Fleet(model, args.out / "logs", reference=True, binds=binds,
                  prefill_extra={"lease_seconds": 120},
                  decode_extra={"transfer_timeout_seconds": 30})
    paged = VllmServer(model, log_path=args.out / "logs" / "prefill-paged.log",
                       omp_threads_bind=None if defaults else "0",
                       extra_args=kv_transfer_args("kv_producer", {"staging_blocks": 0,
                                                                   "lease_seconds": 120}))
    paged.start()
    slo = Slo(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot)
    with fleet:
        paged.wait_ready(900)
        costs = waiting_costs(fleet, paged, args.window)
        paged.stop()
        plain = asyncio.run(burst(fleet.reference.base_url, slo, "plain"))
        fleet.wait_proxy_ready(120)  # its probes saw prefill stalled above
        pd = asyncio.run(burst(fleet.proxy_url, slo, "pd"))
    full = sum(a.ok and b.ok and a.output_tokens == b.output_tokens for a, b in zip(plain, pd))
    result = {"binds": args.binds, "cpu_s_per_s": {k: round(v, 3) for k, v in costs.items()},
              "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
              "plain": summary(plain, 1), "pd": summary(pd, 2),
              "both_answered_in_full": full}
    (args.out / f"result-{args.binds}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
