"""kvdisagg.slo_scheduler.SloScheduler driven as vLLM drives it: vLLM's real Scheduler machinery
with DisaggConnector, through tests/support/vllm_harness.py (the harness builds ``Scheduler``;
here it builds the class ``--scheduler-cls kvdisagg.slo_scheduler.SloScheduler`` resolves to).
No processes, no model: the workers are emulated by the harness. Settings come through
$KVDISAGG_SCHEDULER (the connector refuses keys it does not know in kv_connector_extra_config)."""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import pytest

pytest.importorskip("vllm")

from vllm.config import SchedulerConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvdisagg.errors import ConfigError
from kvdisagg.slo_scheduler import (
    ENV_VAR,
    SLO_PARAMS_KEY,
    AsyncSloScheduler,
    SchedulerSettings,
    SloScheduler,
    SloStats,
    load_settings,
)
from tests.support import vllm_harness
from tests.support.vllm_harness import SchedulerHarness, Step, cleanup_model_dir

SCHEDULER_CLS = "kvdisagg.slo_scheduler.SloScheduler"
REMOTE_DECODE = {"do_remote_decode": True}
NOW = 1_000_000.0  # the scheduler's clock in these tests (wall-clock seconds)


@pytest.fixture(scope="module", autouse=True)
def _model_dir_removed():
    yield
    cleanup_model_dir()


def resolved_cls() -> type:
    """What vLLM's EngineCore instantiates for
    ``--scheduler-cls kvdisagg.slo_scheduler.SloScheduler``."""
    return SchedulerConfig.default_factory(scheduler_cls=SCHEDULER_CLS).get_scheduler_cls()


@pytest.fixture
def make(monkeypatch):
    """make(settings, kv_role="kv_producer", stock=False, **SchedulerHarness kwargs): a harness
    whose scheduler is SloScheduler (vLLM's own if ``stock``), clock fixed at NOW. With
    ``async_scheduling=True``: AsyncSloScheduler (vLLM's AsyncScheduler if ``stock``)."""
    made: list[SchedulerHarness] = []

    def factory(settings: dict[str, Any] | None = None, kv_role: str = "kv_producer", *,
                stock: bool = False, **kw: Any) -> SchedulerHarness:
        if settings is None:
            monkeypatch.delenv(ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(ENV_VAR, json.dumps(settings))
        cls = Scheduler if stock else resolved_cls()
        with mock.patch.object(vllm_harness, "Scheduler", cls):
            h = SchedulerHarness(kv_role, **kw)
        made.append(h)
        on_async = kw.get("async_scheduling", False)
        if stock:
            assert type(h.scheduler) is (AsyncScheduler if on_async else Scheduler)
        else:
            assert type(h.scheduler) is (AsyncSloScheduler if on_async else SloScheduler)
        if not stock:
            h.scheduler.clock = lambda: NOW
        return h

    yield factory
    for h in made:
        h.close()


def add(h: SchedulerHarness, num_tokens: int, *, age_s: float = 0.0, ttft_s: float | None = None,
        params: dict[str, Any] | None = None, **kw: Any):
    """Add a request that arrived ``age_s`` before NOW, with its own TTFT objective if given."""
    params = dict(params or {})
    if ttft_s is not None:
        params[SLO_PARAMS_KEY] = {"ttft_s": ttft_s}
    req = h.make_request(num_tokens, kv_transfer_params=params or None, **kw)
    req.arrival_time = NOW - age_s
    h.add(req)
    return req


def order(step: Step) -> list[tuple[str, int]]:
    """What a step scheduled, in vLLM's order: (request id, tokens)."""
    return list(step.sched_out.num_scheduled_tokens.items())


def stats(h: SchedulerHarness) -> SloStats:
    return h.scheduler.slo_stats()


# ---- selection and settings ------------------------------------------------------------------


def test_scheduler_cls_flag_selects_slo_scheduler():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--scheduler-cls", SCHEDULER_CLS])
    assert EngineArgs.from_cli_args(args).scheduler_cls == SCHEDULER_CLS
    assert resolved_cls() is SloScheduler
    assert issubclass(SloScheduler, Scheduler)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_slo_scheduler_runs_on_the_scheduler_that_async_scheduling_asks_for(make,
                                                                           async_scheduling):
    """The one class name, two bases: vLLM's AsyncScheduler when async scheduling is on (its
    GPU default), its Scheduler otherwise; the plugin's own behaviour on both."""
    h = make({"ttft_s": 10.0}, async_scheduling=async_scheduling)
    assert isinstance(h.scheduler, SloScheduler)
    assert isinstance(h.scheduler, AsyncScheduler) is async_scheduling
    assert type(SloScheduler.__new__(SloScheduler, vllm_config=h.vllm_config)) is \
        (AsyncSloScheduler if async_scheduling else SloScheduler)


def test_settings_come_from_extra_config_then_env_then_defaults():
    env = {ENV_VAR: json.dumps({"ttft_s": 3.0})}
    assert load_settings({"scheduler": {"ttft_s": 1.5}}, env).ttft_s == 1.5
    assert load_settings({"lease_seconds": 5}, env).ttft_s == 3.0
    assert load_settings(None, {}) == SchedulerSettings()


@pytest.mark.parametrize("raw,key", [
    ({"policy": "fast"}, "policy"),
    ({"ttft_s": 0}, "ttft_s"),
    ({"starvation_s": "long"}, "starvation_s"),
    ({"max_batched_tokens": 0}, "max_batched_tokens"),
    ({"held_kv_share": 1.5}, "held_kv_share"),
    ({"decode_per_seq_s": -0.1}, "decode_per_seq_s"),
    ({"ttft": 1.0}, "ttft"),
    ({"tpot_s": 0.01, "decode_base_s": 0.02}, "tpot_s"),
])
def test_bad_setting_is_a_config_error_naming_the_key(raw, key):
    with pytest.raises(ConfigError, match=rf"kv_connector_extra_config.*{key}"):
        load_settings({"scheduler": raw}, {})
    with pytest.raises(ConfigError, match=rf"\${ENV_VAR}.*{key}"):
        load_settings(None, {ENV_VAR: json.dumps(raw)})


def test_env_var_that_is_not_json_is_a_config_error():
    with pytest.raises(ConfigError, match=f"{ENV_VAR} is not JSON"):
        load_settings(None, {ENV_VAR: "ttft_s=1"})


def test_token_budget_above_vllms_is_refused_at_start(make):
    with pytest.raises(ConfigError, match=r"max_batched_tokens=1000 exceeds .*=512"):
        make({"max_batched_tokens": 1000}, max_num_batched_tokens=512)


# ---- 1. deadline-aware ordering --------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_earliest_deadline_first(make, async_scheduling):
    h = make({"ttft_s": 10.0, "held_kv_share": 1.0}, max_num_seqs=1,
             async_scheduling=async_scheduling)
    # STEP 1: the long-deadline request arrives (and is added) first.
    slow = add(h, 32, age_s=1.0, ttft_s=5.0)   # deadline NOW + 4
    fast = add(h, 32, age_s=0.5, ttft_s=0.5)   # deadline NOW
    plain = add(h, 32, age_s=0.2)              # default ttft_s: deadline NOW + 9.8
    # STEP 2: one request per step (max_num_seqs=1): earliest deadline first.
    s1, s2, s3 = h.run(3)
    assert [order(s) for s in (s1, s2, s3)] == [
        [(fast.request_id, 32)], [(slow.request_id, 32)], [(plain.request_id, 32)]]
    assert stats(h) == SloStats(deadline_misses=0, reordered=1, batch_cap_in_force=0,
                                backpressure_steps=0)
    h.drain()
    h.assert_no_leak()


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_counters_reach_prometheus_through_the_connectors_stats(make, kv_role, async_scheduling):
    """Each step's SchedulerStats carries the counters' increase; DisaggConnector's Prometheus
    metrics turn it into vllm:kvdisagg_sched_* counters (kv_consumer: how a colocated instance
    gets them, docs/scheduler.md)."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvdisagg.connector.connector import DisaggConnector

    h = make({"ttft_s": 10.0, "held_kv_share": 1.0}, kv_role, max_num_seqs=1,
             async_scheduling=async_scheduling)
    add(h, 32, age_s=1.0, ttft_s=5.0)
    add(h, 32, age_s=0.5, ttft_s=0.5)  # goes first: one reordering step
    steps = h.run(3)
    payloads = [s.stats.kv_connector_stats or {} for s in steps]
    assert sum(p.get("sched_reordered", 0) for p in payloads) == 1
    assert not any(p.get("sched_reordered") for p in payloads[1:])  # reported once

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = DisaggConnector.build_prom_metrics(h.vllm_config, types, ["engine"], {0: ["0"]})
    for p in payloads:
        prom.observe(p, 0)
    assert registry.get_sample_value("vllm:kvdisagg_sched_reordered_total", {"engine": "0"}) == 1
    h.drain()
    h.assert_no_leak()


def test_admission_after_the_deadline_counts_a_miss(make):
    h = make({"ttft_s": 1.0}, max_num_seqs=1)
    late = add(h, 16, age_s=3.0)  # deadline NOW - 2
    on_time = add(h, 16, age_s=0.1, ttft_s=60.0)
    h.drain()
    assert late.is_finished() and on_time.is_finished()
    assert stats(h).deadline_misses == 1
    h.assert_no_leak()


@pytest.mark.parametrize("starvation_s,first", [(10.0, "starved"), (20.0, "urgent")])
def test_starved_request_goes_first(make, starvation_s, first):
    h = make({"ttft_s": 1.0, "starvation_s": starvation_s}, max_num_seqs=1)
    reqs = {"urgent": add(h, 16, age_s=0.1, ttft_s=0.5),      # deadline NOW + 0.4
            "starved": add(h, 16, age_s=15.0, ttft_s=100.0)}  # deadline NOW + 85, waited 15 s
    s = h.step()
    assert order(s) == [(reqs[first].request_id, 16)]
    h.drain()
    h.assert_no_leak()


def test_remote_kv_loads_keep_their_queue(make):
    """Decode: a remote load sits in kv_holding_waiting, which is not reordered; a later request
    with an urgent deadline runs while the load is in flight, and the loaded one runs next."""
    h = make({"ttft_s": 10.0}, kv_role="kv_consumer", max_num_seqs=4)
    remote = h.make_request(32, kv_transfer_params=vllm_harness.remote_prefill_params(h, 32))
    remote.arrival_time = NOW - 0.1
    h.add(remote)
    # STEP 1: the load starts (WAITING_FOR_REMOTE_KVS, in kv_holding_waiting).
    s1 = h.step()
    assert order(s1) == [] and remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [ld.req_id for ld in s1.meta.loads] == [remote.request_id]
    # STEP 2: an urgent prompt runs; the workers report the load done.
    urgent = add(h, 16, age_s=0.0, ttft_s=0.1)
    assert order(h.step(finished_recving={remote.request_id})) == [(urgent.request_id, 16)]
    # STEP 3: the loaded request runs (vLLM recomputes its last prompt token).
    assert order(h.step()) == [(remote.request_id, 1)]
    assert remote.is_finished() and urgent.is_finished()
    assert stats(h).deadline_misses == 0
    h.assert_no_leak()


# ---- 2. token budget -------------------------------------------------------------------------


def test_token_budget_is_honoured(make):
    h = make({"max_batched_tokens": 100}, max_num_batched_tokens=512)
    for _ in range(4):
        add(h, 80, max_tokens=3)
    steps = h.drain()
    per_step = [sum(s.scheduled.values()) for s in steps]
    assert max(per_step) == 100  # used to the full, never past it (vLLM alone: 320)
    assert all(n <= 100 for n in per_step)
    h.assert_no_leak()


# ---- 3. backpressure on held KV --------------------------------------------------------------


def test_held_kv_above_share_blocks_new_prompts(make):
    # 64 blocks of 16 tokens; share 0.25: held KV above 16 blocks stops admission.
    h = make({"held_kv_share": 0.25}, num_blocks=64)
    # STEP 1: two handoffs of 10 blocks each finish; decode has not pulled them.
    a = add(h, 160, params=REMOTE_DECODE)
    b = add(h, 160, params=REMOTE_DECODE)
    h.step()
    assert a.is_finished() and b.is_finished()
    assert h.scheduler.held_kv_blocks() == 20 and h.scheduler.held_kv_share() > 0.25
    # STEP 2: a new prompt waits (no eviction, no failure); its blocks are not taken.
    new = add(h, 32)
    s2 = h.step()
    assert order(s2) == [] and new.status == RequestStatus.WAITING
    assert stats(h).backpressure_steps == 1
    # STEP 3: decode pulls a's KV (finished_sending), reported after this step's schedule().
    s3 = h.step(finished_sending={a.request_id})
    assert order(s3) == [] and stats(h).backpressure_steps == 2
    assert h.scheduler.held_kv_blocks() == 10  # 10/64 < 0.25
    # STEP 4: below the share again: the prompt is admitted.
    s4 = h.step()
    assert order(s4) == [(new.request_id, 32)]
    assert stats(h).backpressure_steps == 2
    h.step(finished_sending={b.request_id})
    h.drain()
    h.assert_no_leak()


def test_held_kv_below_share_lets_new_prompts_in(make):
    h = make({"held_kv_share": 0.5}, num_blocks=64)
    a = add(h, 160, params=REMOTE_DECODE)
    h.step()
    assert a.is_finished() and h.scheduler.held_kv_blocks() == 10
    new = add(h, 32)
    assert order(h.step()) == [(new.request_id, 32)]
    assert stats(h).backpressure_steps == 0
    h.step(finished_sending={a.request_id})
    h.drain()
    h.assert_no_leak()


# ---- 4. decode TPOT cap ----------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tpot_cap_bounds_the_batch_without_preempting(make, async_scheduling):
    # 0.02 + 0.01 * batch <= 0.05  ->  batch <= 3
    h = make({"tpot_s": 0.05, "decode_base_s": 0.02, "decode_per_seq_s": 0.01},
             max_num_seqs=16, num_blocks=128, async_scheduling=async_scheduling)
    reqs = [add(h, 20, max_tokens=6) for _ in range(7)]
    steps = h.drain()
    batch = [len(s.scheduled) for s in steps]
    assert max(batch) == 3 and all(n <= 3 for n in batch)  # vLLM alone: all 7 at once
    assert all(not s.sched_out.preempted_req_ids for s in steps)
    assert all(r.num_preemptions == 0 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
               for r in reqs)
    assert stats(h).batch_cap_in_force > 0
    h.assert_no_leak()


# ---- policy "stock" --------------------------------------------------------------------------


def workload(h: SchedulerHarness) -> list[list[tuple[str, int]]]:
    """The same requests at the same steps, some of them handoffs that decode pulls three
    steps after they finish; per step, what was scheduled, in order."""
    plan = {0: [(200, 9.0, 4, False), (64, 0.2, 2, True), (300, 5.0, 3, False)],
            2: [(48, 0.1, 5, False), (120, None, 1, True)],
            3: [(500, 0.3, 1, True), (16, 0.05, 8, False), (90, 2.0, 1, True)]}
    workers = vllm_harness.EmulatedWorkers(send_delay=3)
    seen = []
    for i in range(60):
        for k, (n, ttft, max_tokens, handoff) in enumerate(plan.get(i, [])):
            add(h, n, age_s=0.1 * k, ttft_s=ttft, max_tokens=max_tokens,
                params=REMOTE_DECODE if handoff else None)
        seen.append(order(h.step_with(workers)))
        if i > max(plan) and not h.scheduler.has_requests() and workers.idle():
            break
    h.assert_no_leak()
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stock_policy_schedules_exactly_like_vllm(make, async_scheduling):
    settings = {"policy": "stock", "max_batched_tokens": 64, "tpot_s": 0.05,
                "decode_base_s": 0.02, "decode_per_seq_s": 0.01, "held_kv_share": 0.01}
    kw = dict(max_num_seqs=4, max_num_batched_tokens=256, num_blocks=96,
              async_scheduling=async_scheduling, overlap=async_scheduling)
    vllm_run = workload(make(stock=True, **kw))
    stock_run = workload(make(settings, **kw))
    assert stock_run == vllm_run
    # The same settings under policy "slo" do change the schedule (the test can fail).
    slo_run = workload(make({**settings, "policy": "slo"}, **kw))
    assert slo_run != vllm_run


def test_connector_config_accepts_the_scheduler_key():
    """The plugin's settings ride in kv_connector_extra_config next to the connector's own."""
    from kvdisagg.connector.config import parse_config

    cfg = parse_config({"transport": "tcp", "scheduler": {"ttft_s": 1.0}})
    assert cfg.scheduler == {"ttft_s": 1.0}
