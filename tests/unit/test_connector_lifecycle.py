"""DisaggConnector's scheduler side driven by vLLM's real v1 Scheduler (issue 9, part 5).

No processes and no KV bytes: the worker side is emulated by the connector output each step
reports (see vllm_harness.py). The tests assert on state: request status, the blocks in use, the
SendSpecs/LoadSpecs the connector puts in each step's metadata, the kv_transfer_params the client
gets, and that nothing is left behind (blocks, scheduler queues, the connector's per-request
containers).
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

import msgspec  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvdisagg.connector.metadata import WorkerHandshake  # noqa: E402
from kvdisagg.protocol import RemotePrefill  # noqa: E402
from tests.unit.vllm_harness import (HANDSHAKE_PORT, KV_LAYOUT, SAMPLED_TOKEN_ID,  # noqa: E402
                                     TRANSPORT, EmulatedWorkers, SchedulerHarness,
                                     remote_prefill_params)

REMOTE_DECODE = {"do_remote_decode": True}


@pytest.fixture
def make():
    """make(kv_role, **SchedulerHarness kwargs): harnesses closed at teardown."""
    made: list[SchedulerHarness] = []

    def factory(kv_role: str, **kw) -> SchedulerHarness:
        made.append(SchedulerHarness(kv_role, **kw))
        return made[-1]

    yield factory
    for h in made:
        h.close()


# ---- prefill (kv_producer) -------------------------------------------------------------------


@pytest.mark.parametrize("block_size,prompt", [(16, 40), (16, 48), (128, 300)])
@pytest.mark.parametrize("stop", ["length", "eos"])
def test_prefill_holds_blocks_until_finished_sending(make, block_size, prompt, stop):
    h = make("kv_producer", block_size=block_size,
             extra_config={"lease_seconds": 12.0, "side_channel_host": "10.1.2.3"})
    req = h.add_request(prompt, kv_transfer_params=dict(REMOTE_DECODE),
                        max_tokens=1 if stop == "length" else 5)
    rid = req.request_id

    s = h.step(eos={rid} if stop == "eos" else ())
    assert s.scheduled == {rid: prompt}
    (new,) = s.sched_out.scheduled_new_reqs
    used = list(new.block_ids[0])
    assert len(used) == h.blocks_for(prompt)
    assert req.status == (RequestStatus.FINISHED_LENGTH_CAPPED if stop == "length"
                          else RequestStatus.FINISHED_STOPPED)
    # Finished, but its blocks are the handoff's now: held, not freed.
    assert rid in h.scheduler.requests
    assert h.block_ids(rid) == used and h.used_blocks() == len(used)
    assert s.meta.sends == []  # request_finished ran after this step's metadata was built

    out = s.output(rid)
    assert out.finish_reason == (FinishReason.LENGTH if stop == "length" else FinishReason.STOP)
    p = out.kv_transfer_params
    assert p is not None
    assert p["do_remote_prefill"] is True and p["do_remote_decode"] is False
    assert p["remote_block_ids"] == used
    assert p["remote_request_id"] == rid
    assert p["remote_engine_id"] == h.engine_id
    assert p["remote_num_tokens"] == prompt
    assert (p["remote_host"], p["remote_port"], p["tp_size"]) == ("10.1.2.3", HANDSHAKE_PORT, 1)
    extras = p["kvdisagg"]
    assert extras["ports"] == [HANDSHAKE_PORT]
    assert (extras["kv_layout"], extras["transport"]) == (KV_LAYOUT, TRANSPORT)
    assert extras["token"]
    msgspec.convert(p, RemotePrefill)  # what decode parses

    s = h.step()
    (send,) = s.meta.sends
    assert send.req_id == rid
    assert list(send.block_ids) == used
    assert send.token == extras["token"]
    assert send.lease_s == 12.0
    assert not getattr(send, "stage_from", ())

    # Decode has not pulled yet: nothing more to offer, the blocks stay held, vLLM keeps stepping.
    h.run(3)
    assert len(h.sends(rid)) == 1
    assert rid in h.scheduler.requests and h.used_blocks() == len(used)
    assert h.scheduler.has_finished_requests()

    h.step(finished_sending={rid})
    assert rid not in h.scheduler.requests
    h.assert_no_leak()


@pytest.mark.parametrize("when", ["queued", "mid-prefill"])
def test_prefill_abort_before_finishing_holds_nothing(make, when):
    h = make("kv_producer", max_num_batched_tokens=32)
    req = h.add_request(100, kv_transfer_params=dict(REMOTE_DECODE))
    rid = req.request_id
    if when == "mid-prefill":
        s = h.step()
        assert s.scheduled == {rid: 32} and req.status == RequestStatus.RUNNING
        assert h.used_blocks() == 2

    assert [r.request_id for r in h.abort(rid)] == [rid]
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert rid not in h.scheduler.requests
    assert h.used_blocks() == 0
    h.run(2)
    assert h.sends() == []
    assert all(o.kv_transfer_params is None for o in h.outputs(rid))
    h.assert_no_leak()


def test_prefill_abort_after_handoff_keeps_blocks_for_decode(make):
    """A client gone after prefill answered must not free the KV decode is about to pull."""
    h = make("kv_producer")
    req = h.add_request(40, kv_transfer_params=dict(REMOTE_DECODE))
    rid = req.request_id
    h.step()
    assert h.abort(rid) == []  # already finished: vLLM ignores it
    h.run(2)
    assert rid in h.scheduler.requests and h.used_blocks() == 3
    h.step(finished_sending={rid})
    h.assert_no_leak()


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": False}],
                         ids=["none", "empty", "no-handoff"])
def test_plain_request_untouched(make, role, params):
    h = make(role)
    req = h.add_request(40, kv_transfer_params=params, max_tokens=3)
    rid = req.request_id
    s = h.step()
    assert s.scheduled == {rid: 40}  # computed here, nothing claimed from elsewhere
    h.drain()
    assert h.sends() == [] and h.loads() == []
    assert [o.kv_transfer_params for o in h.outputs(rid)] == [None] * 3
    assert h.final_output(rid).finish_reason == FinishReason.LENGTH
    h.assert_no_leak()


def test_roles_ignore_the_other_sides_params(make):
    """A consumer never hands off; a producer never pulls."""
    d = make("kv_consumer")
    req = d.add_request(40, kv_transfer_params=dict(REMOTE_DECODE))
    d.drain()
    assert d.final_output(req.request_id).kv_transfer_params is None
    assert d.sends() == []
    d.assert_no_leak()

    p = make("kv_producer")
    req = p.add_request(40, kv_transfer_params=remote_prefill_params(p, 40))
    s = p.step()
    assert s.scheduled == {req.request_id: 40}
    p.drain()
    assert p.loads() == []
    p.assert_no_leak()


# ---- decode (kv_consumer) --------------------------------------------------------------------


@pytest.mark.parametrize("block_size,prompt", [(16, 40), (16, 48), (128, 300)])
def test_decode_loads_once_then_computes_one_token(make, block_size, prompt):
    h = make("kv_consumer", block_size=block_size)
    params = remote_prefill_params(h, prompt, token="secret")
    req = h.add_request(prompt, kv_transfer_params=params, max_tokens=3)
    rid = req.request_id

    s = h.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s.scheduled == {}
    local = h.block_ids(rid)
    assert len(local) == h.blocks_for(prompt) == h.used_blocks()
    (load,) = s.meta.loads
    assert load.req_id == rid and load.error == "" and not load.release_only
    assert list(load.local_block_ids) == local
    assert list(load.remote_block_ids) == params["remote_block_ids"]
    assert load.first_block == 0
    assert load.handoff_id == params["remote_request_id"] and load.token == "secret"
    assert (load.host, load.ports) == (params["remote_host"], tuple(params["kvdisagg"]["ports"]))
    assert (load.transport, load.kv_layout) == (TRANSPORT, KV_LAYOUT)

    for s in h.run(3):  # the pull is in flight
        assert s.scheduled == {} and s.meta.loads == []
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    s = h.step(finished_recving={rid})
    assert s.scheduled == {}
    s = h.step()  # promoted: vLLM recomputes only the last prompt token, to sample
    assert s.scheduled == {rid: 1}
    (new,) = s.sched_out.scheduled_new_reqs
    assert new.num_computed_tokens == prompt - 1
    assert list(new.block_ids[0]) == local
    assert s.output(rid).new_token_ids == [SAMPLED_TOKEN_ID]

    h.drain()
    assert len(h.loads(rid)) == 1
    final = h.final_output(rid)
    assert final.finish_reason == FinishReason.LENGTH and final.kv_transfer_params is None
    assert sum(len(o.new_token_ids) for o in h.outputs(rid)) == 3
    h.assert_no_leak()


def test_decode_local_prefix_hit_pulls_only_the_tail(make):
    h = make("kv_consumer")
    shared = list(range(3, 35))  # two full blocks
    warm = h.add_request(48, prompt=shared + [400] * 16)
    h.drain()
    assert warm.is_finished()

    params = remote_prefill_params(h, 48, block_ids=[100, 101, 102])
    req = h.add_request(48, prompt=shared + [401] * 16, kv_transfer_params=params)
    s = h.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = s.meta.loads
    blocks = h.block_ids(req.request_id)
    assert len(blocks) == 3
    assert list(load.local_block_ids) == blocks[2:]  # the two shared blocks hit locally
    assert list(load.remote_block_ids) == [102]
    assert load.first_block == 2

    h.step(finished_recving={req.request_id})
    s = h.step()
    assert s.scheduled == {req.request_id: 1}
    h.drain()
    h.assert_no_leak()


def test_decode_failed_load_fail_policy_ends_with_error(make):
    h = make("kv_consumer", kv_load_failure_policy="fail")
    req = h.add_request(40, kv_transfer_params=remote_prefill_params(h, 40))
    rid = req.request_id
    h.step()
    assert h.used_blocks() == 3

    s = h.step(failed_recving={rid})
    assert req.status == RequestStatus.FINISHED_ERROR
    assert s.output(rid).finish_reason == FinishReason.ERROR
    assert rid not in h.scheduler.requests
    h.assert_no_leak()
    h.run(2)
    assert len(h.loads(rid)) == 1


def test_decode_failed_load_recompute_policy_recomputes_without_pulling_again(make):
    h = make("kv_consumer", kv_load_failure_policy="recompute")
    req = h.add_request(40, kv_transfer_params=remote_prefill_params(h, 40), max_tokens=2)
    rid = req.request_id
    h.step()
    h.step(failed_recving={rid})
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # promoted at the next schedule

    s = h.step()
    assert s.scheduled == {rid: 40}  # the whole prompt, locally
    (new,) = s.sched_out.scheduled_new_reqs
    assert new.num_computed_tokens == 0
    assert req.status == RequestStatus.RUNNING

    h.drain()
    assert len(h.loads(rid)) == 1
    assert h.final_output(rid).finish_reason == FinishReason.LENGTH
    h.assert_no_leak()


@pytest.mark.parametrize("report", ["done", "failed"])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_decode_abort_while_waiting_keeps_blocks_until_reported(make, report, policy):
    h = make("kv_consumer", kv_load_failure_policy=policy)
    req = h.add_request(40, kv_transfer_params=remote_prefill_params(h, 40))
    rid = req.request_id
    h.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    assert [r.request_id for r in h.abort(rid)] == [rid]
    assert req.status == RequestStatus.FINISHED_ABORTED
    # The worker may still be writing into them: vLLM keeps them until the load is reported.
    assert rid in h.scheduler.requests and h.used_blocks() == 3
    for s in h.run(3):
        assert s.meta.loads == [] and s.scheduled == {}
    assert h.used_blocks() == 3

    h.step(**{"finished_recving" if report == "done" else "failed_recving": {rid}})
    assert rid not in h.scheduler.requests
    assert len(h.loads(rid)) == 1
    h.assert_no_leak()


def test_decode_abort_before_admission_plans_nothing(make):
    h = make("kv_consumer")
    req = h.add_request(40, kv_transfer_params=remote_prefill_params(h, 40))
    h.abort(req.request_id)
    h.assert_no_leak()
    h.run(2)
    assert h.loads() == []


@pytest.mark.parametrize("how", ["reset_prefix_cache", "out_of_blocks"])
def test_decode_preempted_after_load_does_not_pull_again(make, how):
    if how == "reset_prefix_cache":
        h = make("kv_consumer")
        a = h.add_request(40, kv_transfer_params=remote_prefill_params(h, 40), max_tokens=4)
        h.step()
        h.step(finished_recving={a.request_id})
        s = h.step()
        assert s.scheduled == {a.request_id: 1} and a.status == RequestStatus.RUNNING
        # Preempts every running request and drops the prefix cache: recompute from scratch.
        assert h.scheduler.reset_prefix_cache(reset_running_requests=True)
        assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
        s = h.step()
        assert s.scheduled == {a.request_id: 41}  # prompt + the token sampled so far
    else:
        # 7 usable blocks: b (3 blocks) runs, a (4) is loaded and then needs a 5th: vLLM
        # preempts the last admitted request, a itself. Without prefix caching, a's re-admission
        # asks the connector again with nothing computed.
        h = make("kv_consumer", num_blocks=8, enable_prefix_caching=False)
        b = h.add_request(40, max_tokens=20)
        h.step()
        a = h.add_request(64, kv_transfer_params=remote_prefill_params(h, 64), max_tokens=4)
        h.step()
        assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS and h.used_blocks() == 7
        h.step(finished_recving={a.request_id})
        h.run_until(lambda s: a.status == RequestStatus.PREEMPTED, max_steps=5)
        assert a.num_computed_tokens == 0 and not b.is_finished()
    h.drain()
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(h.loads(a.request_id)) == 1
    h.assert_no_leak()


def test_decode_admission_deferred_for_blocks_plans_one_load(make):
    """get_num_new_matched_tokens runs on every try; only the admitted try plans a load."""
    h = make("kv_consumer", num_blocks=8)  # 7 usable
    big = h.add_request(80, max_tokens=2)  # 5 blocks
    a = h.add_request(40, kv_transfer_params=remote_prefill_params(h, 40))  # needs 3
    s = h.step()
    assert s.scheduled == {big.request_id: 80}
    assert a.status == RequestStatus.WAITING and s.meta.loads == []
    s = h.step()  # big finishes in this step's output: a still does not fit
    assert big.is_finished() and a.status == RequestStatus.WAITING and s.meta.loads == []
    s = h.step()
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = s.meta.loads
    assert list(load.local_block_ids) == h.block_ids(a.request_id) and not load.error
    h.step(finished_recving={a.request_id})
    h.drain()
    assert len(h.loads(a.request_id)) == 1
    h.assert_no_leak()


def test_decode_prompt_logprobs_releases_the_handoff_and_computes_locally(make):
    """vLLM forbids reading cached KV for prompt logprobs: no load, but prefill is released."""
    h = make("kv_consumer")
    params = remote_prefill_params(h, 40)
    req = h.add_request(40, kv_transfer_params=params, prompt_logprobs=1)
    s = h.step()
    assert s.scheduled == {req.request_id: 40}
    (load,) = s.meta.loads
    assert load.release_only and not load.error and load.local_block_ids == ()
    assert load.handoff_id == params["remote_request_id"]
    h.drain()
    h.assert_no_leak()


def _forge(params: dict, case: str) -> dict:
    p = dict(params, kvdisagg=dict(params["kvdisagg"]))
    match case:
        case "missing-block-ids":
            del p["remote_block_ids"]
        case "missing-extras":
            del p["kvdisagg"]
        case "missing-token":
            del p["kvdisagg"]["token"]
        case "block-ids-not-a-list":
            p["remote_block_ids"] = "100,101,102"
        case "negative-block-id":
            p["remote_block_ids"] = [-1, 101, 102]
        case "port-out-of-range":
            p["remote_port"] = 70000
        case "ports-not-a-list":
            p["kvdisagg"]["ports"] = "47000"
        case "token-not-a-string":
            p["kvdisagg"]["token"] = 12345
        case "flag-not-a-bool":
            p["do_remote_prefill"] = "yes"
        case "tp-mismatch":
            p["kvdisagg"]["ports"] = [p["remote_port"], p["remote_port"] + 1]
            p["tp_size"] = 2
        case "too-few-blocks":
            p["remote_block_ids"] = [100]
        case _:
            raise AssertionError(case)
    return p


FORGED = ["missing-block-ids", "missing-extras", "missing-token", "block-ids-not-a-list",
          "negative-block-id", "port-out-of-range", "ports-not-a-list", "token-not-a-string",
          "flag-not-a-bool", "tp-mismatch", "too-few-blocks"]


@pytest.mark.parametrize("case", FORGED)
def test_decode_forged_params_give_a_load_error(make, case):
    h = make("kv_consumer")
    req = h.add_request(40, kv_transfer_params=_forge(remote_prefill_params(h, 40), case))
    rid = req.request_id
    s = h.step()
    (load,) = s.meta.loads
    assert load.req_id == rid and load.error
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s = h.step(failed_recving={rid})  # the worker fails an errored load at once
    assert req.status == RequestStatus.FINISHED_ERROR
    assert s.output(rid).finish_reason == FinishReason.ERROR
    h.assert_no_leak()


