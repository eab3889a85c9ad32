"""Graceful retirement, scheduler side (connector/retire.py): on SIGTERM a prefill keeps its engine
stepping while it holds staged handoffs, until every worker freed them or the hold bound passed,
and exports vllm:kvdisagg_retiring; driven by vLLM's real Scheduler (vllm_harness.py)."""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("vllm")

from kvdisagg.connector.metadata import DisaggWorkerMeta, WorkerHandshake
from kvdisagg.connector.retire import Retirement
from kvdisagg.connector.stats import DisaggStats
from tests.support.vllm_harness import (
    HANDSHAKE_PORT,
    KV_LAYOUT,
    TRANSPORT,
    SchedulerHarness,
    cleanup_model_dir,
)

REMOTE_DECODE = {"do_remote_decode": True}


@pytest.fixture(scope="module", autouse=True)
def _model_dir_removed():
    yield
    cleanup_model_dir()


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def staged_prefill(clock: Clock) -> SchedulerHarness:
    """A prefill with an 8-block staging arena (two handoffs), on a fake clock."""
    h = SchedulerHarness("kv_producer", num_blocks=64, handshake=False)
    h.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): WorkerHandshake(
        port=HANDSHAKE_PORT, kv_layout=KV_LAYOUT, transport=TRANSPORT, num_blocks=64,
        stage_blocks=8)})
    h.side.retirement = Retirement(h.side.retirement.hold_s, 0, clock=clock)
    return h


def handoff(h: SchedulerHarness) -> str:
    req = h.add_request(40, kv_transfer_params=dict(REMOTE_DECODE))
    h.step()  # prefilled, finished, staged: vLLM freed its paged blocks
    h.step()  # the SendSpec went to the workers
    assert req.is_finished() and req.request_id not in h.scheduler.requests
    return req.request_id


def test_retiring_prefill_steps_until_its_staged_handoffs_are_freed():
    clock = Clock()
    h = staged_prefill(clock)
    try:
        assert h.side.retirement.hold_s == 30.0 + 30.0  # lease + transfer timeout (defaults)
        a = handoff(h)
        assert not h.scheduler.has_requests()  # not retiring: an idle engine, handoff held
        assert h.side.take_stats() is None or "retiring" not in h.side.take_stats().data

        h.side.retirement.begin()
        assert h.scheduler.has_requests()  # vLLM's drain keeps stepping for it
        stats = h.side.take_stats()
        assert isinstance(stats, DisaggStats) and stats.data["retiring"] == 1
        h.run(3)
        assert h.scheduler.has_requests()
        # A handoff offered while retiring (a prompt admitted before the signal) is held too.
        b = handoff(h)
        h.step(worker_meta=DisaggWorkerMeta(released={a: h.side.tp_size}))
        assert h.scheduler.has_requests()
        h.step(worker_meta=DisaggWorkerMeta(released={b: h.side.tp_size}))
        assert not h.scheduler.has_requests()  # everything pulled or expired: the engine exits
        assert h.side.retirement.retiring
        h.assert_no_leak()
    finally:
        h.close()


def test_retirement_gives_up_at_the_hold_bound_after_the_last_offer():
    clock = Clock()
    h = staged_prefill(clock)
    try:
        handoff(h)
        h.side.retirement.begin()
        clock.t += 50
        handoff(h)  # offered 50 s into retirement: its own bound runs from now
        clock.t += 59
        assert h.scheduler.has_requests()
        clock.t += 2  # 61 s after the last offer, nothing freed: a decode kept renewing
        assert not h.scheduler.has_requests()
        assert h.side.retirement.gave_up
        clock.t -= 30  # (a clock is not needed to stay past the bound)
        assert not h.scheduler.has_requests()  # for good: the engine exits
    finally:
        h.close()


def test_retirement_without_staged_handoffs_holds_nothing():
    r = Retirement(10.0, 0, clock=Clock())
    assert not r.holds(3)  # not retiring
    r.begin()
    assert not r.holds(0)


def test_arm_chains_in_front_of_the_engines_sigterm_handler():
    seen: list[int] = []
    prev = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        r = Retirement(10.0, 30)
        assert r.arm()
        os.kill(os.getpid(), signal.SIGTERM)
        assert r.retiring and seen == [signal.SIGTERM]  # vLLM's handler still runs
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert not Retirement(10.0, 30).arm()  # no Python handler: nothing to chain
    finally:
        signal.signal(signal.SIGTERM, prev)


def test_retiring_gauge_aggregates_as_a_maximum():
    a, b = DisaggStats(), DisaggStats()
    assert a.is_empty()
    b.add(retiring=1)
    assert not b.is_empty()
    a.aggregate(b)
    assert a.data["retiring"] == 1 and a.reduce()["retiring"] == 1
    a.aggregate(b)
    assert a.data["retiring"] == 1
