"""Faults on real vLLM, each with its exact outcome: which requests succeed (token-identical to a
plain run of the same prompt), what the proxy and the instances counted, the bound on any wait
for something that can die, and that nothing leaks afterwards (prefill's handoffs all freed and
its KV usage 0, no request left on a decode).

One small fleet for the file (1 prefill, 2 decodes, the proxy; not the session fleet: instances
are killed here), in this order:

- side channel cut mid-transfer (``CuttingTcpTransport``, armed for one pull): the load fails,
  the proxy re-prefills and retries on the other decode; the request succeeds;
- prefill stalled (SIGSTOP) for twice decode's transfer timeout, then resumed: every request
  succeeds, the burst is late by at most the stall plus the bounds that detect it;
- decode killed before its first byte (stopped while the legs reach it, then SIGKILLed): every
  leg it held is retried once on the other decode, which pulls each request's KV once; a
  handoff left behind by a re-prefill expires on prefill;
- decode killed mid-stream and mid-generation: every stream it served is migrated
  (migrate.py), every non-streamed request retried; all complete token-identical; nothing was
  held, nothing expires;
- prefill killed (SIGKILL) while holding handoffs (decode stopped while they were offered):
  every pull fails at once (refused), the proxy re-prefills, finds no prefill and serves
  decode-only (``retry.decode_only_fallback``): every request succeeds.

Corrupted KV bytes: tests/e2e/test_pd_serving.py::test_corrupted_transfer_fails_cleanly (and
the conformance suite, transport by transport). Prefill SIGTERM (drained): its own test with
graceful retirement. What "right" means: the plain answer of the same prompt, computed before
the fault by an instance of this fleet without a handoff (as tests/e2e/test_pd_serving.py
does with its prefill).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvdisagg.local.fleet import Fleet

from .conftest import (
    LOG_DIR,
    completion_tokens,
    metric,
    post,
    prompt_ids,
    wait_handoffs_freed,
    wait_kv_usage_zero,
    wait_metric_change,
)

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 6.0  # prefill: an unrenewed handoff is freed this long after its last renewal
TRANSFER_TIMEOUT_S = 4.0  # decode: a silent side-channel peer fails the pull after this
STALL_S = 2 * TRANSFER_TIMEOUT_S
HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S, HEALTH_FAILURES = 2.0, 5.0, 2
# The longest a proxy takes to see an instance stop answering its probes.
DETECT_S = HEALTH_FAILURES * (HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S)
PROXY_CONFIG = f"""
[health]
interval_s = {HEALTH_INTERVAL_S}
timeout_s = {HEALTH_TIMEOUT_S}
failure_threshold = {HEALTH_FAILURES}
success_threshold = 2

[retry]
prefill_attempts = 2
decode_attempts = 2
migrations = 2
decode_only_fallback = true
"""
CLIENT_TIMEOUT_S = 300.0  # a socket bound on a broken fleet; every case states its own
START_S = 600.0
PROXY = "kvdisagg_proxy_"


@pytest.fixture(scope="module")
def faults(model, tmp_path_factory, plain):
    """1P2D behind the proxy. Both decodes pull through ``CuttingTcpTransport``: the plain TCP
    transport until a test arms it (one pull per arming)."""
    tmp = tmp_path_factory.mktemp("faults")
    config = tmp / "proxy.toml"
    config.write_text(PROXY_CONFIG)
    arm = tmp / "cut-armed"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
           "KVDISAGG_TEST_CUT_ARM": str(arm)}
    fleet = Fleet(model, LOG_DIR / "faults", decodes=2, env=env,
                  binds={"prefill": "0", "decode": "1", "decode1": "0"},
                  prefill_extra={"lease_seconds": LEASE_S},
                  decode_extra={"transfer_timeout_seconds": TRANSFER_TIMEOUT_S,
                                "transport": "tests.support.faults:CuttingTcpTransport"},
                  proxy_args=["--config", str(config)], worker_in_engine=True)
    fleet.arm, fleet.plain = arm, plain
    with fleet:
        yield fleet


# -- requests ---------------------------------------------------------------------------------

def body(i: int, seed: int, *, stream: bool, max_tokens: int, n_prompt: int | None = None
         ) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt_ids(n_prompt or 150 + 120 * (i % 5), seed=seed + i),
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}


def expected(fleet: Fleet, items: list[dict[str, Any]], text: bool = False) -> list[Any]:
    """The plain answers: each prompt on a plain vLLM instance (the session's, no
    DisaggConnector; batched as a burst is: greedy answers do not depend on the batch)."""
    def one(b: dict[str, Any]) -> Any:
        status, reply = post(fleet.plain + "/v1/completions", {**b, "stream": False},
                             timeout=CLIENT_TIMEOUT_S)
        assert status == 200, reply
        choice = reply["choices"][0]
        return (choice["token_ids"], choice["text"]) if text else choice["token_ids"]

    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(one, items))


def send(fleet: Fleet, b: dict[str, Any], text: bool = False) -> tuple[str, Any]:
    return completion_tokens(fleet.proxy_url, b, CLIENT_TIMEOUT_S, text=text)


def start_burst(pool: ThreadPoolExecutor, fleet: Fleet, items: list[dict[str, Any]],
                text: bool = False) -> list[Future]:
    return [pool.submit(send, fleet, b, text) for b in items]


def all_right(futures: list[Future], want: list[list[int]]) -> None:
    results = [f.result() for f in futures]
    wrong = [(i, r[0], r[1] if r[0] != "ok" else "another answer")
             for i, (r, e) in enumerate(zip(results, want)) if r != ("ok", e)]
    assert not wrong, f"{len(wrong)}/{len(want)} not the plain answer: {wrong[:4]}"


# -- observation ------------------------------------------------------------------------------

def proxy_metric(fleet: Fleet, name: str, **labels: str) -> float:
    return metric(fleet.proxy_url, PROXY + name, **labels)


def wait_until(what: str, cond: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f}s: {what}"
        time.sleep(0.1)


def legs_on(fleet: Fleet, side: str, server=None) -> float:
    labels = {"side": side} if server is None else {"side": side, "instance": server.base_url}
    return proxy_metric(fleet, "instance_in_flight", **labels)


def pulls(fleet: Fleet, name: str = "vllm:kvdisagg_pulls_total") -> float:
    return sum(metric(d.base_url, name) for d in fleet.decodes if d.proc is not None)


def assert_nothing_leaks(fleet: Fleet, *, prefill: bool = True) -> None:
    """Prefill: every handoff it offered was freed (pulled, released or expired: within a
    lease) and its KV usage is back to 0; each live decode: no request running or waiting."""
    if prefill:
        offered, freed = wait_handoffs_freed(fleet.prefill.base_url, timeout_s=LEASE_S + 30)
        assert offered == freed, f"prefill holds {offered - freed} handoffs"
        assert wait_kv_usage_zero(fleet.prefill.base_url, 30) == 0
    for d in fleet.decodes:
        if d.proc is None:
            continue
        wait_until(f"{d.base_url} idle",
                   lambda d=d: metric(d.base_url, "vllm:num_requests_running")
                   + metric(d.base_url, "vllm:num_requests_waiting") == 0, 30)
    assert legs_on(fleet, "prefill") == 0 and legs_on(fleet, "decode") == 0


def restart(fleet: Fleet, server) -> None:
    if server.proc is None:
        server.start()
    server.wait_ready(START_S)
    fleet.wait_proxy_ready(120)


# -- cases ------------------------------------------------------------------------------------

@pytest.mark.timeout(900)
def test_side_channel_cut_mid_transfer(faults):
    """A pull's TCP connection cut half-way through its first run: the load fails at once
    (no timeout), vLLM answers the failure (policy ``fail``: 500, or an error event as a
    stream's first event), the proxy re-prefills and retries on the other decode before
    anything reached the client: the request succeeds. One cut per request, counted once by
    decode and once by the proxy."""
    fleet = faults
    items = [body(i, 500, stream=i == 1, max_tokens=24, n_prompt=300) for i in range(2)]
    want = expected(fleet, items)
    for b, e in zip(items, want):
        failures = pulls(fleet, "vllm:kvdisagg_pull_failures_total")
        errors = proxy_metric(fleet, "instance_errors_total", side="decode")
        fleet.arm.touch()
        assert send(fleet, b) == ("ok", e)
        assert not fleet.arm.exists(), "no pull was cut"
        wait_until("decode counted the failed pull",
                   lambda f=failures: pulls(fleet, "vllm:kvdisagg_pull_failures_total") > f, 10)
        assert pulls(fleet, "vllm:kvdisagg_pull_failures_total") == failures + 1
        assert proxy_metric(fleet, "instance_errors_total", side="decode") == errors + 1
    assert pulls(fleet, "vllm:kvdisagg_checksum_failures_total") == 0
    assert_nothing_leaks(fleet)


@pytest.mark.timeout(900)
def test_prefill_stalled_past_the_transfer_timeout(faults):
    """Prefill stopped (SIGSTOP) for twice decode's transfer timeout while it prefills a burst,
    then resumed. Its legs wait (a stopped instance is slow, not dead: ``timeouts.prefill_s``
    is far off); a pull from it fails after ``transfer_timeout_seconds`` and the proxy
    re-prefills (on the resumed prefill, or decode-only once probes find it unhealthy). Every
    request succeeds, token-identical, and the burst ends no later than an unfaulted one plus
    the stall, the transfer timeout and the probes' detection time."""
    fleet = faults
    # The unfaulted burst has prompts of the same lengths but others (prefill's prefix cache
    # would make the second burst's prefills instant).
    unfaulted = [body(i, 100, stream=i % 2 == 1, max_tokens=60) for i in range(8)]
    items = [body(i, 200, stream=i % 2 == 1, max_tokens=60) for i in range(8)]
    want_unfaulted, want = expected(fleet, unfaulted), expected(fleet, items)
    with ThreadPoolExecutor(len(items)) as pool:
        t0 = time.monotonic()
        all_right(start_burst(pool, fleet, unfaulted), want_unfaulted)
        baseline = time.monotonic() - t0
        recomputed = pulls(fleet, "vllm:kvdisagg_recomputed_prompts_total")
        decode_legs = proxy_metric(fleet, "instance_requests_total", side="decode")
        t0 = time.monotonic()
        futures = start_burst(pool, fleet, items)
        # Strike while prefill works for the burst, once it handed some of it to decode.
        wait_until("prefill legs in flight after a handoff",
                   lambda: legs_on(fleet, "prefill") >= 1 and proxy_metric(
                       fleet, "instance_requests_total", side="decode") > decode_legs, 60)
        fleet.prefill.pause()
        try:
            time.sleep(STALL_S)
        finally:
            fleet.prefill.resume()
        all_right(futures, want)
        elapsed = time.monotonic() - t0
    bound = baseline + STALL_S + TRANSFER_TIMEOUT_S + DETECT_S + 30  # 30: a 2-core host's jitter
    assert STALL_S <= elapsed <= bound, (elapsed, bound)
    assert pulls(fleet, "vllm:kvdisagg_recomputed_prompts_total") == recomputed
    assert_nothing_leaks(fleet)


@pytest.mark.timeout(1500)
def test_decode_killed_before_first_byte(faults):
    """Decode 0 stopped while the burst's decode legs reach it, then killed (SIGKILL) with X
    legs waiting for their first byte: each is retried once on decode 1
    (``instance_retries_total`` of decode 0 grows by exactly X; no migration) and every
    request succeeds token-identical, its KV pulled exactly once, by decode 1. A leg the proxy
    may have delivered (its connection closed after the request went out) is retried with a
    fresh handoff and its first expires on prefill a lease later; one that provably never
    reached decode 0 (a stale keep-alive connection, its resend refused) is retried with the
    same handoff. So prefill's expired handoffs grow by exactly the re-prefills."""
    fleet = faults
    d0 = fleet.decodes[0]
    items = [body(i, 300, stream=i % 2 == 1, max_tokens=40) for i in range(6)]
    want = expected(fleet, items)
    expired = metric(fleet.prefill.base_url, "vllm:kvdisagg_handoffs_expired_total")
    retries = proxy_metric(fleet, "instance_retries_total", side="decode", instance=d0.base_url)
    prefilled = proxy_metric(fleet, "instance_requests_total", side="prefill")
    migrations = proxy_metric(fleet, "migrations_total")
    d1_pulls = metric(fleet.decodes[1].base_url, "vllm:kvdisagg_pulls_total")
    d0.pause()
    with ThreadPoolExecutor(len(items)) as pool:
        futures = start_burst(pool, fleet, items)
        try:
            wait_until("every request prefilled, decode 0 holding legs",
                       lambda: proxy_metric(fleet, "instance_requests_total", side="prefill")
                       == prefilled + len(items) and legs_on(fleet, "prefill") == 0
                       and legs_on(fleet, "decode", d0) >= 1, 60)
            held = legs_on(fleet, "decode", d0)
        finally:
            d0.kill()
        all_right(futures, want)
    assert held >= 1
    assert proxy_metric(fleet, "instance_retries_total", side="decode",
                        instance=d0.base_url) == retries + held
    assert proxy_metric(fleet, "migrations_total") == migrations
    assert wait_metric_change(fleet.decodes[1].base_url, "vllm:kvdisagg_pulls_total",
                              d1_pulls) == d1_pulls + len(items)
    reprefills = (proxy_metric(fleet, "instance_requests_total", side="prefill")
                  - prefilled - len(items))
    assert 0 <= reprefills <= held
    d0.start()  # back while the leases run out
    offered, freed = wait_handoffs_freed(fleet.prefill.base_url, timeout_s=LEASE_S + 30)
    assert offered == freed
    if reprefills:
        assert wait_metric_change(fleet.prefill.base_url,
                                  "vllm:kvdisagg_handoffs_expired_total", expired) == (
            expired + reprefills)
    assert metric(fleet.prefill.base_url,
                  "vllm:kvdisagg_handoffs_expired_total") == expired + reprefills
    restart(fleet, d0)
    assert_nothing_leaks(fleet)


@pytest.mark.timeout(1500)
def test_decode_killed_mid_stream(faults):
    """Decode 1 killed (SIGKILL) while X legs run on it: streams mid-way and non-streamed
    requests mid-generation (their KV pulled, no byte sent yet). Each stream is migrated to
    decode 0 with the tokens delivered so far (``migrations_total{outcome="ok"}``); each
    non-streamed request is retried on decode 0 with a fresh handoff (the one decode 1 pulled
    is gone; ``instance_retries_total`` of decode 1): migrations plus retries are exactly X, no
    other migration outcome. Every request completes token- and text-identical to the plain
    answer (a stream with no gap and no duplicate; a break inside a character changes no
    text). Decode 1 had pulled all it held: no handoff expires."""
    fleet = faults
    restart(fleet, fleet.decodes[0])
    d1 = fleet.decodes[1]
    # Long answers to short prompts: every request is still running when the last is
    # prefilled.
    items = [body(i, 700, stream=i % 4 != 3, max_tokens=1000, n_prompt=200) for i in range(8)]
    want = expected(fleet, items, text=True)
    expired = metric(fleet.prefill.base_url, "vllm:kvdisagg_handoffs_expired_total")
    ok = proxy_metric(fleet, "migrations_total", outcome="ok")
    other = proxy_metric(fleet, "migrations_total") - ok
    retries = proxy_metric(fleet, "instance_retries_total", side="decode", instance=d1.base_url)
    with ThreadPoolExecutor(len(items)) as pool:
        futures = start_burst(pool, fleet, items, text=True)
        wait_until("every request past prefill, decode 1 generating",
                   lambda: legs_on(fleet, "prefill") == 0
                   and legs_on(fleet, "decode") == len(items)
                   and legs_on(fleet, "decode", d1) >= 1, 120)
        time.sleep(1.0)  # tokens flowing on every stream
        held = legs_on(fleet, "decode", d1)
        assert not any(f.done() for f in futures), "a request ended before the kill"
        d1.kill()
        all_right(futures, want)
    migrated = proxy_metric(fleet, "migrations_total", outcome="ok") - ok
    retried = proxy_metric(fleet, "instance_retries_total", side="decode",
                           instance=d1.base_url) - retries
    assert held >= 1 and migrated + retried == held, (held, migrated, retried)
    assert proxy_metric(fleet, "migrations_total") - ok - migrated == other
    assert_nothing_leaks(fleet)
    assert metric(fleet.prefill.base_url, "vllm:kvdisagg_handoffs_expired_total") == expired


@pytest.mark.timeout(1500)
def test_prefill_killed_holding_handoffs(faults):
    """Prefill killed (SIGKILL) holding X handoffs: the decode they went to was stopped while
    prefill offered them, and resumed after the kill. Each pull is refused at once (no
    timeout), fails its request (policy ``fail``), and the proxy re-prefills: no prefill is
    left, so it serves the request decode-only. Every request succeeds token-identical; decode
    counted exactly X failed pulls and recomputed nothing silently (its
    ``recomputed_prompts_total`` is unchanged: the fallback sends no handoff)."""
    fleet = faults
    live = [d for d in fleet.decodes if d.proc is not None]
    assert live, "no decode left"
    items = [body(i, 900, stream=i % 2 == 1, max_tokens=30) for i in range(4)]
    want = expected(fleet, items)
    failures = pulls(fleet, "vllm:kvdisagg_pull_failures_total")
    recomputed = pulls(fleet, "vllm:kvdisagg_recomputed_prompts_total")
    errors = proxy_metric(fleet, "instance_errors_total", side="decode")
    for d in live:
        d.pause()
    with ThreadPoolExecutor(len(items)) as pool:
        futures = start_burst(pool, fleet, items)
        try:
            wait_until("prefill holding every request's handoff",
                       lambda: legs_on(fleet, "prefill") == 0
                       and legs_on(fleet, "decode") == len(items), 60)
            fleet.prefill.kill()
        finally:
            for d in live:
                d.resume()
        all_right(futures, want)
    assert pulls(fleet, "vllm:kvdisagg_pull_failures_total") == failures + len(items)
    assert pulls(fleet, "vllm:kvdisagg_recomputed_prompts_total") == recomputed
    assert proxy_metric(fleet, "instance_errors_total", side="decode") == errors + len(items)
    assert_nothing_leaks(fleet, prefill=False)
