"""Fixtures of the connector's scheduler-side tests: vLLM's real Scheduler (and AsyncScheduler)
with DisaggConnector, through tests/support/vllm_harness.py. The harness (and vLLM) is imported
by the fixtures, not here, so a module that needs neither does not import them."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(scope="module", autouse=True)
def _model_dir_removed():
    """The harness's temporary model directory goes away with each module (if it made one)."""
    yield
    harness = sys.modules.get("tests.support.vllm_harness")
    if harness is not None:
        harness.cleanup_model_dir()


@pytest.fixture(params=[False, True], ids=["Scheduler", "AsyncScheduler"])
def make(request):
    """make(kv_role, **SchedulerHarness kwargs): harnesses closed at teardown, on vLLM's
    Scheduler and on its AsyncScheduler (async scheduling on)."""
    pytest.importorskip("vllm")
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from tests.support.vllm_harness import SchedulerHarness

    made: list[SchedulerHarness] = []

    def factory(kv_role: str, **kw) -> SchedulerHarness:
        made.append(SchedulerHarness(kv_role, async_scheduling=request.param, **kw))
        assert isinstance(made[-1].scheduler, AsyncScheduler) is request.param
        return made[-1]

    yield factory
    for h in made:
        h.close()
