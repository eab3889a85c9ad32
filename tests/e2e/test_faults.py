"""Faults under load on real vLLM: each request ends with the right tokens or a clear error
within the configured bounds, and the fleet serves the next request.

A burst of streamed and non-streamed requests runs through the proxy while one fault strikes:
prefill stalled (SIGSTOP) past decode's transfer timeout, then resumed; decode killed mid-stream,
then restarted on its port. (A prefill killed mid-load: tests/e2e/test_proxy_fleet.py; a side
channel dropped or a peer stalled mid-pull, transport by transport:
tests/unit/test_transport_conformance.py.)
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvdisagg.local.fleet import Fleet

from .conftest import LOG_DIR, completion_tokens, metric, post, prompt_ids, wait_handoffs_freed

pytestmark = pytest.mark.e2e

LEASE_S = 4.0
TRANSFER_TIMEOUT_S = 5.0
CLIENT_TIMEOUT_S = 300.0
BURST = 12


@pytest.fixture(scope="module")
def fleet(model):
    fleet = Fleet(model, LOG_DIR / "faults", prefill_extra={"lease_seconds": LEASE_S},
                  decode_extra={"transfer_timeout_seconds": TRANSFER_TIMEOUT_S})
    with fleet:
        yield fleet


def bodies(seed: int, n: int = BURST, max_tokens: int = 150) -> list[dict[str, Any]]:
    return [{"model": "tiny", "prompt": prompt_ids(100 + 150 * (i % 6), seed=seed + i),
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
             "return_token_ids": True, "stream": i % 2 == 1} for i in range(n)]


def send(base_url: str, body: dict[str, Any]) -> tuple[str, Any]:
    """("ok", token ids) or ("error", message): a clear error, never a hang or a silent cut."""
    return completion_tokens(base_url, body, CLIENT_TIMEOUT_S)


def expected_tokens(fleet, items: list[dict[str, Any]]) -> list[list[int]]:
    out = []
    for body in items:
        status, reply = post(fleet.prefill.base_url + "/v1/completions",
                             {**body, "stream": False}, timeout=CLIENT_TIMEOUT_S)
        assert status == 200, reply
        out.append(reply["choices"][0]["token_ids"])
    return out


def under_fault(fleet, items, fault, *, once_decoding: bool = False) -> list[tuple[str, Any]]:
    """Run the burst, strike ``fault`` once the first requests are in flight (after a second),
    or ``once_decoding``: once decode has pulled the KV of one of them (it then streams for
    seconds: the bodies ask for long answers)."""
    pulls = metric(fleet.decode.base_url, "vllm:kvdisagg_pulls_total")
    with ThreadPoolExecutor(len(items)) as pool:
        futures = [pool.submit(send, fleet.proxy_url, b) for b in items]
        time.sleep(1.0)
        deadline = time.monotonic() + 120  # a bound on a broken fleet, not on the burst
        while (once_decoding and time.monotonic() < deadline
               and metric(fleet.decode.base_url, "vllm:kvdisagg_pulls_total") <= pulls):
            time.sleep(0.05)
        fault()
        return [f.result() for f in futures]


def assert_right_or_clear(results, expected) -> int:
    wrong = [(i, r) for i, (r, e) in enumerate(zip(results, expected))
             if not (r == ("ok", e) or (r[0] == "error" and r[1]))]
    assert not wrong, f"neither the right tokens nor a clear error: {wrong[:3]}"
    return sum(r[0] == "ok" for r in results)


def assert_serves_next(fleet, seed: int) -> None:
    items = bodies(seed, 4)
    expected = expected_tokens(fleet, items)
    assert [send(fleet.proxy_url, b) for b in items] == [("ok", e) for e in expected]


@pytest.mark.timeout(900)
def test_prefill_stalled_past_the_transfer_timeout(fleet):
    items = bodies(100)
    expected = expected_tokens(fleet, items)

    def stall() -> None:
        fleet.prefill.pause()
        threading.Timer(2 * TRANSFER_TIMEOUT_S, fleet.prefill.resume).start()

    start = time.monotonic()
    results = under_fault(fleet, items, stall)
    assert time.monotonic() - start < CLIENT_TIMEOUT_S
    assert_right_or_clear(results, expected)
    assert_serves_next(fleet, 200)
    offered, freed = wait_handoffs_freed(fleet.prefill.base_url)
    assert offered == freed


@pytest.mark.timeout(900)
def test_decode_killed_mid_stream_then_restarted(fleet):
    items = bodies(300, max_tokens=1000)  # streams that are still running when decode dies
    expected = expected_tokens(fleet, items)
    expired = metric(fleet.prefill.base_url, "vllm:kvdisagg_handoffs_expired_total")
    results = under_fault(fleet, items, fleet.decode.kill, once_decoding=True)
    assert_right_or_clear(results, expected)
    assert any(r[0] == "error" for r in results), "the kill struck no request"
    fleet.decode.start()
    fleet.decode.wait_ready(600)
    fleet.wait_proxy_ready(120)
    assert_serves_next(fleet, 400)
    # What the dead decode held was freed by lease expiry (nobody renews it any more).
    offered, freed = wait_handoffs_freed(fleet.prefill.base_url, timeout_s=LEASE_S + 30)
    assert offered == freed
    assert metric(fleet.prefill.base_url, "vllm:kvdisagg_handoffs_expired_total") >= expired
