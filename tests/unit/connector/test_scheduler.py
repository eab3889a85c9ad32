"""DisaggConnector's scheduler side driven by vLLM's real v1 Scheduler (issue 9, part 5), and by
its AsyncScheduler (vLLM's default on GPUs): every test runs under both.

No processes and no KV bytes: the worker side is emulated by the connector output each step
reports (see tests/support/vllm_harness.py). The tests assert on state: request status, the blocks
in use, the SendSpecs/LoadSpecs the connector puts in each step's metadata, the kv_transfer_params
the client gets, and that nothing is left behind (blocks, scheduler queues, the connector's
per-request containers). The fixtures are in conftest.py; decode's leases are test_leases.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

pytest.importorskip("vllm")

import msgspec
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from kvdisagg.connector.metadata import DisaggWorkerMeta, WorkerHandshake
from kvdisagg.connector.protocol.params import RemotePrefill
from kvdisagg.connector.protocol.versions import SPOKEN, Versions
from tests.support.vllm_harness import (
    HANDSHAKE_PORT,
    KV_LAYOUT,
    SAMPLED_TOKEN_ID,
    TRANSPORT,
    EmulatedWorkers,
    SchedulerHarness,
    closed_port,
    is_blocked_on_kv,
    remote_prefill_params,
)

REMOTE_DECODE = {"do_remote_decode": True}


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
        case "ports-for-another-shape":  # TP 2 x PP 1 is two ranks, not three
            p["kvdisagg"]["ports"] = [p["remote_port"]] * 3
            p["tp_size"] = 2
        case "tp-cannot-shard-the-heads":  # the model has 2 KV heads: TP 3 is no vLLM instance
            p["kvdisagg"]["ports"] = [p["remote_port"]] * 3
            p["tp_size"] = 3
        case "stages-past-the-layers":  # the model has 2 layers
            p["kvdisagg"]["ports"] = [p["remote_port"]] * 2
            p["kvdisagg"]["stages"] = [0, 5]
        case "stages-not-from-0":
            p["kvdisagg"]["stages"] = [1]
        case "too-few-blocks":
            p["remote_block_ids"] = [100]
        case _:
            raise AssertionError(case)
    return p


FORGED = ["missing-block-ids", "missing-extras", "missing-token", "block-ids-not-a-list",
          "negative-block-id", "port-out-of-range", "ports-not-a-list", "token-not-a-string",
          "flag-not-a-bool", "ports-for-another-shape", "tp-cannot-shard-the-heads",
          "stages-past-the-layers", "stages-not-from-0", "too-few-blocks"]
WHY = {"ports-for-another-shape": "3 side-channel ports for its 2 ranks",
       "tp-cannot-shard-the-heads": "prefill TP 3 cannot shard the model's 2 KV heads",
       "stages-past-the-layers": "not a split of the model's 2 layers",
       "stages-not-from-0": "not a split of the model's 2 layers"}


@pytest.mark.parametrize("case", FORGED)
def test_decode_forged_params_give_a_load_error(make, case):
    h = make("kv_consumer")
    req = h.add_request(40, kv_transfer_params=_forge(remote_prefill_params(h, 40), case))
    rid = req.request_id
    s = h.step()
    (load,) = s.meta.loads
    assert load.req_id == rid and load.error
    assert WHY.get(case, "") in load.error
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s = h.step(failed_recving={rid})  # the worker fails an errored load at once
    assert req.status == RequestStatus.FINISHED_ERROR
    assert s.output(rid).finish_reason == FinishReason.ERROR
    h.assert_no_leak()


@pytest.mark.parametrize("remote_tokens", [17, 32, 33])
def test_decode_claims_at_most_remote_num_tokens(make, remote_tokens):
    """A handoff shorter than decode's prompt (prefill computed another, shorter prompt): decode
    loads what prefill computed and computes the rest itself, never claims past it."""
    prompt = 40
    h = make("kv_consumer")
    params = remote_prefill_params(h, remote_tokens)
    assert params["remote_num_tokens"] == remote_tokens
    n_remote = h.blocks_for(remote_tokens)
    assert len(params["remote_block_ids"]) == n_remote

    req = h.add_request(prompt, kv_transfer_params=params, max_tokens=2)
    rid = req.request_id
    # The claim itself (side-effect free, asked before the first step): capped at
    # remote_num_tokens, less what is computed.
    assert h.side.get_num_new_matched_tokens(req, 0) == (remote_tokens, True)
    assert h.side.get_num_new_matched_tokens(req, 16) == (remote_tokens - 16, True)
    assert h.side.get_num_new_matched_tokens(req, 48) == (0, False)
    s = h.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and s.scheduled == {}
    assert req.num_computed_tokens == remote_tokens
    (load,) = s.meta.loads
    assert not load.error and not load.release_only and load.first_block == 0
    assert len(load.local_block_ids) == n_remote == h.used_blocks()
    assert list(load.local_block_ids) == h.block_ids(rid)
    assert list(load.remote_block_ids) == params["remote_block_ids"]

    h.step(finished_recving={rid})
    # Only a complete prompt gets its last token recomputed: here nothing is taken back.
    assert req.num_computed_tokens == remote_tokens
    s = h.step()
    assert s.scheduled == {rid: prompt - remote_tokens}  # the rest of the prompt, locally
    (new,) = s.sched_out.scheduled_new_reqs
    assert new.num_computed_tokens == remote_tokens
    assert list(new.block_ids[0][:n_remote]) == list(load.local_block_ids)
    assert len(new.block_ids[0]) == h.blocks_for(prompt)
    assert s.output(rid).new_token_ids == [SAMPLED_TOKEN_ID]

    h.drain()
    assert len(h.loads(rid)) == 1
    assert h.final_output(rid).finish_reason == FinishReason.LENGTH
    h.assert_no_leak()


def test_decode_keyed_load_names_the_tokens_prefill_stored(make):
    """A continuation after prefill's first token (proxy/handoff/first_token.py): decode's prompt is
    prefill's plus that token. A store transport's load is keyed by prefill's tokens (its
    last, partial chunk included), not decode's, whose last chunk prefill never stored."""
    h = make("kv_consumer", transport="lmcache", handshake_extra={"keyed_by_tokens": True},
             extra_config={"transport": "lmcache", "lmcache_url": "lm://127.0.0.1:1"})
    params = remote_prefill_params(h, 40)
    req = h.add_request(41, kv_transfer_params=params, max_tokens=2)
    assert h.side.get_num_new_matched_tokens(req, 0) == (40, True)
    s = h.step()
    (load,) = s.meta.loads
    assert not load.error and list(load.prompt_token_ids) == list(req.prompt_token_ids[:40])
    h.step(finished_recving={req.request_id})
    h.drain()
    assert h.final_output(req.request_id).finish_reason == FinishReason.LENGTH
    h.assert_no_leak()


@pytest.mark.parametrize("hit", [False, True], ids=["no-hit", "prefix-hit"])
def test_prefill_params_with_extra_blocks_align_by_position(make, hit):
    """Prefill computed prompt + outputs (47 + 2 = 49 tokens, 4 blocks): decode's 3 prompt
    blocks pair with prefill's blocks 0..2 by position, never with the trailing ones."""
    h = make("kv_consumer")
    shared = list(range(3, 35))  # two full blocks
    if hit:
        warm = h.add_request(48, prompt=shared + [450] * 16)
        h.drain()
        assert warm.is_finished()
    params = remote_prefill_params(h, 49, block_ids=[100, 101, 102, 103])
    req = h.add_request(47, prompt=shared + [401] * 15, kv_transfer_params=params)
    rid = req.request_id

    s = h.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    blocks = h.block_ids(rid)
    assert len(blocks) == 3
    hit_blocks = 2 if hit else 0
    (load,) = s.meta.loads
    assert not load.error and not load.release_only
    assert load.first_block == hit_blocks
    assert list(load.local_block_ids) == blocks[hit_blocks:]
    assert list(load.remote_block_ids) == [100, 101, 102][hit_blocks:]

    h.step(finished_recving={rid})
    s = h.step()
    assert s.scheduled == {rid: 1}  # the claim stopped at the prompt (47), not at 49
    (new,) = s.sched_out.scheduled_new_reqs
    assert new.num_computed_tokens == 46
    h.drain()
    h.assert_no_leak()


@pytest.mark.parametrize("prompt,max_tokens", [(40, 1), (47, 3)])
@pytest.mark.parametrize("staged", [False, True], ids=["paged", "staged"])
def test_prefill_params_feed_decode(make, prompt, max_tokens, staged):
    """What a real prefill returns (through a proxy's JSON) makes decode pull exactly the
    blocks, handoff and token prefill's SendSpec serves."""
    port = closed_port()
    p = make("kv_producer", ports=[port], extra_config={"side_channel_host": "127.0.0.1"},
             handshake_extra={"num_blocks": 64, "stage_blocks": 8} if staged else None)
    preq = p.add_request(prompt, kv_transfer_params=dict(REMOTE_DECODE), max_tokens=max_tokens)
    prid = preq.request_id
    p.run_until(lambda s: preq.is_finished(), max_steps=10)
    params = json.loads(json.dumps(p.final_output(prid).kv_transfer_params))
    computed = prompt + max_tokens - 1  # the last sampled token is never computed
    assert params["remote_num_tokens"] == computed
    assert len(params["remote_block_ids"]) == p.blocks_for(computed)
    p.step()
    (send,) = p.sends(prid)
    assert list(send.block_ids) == params["remote_block_ids"]
    assert bool(send.stage_from) == staged

    d = make("kv_consumer")
    dreq = d.add_request(prompt, prompt=list(preq.prompt_token_ids), kv_transfer_params=params,
                         max_tokens=2)
    drid = dreq.request_id
    s = d.step()
    (load,) = s.meta.loads
    assert not load.error and not load.release_only and load.first_block == 0
    assert list(load.local_block_ids) == d.block_ids(drid)
    assert load.remote_block_ids == send.block_ids[:d.blocks_for(prompt)]
    assert (load.handoff_id, load.token) == (send.req_id, send.token) == (prid, send.token)
    assert (load.host, load.ports) == ("127.0.0.1", (port,))
    assert (load.transport, load.kv_layout) == (TRANSPORT, KV_LAYOUT)

    d.step(finished_recving={drid})
    s = d.step()
    assert s.scheduled == {drid: 1}
    d.drain()
    d.assert_no_leak()

    if staged:
        p.step(worker_meta=DisaggWorkerMeta(released={prid: p.side.tp_size}))
    else:
        p.step(finished_sending={prid})
    p.assert_no_leak()


def test_mixed_sequence_leaks_nothing(make):
    """kv_both, every path at once (EmulatedWorkers answer the metadata): a handoff, a
    mid-prefill abort, a plain request, decode loads that succeed, fail (recompute), are aborted
    while waiting, are forged, arrive late. Nothing is left behind."""
    mixed_sequence(make("kv_both", kv_load_failure_policy="recompute",
                        max_num_batched_tokens=64))


def test_mixed_sequence_under_async_schedulings_overlapped_steps():
    """The same under AsyncScheduler as EngineCore drives it with async scheduling on: the next
    batch is scheduled while the previous one is out, outputs come back a turn late."""
    with SchedulerHarness("kv_both", kv_load_failure_policy="recompute",
                          max_num_batched_tokens=64, async_scheduling=True, overlap=True) as h:
        assert isinstance(h.scheduler, AsyncScheduler)
        mixed_sequence(h)
        assert h.most_in_flight == 2  # a batch was scheduled before the last one's output


def mixed_sequence(h: SchedulerHarness) -> None:
    w = EmulatedWorkers(load_delay=2, send_delay=2, fail={"fail"})

    def decode(req_id: str, forged: str = "") -> object:
        params = remote_prefill_params(h, 40, request_id=f"handoff-{req_id}", token=req_id)
        if forged:
            params = _forge(params, forged)
        return h.add_request(40, req_id=req_id, kv_transfer_params=params, max_tokens=2)

    def step_until(cond: Callable[[], bool], max_steps: int = 20) -> None:
        for _ in range(max_steps):
            if cond():
                return
            h.step_with(w)
        raise AssertionError("condition not met")

    handoff = h.add_request(40, req_id="handoff", kv_transfer_params=dict(REMOTE_DECODE))
    long = h.add_request(200, req_id="long", kv_transfer_params=dict(REMOTE_DECODE))
    plain = h.add_request(40, req_id="plain", max_tokens=3)
    step_until(lambda: 0 < long.num_computed_tokens < 200
               and long.status == RequestStatus.RUNNING)
    assert [r.request_id for r in h.abort("long")] == ["long"]
    assert "long" not in h.scheduler.requests

    ok, fail, aborted = decode("ok"), decode("fail"), decode("aborted")
    forged = decode("forged", forged="negative-block-id")
    assert set(h.side.leases.held()) == {"ok", "fail", "aborted"}  # forged: never held
    step_until(lambda: is_blocked_on_kv(aborted))
    assert not h.loads("aborted")[0].error
    h.abort("aborted")
    assert aborted.status == RequestStatus.FINISHED_ABORTED
    assert "aborted" in h.scheduler.requests and len(h.block_ids("aborted")) == 3
    assert "aborted" not in h.side.leases.held()

    late = decode("late")
    late_handoff = h.add_request(40, req_id="late-handoff",
                                 kv_transfer_params=dict(REMOTE_DECODE))
    step_until(lambda: w.idle() and not h.scheduler.requests
               and not h.scheduler.has_unfinished_requests(), max_steps=60)

    assert h.sends("long") == [] and handoff.is_finished() and late_handoff.is_finished()
    for rid in ("handoff", "late-handoff"):
        (send,) = h.sends(rid)
        assert h.final_output(rid).kv_transfer_params["remote_block_ids"] == list(send.block_ids)
    assert h.final_output("plain").finish_reason == FinishReason.LENGTH
    assert len(plain.output_token_ids) == 3
    for req in (ok, fail, aborted, forged, late):
        assert len(h.loads(req.request_id)) == 1, req.request_id
    assert h.loads("forged")[0].error and not h.loads("ok")[0].error
    assert aborted.status == RequestStatus.FINISHED_ABORTED

    def computed(rid: str) -> int:
        return sum(st.scheduled.get(rid, 0) for st in h.history)

    for rid in ("ok", "late"):  # loaded: the last prompt token, then one decode step
        assert h.final_output(rid).finish_reason == FinishReason.LENGTH
        assert computed(rid) == 2
    for rid in ("fail", "forged"):  # recompute policy: the whole prompt, locally
        assert h.final_output(rid).finish_reason == FinishReason.LENGTH
        assert computed(rid) == 41
    h.assert_no_leak()


def test_staging(make, monkeypatch):
    """Prefill with a staging arena: a handoff is copied there and vLLM frees its paged blocks
    at once; with no room left it holds its paged blocks; freed arena blocks are reused."""
    num_blocks = 64
    h = make("kv_producer", num_blocks=num_blocks, handshake=False)
    h.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): WorkerHandshake(
        port=HANDSHAKE_PORT, kv_layout=KV_LAYOUT, transport=TRANSPORT, num_blocks=num_blocks,
        stage_blocks=4)})
    arena = [num_blocks, num_blocks + 1, num_blocks + 2, num_blocks + 3]
    assert h.side._free_slots == arena

    delay_free: dict[str, bool] = {}  # what request_finished told vLLM
    real_request_finished = h.side.request_finished

    def request_finished(request, block_ids):
        out = real_request_finished(request, block_ids)
        delay_free[request.request_id] = out[0]
        return out

    monkeypatch.setattr(h.side, "request_finished", request_finished)

    def handoff() -> tuple[str, list[int], dict]:
        req = h.add_request(40, kv_transfer_params=dict(REMOTE_DECODE))
        s = h.step()
        (new,) = s.sched_out.scheduled_new_reqs
        assert req.is_finished()
        rid = req.request_id
        return rid, list(new.block_ids[0]), s.output(rid).kv_transfer_params

    # Staged: request_finished let vLLM free the paged blocks at once.
    a, a_paged, a_params = handoff()
    assert delay_free[a] is False
    assert a not in h.scheduler.requests and h.used_blocks() == 0
    assert a_params["remote_block_ids"] == arena[:3]
    assert all(b >= num_blocks for b in a_params["remote_block_ids"])
    s = h.step()
    (send,) = s.meta.sends
    assert send.req_id == a and list(send.stage_from) == a_paged
    assert list(send.block_ids) == arena[:3] and send.token == a_params["kvdisagg"]["token"]
    assert h.side._free_slots == arena[3:]
    assert "_staged" in h.connector_state()

    # The arena has one block left: the next handoff holds its paged blocks until pulled.
    b, b_paged, b_params = handoff()
    assert delay_free[b] is True
    assert b in h.scheduler.requests and h.block_ids(b) == b_paged and h.used_blocks() == 3
    assert b_params["remote_block_ids"] == b_paged
    s = h.step()
    (send,) = s.meta.sends
    assert send.req_id == b and send.stage_from == () and list(send.block_ids) == b_paged
    h.run(2)
    assert b in h.scheduler.requests and h.used_blocks() == 3
    assert h.side._free_slots == arena[3:]

    # Every worker freed a's arena blocks: they are free again, and the next handoff stages.
    h.step(worker_meta=DisaggWorkerMeta(released={a: h.side.tp_size}))
    assert sorted(h.side._free_slots) == arena
    assert a not in h.side._staged
    c, c_paged, c_params = handoff()
    assert delay_free[c] is False and c not in h.scheduler.requests
    assert set(c_params["remote_block_ids"]) <= set(arena)
    s = h.step()
    (send,) = s.meta.sends
    assert send.req_id == c and list(send.stage_from) == c_paged
    assert list(send.block_ids) == c_params["remote_block_ids"]

    h.step(finished_sending={b}, worker_meta=DisaggWorkerMeta(released={c: h.side.tp_size}))
    assert sorted(h.side._free_slots) == arena
    h.assert_no_leak()


# ---- the handoff timeline (tracing.py) ---------------------------------------------------------

TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_trace_context_flows_from_params_to_step_metadata(make):
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvdisagg.tracing import TRACE_PARAMS_KEY, Tracer

    p = make("kv_producer")
    good = p.add_request(40, kv_transfer_params={**REMOTE_DECODE, TRACE_PARAMS_KEY: TRACE})
    forged = p.add_request(40, kv_transfer_params={**REMOTE_DECODE,
                                                   TRACE_PARAMS_KEY: "00-x; rm -rf /"})
    p.run(3)
    assert p.sends(good.request_id)[0].trace == TRACE
    assert p.sends(forged.request_id)[0].trace == ""  # not W3C: dropped

    exporter = InMemorySpanExporter()
    h = make("kv_consumer")
    h.side.tracer = Tracer.with_processor(SimpleSpanProcessor(exporter), "test-decode")
    params = {**remote_prefill_params(h, 40), TRACE_PARAMS_KEY: TRACE}
    req = h.add_request(40, kv_transfer_params=params, max_tokens=2)
    (load,) = h.step().meta.loads
    assert load.trace.startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    assert not exporter.get_finished_spans()  # open while the pull runs
    h.step(finished_recving={req.request_id})
    (span,) = exporter.get_finished_spans()
    assert span.name == "kvdisagg.load" and span.parent.span_id == 0x00f067aa0ba902b7
    assert load.trace == f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-01"
    h.drain()
    h.assert_no_leak()

    aborted = h.add_request(40, kv_transfer_params={**remote_prefill_params(h, 40),
                                                    TRACE_PARAMS_KEY: TRACE}, max_tokens=2)
    h.step()
    h.abort(aborted.request_id)
    h.step(finished_recving={aborted.request_id})
    h.drain()
    assert exporter.get_finished_spans()[-1].attributes["abandoned"] is True
    h.assert_no_leak()


# ---- n > 1: sibling requests share one handoff (issue 16) ----------------------------------


def _siblings(h: SchedulerHarness, prompt: int, n: int, params: dict) -> list:
    """What vLLM's parallel sampling adds to the engine for ``n``: n requests with the same
    prompt and the same kv_transfer_params (one dict, shared through SamplingParams' copy)."""
    tokens = [(7 * i) % 500 + 3 for i in range(prompt)]
    reqs = [h.make_request(prompt, prompt=tokens, kv_transfer_params=params, max_tokens=3,
                           req_id=f"{i}_parent") for i in range(n)]
    for r in reqs:
        h.add(r)
    return reqs


@pytest.mark.parametrize("prompt", [40, 48, 12])
def test_decode_siblings_pull_once_and_share_through_the_prefix_cache(make, prompt):
    h = make("kv_consumer")
    params = remote_prefill_params(h, prompt, token="secret")
    owner, *sibs = _siblings(h, prompt, 3, params)

    s = h.step()
    (load,) = s.meta.loads  # one pull for all three
    assert load.req_id == owner.request_id and not load.release_only
    assert owner.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    for s in h.run(2):  # the siblings wait for the pull, holding no blocks
        assert s.scheduled == {} and s.meta.loads == []
    assert all(r.status == RequestStatus.WAITING for r in sibs)
    assert h.used_blocks() == h.blocks_for(prompt)
    # The siblings hold the handoff too until they know they need not pull it.
    assert set(h.side.leases.held()) == {r.request_id for r in (owner, *sibs)}

    h.step(finished_recving={owner.request_id})
    s = h.step()
    # decode's prefix cache now holds the full blocks of the owner's prompt - 1 loaded tokens
    cached = (prompt - 1) // h.block_size * h.block_size
    assert s.scheduled[owner.request_id] == 1
    for r in sibs:  # from the prefix cache: only the tail past the last full block
        assert s.scheduled[r.request_id] == prompt - cached, (r.request_id, s.scheduled)
    assert h.side.leases.held() == {}
    h.drain()
    assert [len(h.loads(r.request_id)) for r in (owner, *sibs)] == [1, 0, 0]
    for r in (owner, *sibs):
        assert h.final_output(r.request_id).finish_reason == FinishReason.LENGTH
    h.assert_no_leak()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_decode_siblings_of_a_failed_load_fail_or_recompute_with_it(make, policy):
    h = make("kv_consumer", kv_load_failure_policy=policy)
    params = remote_prefill_params(h, 40)
    owner, sib = _siblings(h, 40, 2, params)
    h.step()
    h.step(failed_recving={owner.request_id})
    s = h.step()
    (err,) = [ld for ld in s.meta.loads if ld.req_id == sib.request_id]
    assert "failed" in err.error and not err.release_only  # no second read of the handoff
    h.step(failed_recving={sib.request_id})
    h.drain()
    for r in (owner, sib):
        want = FinishReason.ERROR if policy == "fail" else FinishReason.LENGTH
        assert h.final_output(r.request_id).finish_reason == want
    assert all(not ld.release_only and (ld.error or ld.req_id == owner.request_id)
               for ld in h.loads())
    h.assert_no_leak()


def test_decode_sibling_aborted_while_waiting_leaves_nothing(make):
    h = make("kv_consumer")
    params = remote_prefill_params(h, 40)
    owner, sib = _siblings(h, 40, 2, params)
    h.step()
    h.abort(sib.request_id)
    h.step(finished_recving={owner.request_id})
    h.drain()
    assert len(h.loads()) == 1
    assert h.final_output(owner.request_id).finish_reason == FinishReason.LENGTH
    h.assert_no_leak()


def test_decode_owner_aborted_mid_pull_fails_its_siblings_load_not_a_second_read(make):
    h = make("kv_consumer")
    params = remote_prefill_params(h, 40)
    owner, sib = _siblings(h, 40, 2, params)
    h.step()
    h.abort(owner.request_id)  # the owner's pull goes on until reported; its blocks with it
    s = h.step()
    (err,) = s.meta.loads
    assert err.req_id == sib.request_id and err.error  # not a pull of a released handoff
    h.step(finished_recving={owner.request_id}, failed_recving={sib.request_id})
    h.drain()
    assert h.final_output(sib.request_id).finish_reason == FinishReason.ERROR
    h.assert_no_leak()


# ---- silent recompute is visible (issue 18) -------------------------------------------------


def recomputed(h: SchedulerHarness) -> dict[str, int]:
    """vllm:kvdisagg_recomputed_prompts_total by reason, as the engine's stats carried it."""
    out: dict[str, int] = {}
    for s in h.history:
        data = (s.stats.kv_connector_stats if s.stats is not None else None) or {}
        for reason, n in data.get("recomputed_prompts", {}).items():
            out[reason] = out.get(reason, 0) + n
    return out


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("case", ["loaded", "load_failed", "invalid_params", "not_read",
                                  "tail", "aborted"])
def test_decode_counts_requests_that_computed_their_prompt_despite_a_handoff(make, case, policy):
    """Only a request that arrived with a handoff, got an answer, and computed its prompt here
    counts, once, by why; a failure under the fail policy is an error, not a recompute."""
    h = make("kv_consumer", kv_load_failure_policy=policy)
    params = remote_prefill_params(h, 40)
    if case == "invalid_params":
        params = _forge(params, "stages-not-from-0")
    if case == "tail":  # decode's prefix cache holds the prompt's full blocks: the rest loads
        tokens = [(5 * i) % 500 + 3 for i in range(40)]
        warm = h.add_request(40, prompt=tokens, max_tokens=1)
        h.drain()
        assert h.final_output(warm.request_id) is not None
    req = h.add_request(40, kv_transfer_params=params, max_tokens=2,
                        **({"prompt": tokens} if case == "tail" else {}),
                        **({"prompt_logprobs": 1} if case == "not_read" else {}))
    rid = req.request_id
    s = h.step()
    if case in ("loaded", "tail"):
        (load,) = s.meta.loads
        assert len(load.local_block_ids) == (1 if case == "tail" else 3)
        h.step(finished_recving={rid})
    elif case == "load_failed":
        h.step(failed_recving={rid})
    elif case == "invalid_params":
        (load,) = s.meta.loads
        assert load.error
        h.step(failed_recving={rid})
    elif case == "aborted":
        h.abort(rid)
        h.step(finished_recving={rid})
    h.drain()
    failed = case in ("load_failed", "invalid_params")
    answered = case != "aborted" and not (failed and policy == "fail")
    if case != "aborted":  # an aborted request gets no final output from the engine
        assert (h.final_output(rid).finish_reason == FinishReason.LENGTH) == answered
    assert recomputed(h) == ({case: 1} if answered and (failed or case == "not_read") else {})
    h.assert_no_leak()


def test_decode_siblings_that_recompute_count_each(make):
    h = make("kv_consumer", kv_load_failure_policy="recompute")
    owner, sib = _siblings(h, 40, 2, remote_prefill_params(h, 40))
    h.step()
    h.step(failed_recving={owner.request_id})
    h.step()
    h.step(failed_recving={sib.request_id})
    h.drain()
    assert recomputed(h) == {"load_failed": 2}
    h.assert_no_leak()


# ---- decode with a store transport: the next turn's KV (issue 15) ---------------------------


@pytest.mark.parametrize("store", [True, False])
def test_decode_stores_prompt_and_answer_in_whole_chunks(make, store):
    h = make("kv_consumer", transport="lmcache", handshake_extra={"keyed_by_tokens": True},
             extra_config={"transport": "lmcache", "lmcache_url": "lm://127.0.0.1:1",
                           "lmcache_chunk_tokens": 32, "lmcache_store_decoded": store})
    req = h.add_request(40, max_tokens=30)  # served by decode alone (no handoff)
    rid = req.request_id
    h.run_until(lambda s: req.is_finished())
    h.step()  # the store goes to the workers with the next step's metadata
    sends = h.sends(rid)
    if not store:
        assert sends == []
        h.drain()
        h.assert_no_leak()
        return
    (send,) = sends
    tokens = [*req.prompt_token_ids, *req.output_token_ids]
    assert len(tokens) == 70  # 69 of them have KV: two whole 32-token chunks are stored
    assert list(send.prompt_token_ids) == tokens[:64]
    assert list(send.block_ids) == h.block_ids(rid)[:4] and not send.stage_from
    assert h.used_blocks() == h.blocks_for(70)  # held until stored
    h.run(2)
    assert h.used_blocks() == h.blocks_for(70) and len(h.sends(rid)) == 1
    h.step(finished_sending={rid})
    h.drain()
    h.assert_no_leak()


def test_decode_stores_nothing_short_of_a_chunk(make):
    h = make("kv_consumer", transport="lmcache", handshake_extra={"keyed_by_tokens": True},
             extra_config={"transport": "lmcache", "lmcache_url": "lm://127.0.0.1:1",
                           "lmcache_chunk_tokens": 256})
    req = h.add_request(40, max_tokens=3)
    h.drain()
    assert h.sends(req.request_id) == []
    h.assert_no_leak()


# ---- early handoffs (the proxy sends decode's leg with prefill's) -----------------------------

EARLY = {"handoff_id": "early-handoff-id-0123", "token": "early-token-0123456789"}


def test_prefill_expects_an_early_handoff_and_offers_it_under_the_proxys_name(make):
    """The request names its handoff (``kvdisagg_early``): the workers expect it from the
    request's first step, and the offer and the client's params carry that id and token."""
    p = make("kv_producer", ports=[closed_port()])
    req = p.add_request(40, kv_transfer_params={**REMOTE_DECODE, "kvdisagg_early": EARLY})
    s = p.step()
    assert s.meta.expects == [(EARLY["handoff_id"], EARLY["token"])]
    p.run_until(lambda s: req.is_finished(), max_steps=10)
    params = p.final_output(req.request_id).kv_transfer_params
    assert params["remote_request_id"] == EARLY["handoff_id"]
    assert params["kvdisagg"]["token"] == EARLY["token"]
    p.step()
    (send,) = p.sends(req.request_id)
    assert (send.req_id, send.handoff_id, send.token) == (
        req.request_id, EARLY["handoff_id"], EARLY["token"])
    p.step(finished_sending={req.request_id})
    p.assert_no_leak()


@pytest.mark.parametrize("bad", [{"handoff_id": "short", "token": EARLY["token"]},
                                 {"handoff_id": EARLY["handoff_id"]}, "not-a-dict"])
def test_prefill_ignores_an_invalid_early_handoff(make, bad):
    p = make("kv_producer", ports=[closed_port()])
    req = p.add_request(40, kv_transfer_params={**REMOTE_DECODE, "kvdisagg_early": bad})
    assert p.step().meta.expects == []
    p.run_until(lambda s: req.is_finished(), max_steps=10)
    assert p.final_output(req.request_id).kv_transfer_params["remote_request_id"] == \
        req.request_id
    p.step()
    p.step(finished_sending={req.request_id})
    p.assert_no_leak()


def test_prefill_aborted_early_handoff_is_forgotten(make):
    """The decode reading it early is refused with the reason instead of waiting."""
    p = make("kv_producer", ports=[closed_port()])
    req = p.add_request(40, kv_transfer_params={**REMOTE_DECODE, "kvdisagg_early": EARLY})
    p.abort(req.request_id)  # before its step (the worker learns both, in this order)
    s = p.step()
    assert s.meta.expects == [(EARLY["handoff_id"], EARLY["token"])]
    assert s.meta.forgets == [(EARLY["handoff_id"],
                               "not offered: prefill's request ended FINISHED_ABORTED")]
    assert not s.meta.sends
    p.assert_no_leak()


@pytest.mark.parametrize("hit", [0, 1])
def test_decode_early_params_load_by_position_the_whole_prompt(make, hit):
    """Early params carry no block ids and no token count: decode claims its whole prompt
    (but the last token) and reads prefill's blocks by position after its local hit."""
    d = make("kv_consumer")
    prompt = [5 + i for i in range(40)]
    if hit:  # decode's prefix cache holds the first block
        warm = d.add_request(40, prompt=prompt[:16] + [999] * 24, max_tokens=1)
        d.run_until(lambda s: warm.is_finished(), max_steps=10)
    params = remote_prefill_params(d, 40, block_ids=[], request_id=EARLY["handoff_id"],
                                   token=EARLY["token"])
    params["remote_num_tokens"] = 0
    params["kvdisagg"]["early"] = True
    req = d.add_request(40, prompt=prompt, kv_transfer_params=params, max_tokens=2)
    s = d.step()
    (load,) = s.meta.loads
    assert not load.error and load.early and load.remote_block_ids == ()
    assert load.first_block == hit
    assert list(load.local_block_ids) == d.block_ids(req.request_id)[hit:]
    assert (load.handoff_id, load.token) == (EARLY["handoff_id"], EARLY["token"])
    assert d.side._early_waiting == {req.request_id}  # an idle engine pauses per step
    d.step(finished_recving={req.request_id})
    assert d.step().scheduled == {req.request_id: 1}  # the last prompt token, computed here
    d.drain()
    d.assert_no_leak()


# ---- protocol versions (rolling upgrades) ----------------------------------------------------


@pytest.mark.parametrize("theirs, override, early, version", [
    ((4, 5), None, False, 5),
    ((4, 4), None, False, 4),  # a prefill of the previous release
    ((5, 6), None, False, 5),  # ... of the next one, which still speaks 5
    ((6, 6), None, False, None),
    ((4, 5), 4, False, 4),  # this decode announces 4 only (protocol_version_override)
    ((4, 5), 6, False, None),
    ((4, 4), None, True, None),  # an early handoff needs 5 on both sides
])
def test_decode_speaks_the_highest_version_in_common_with_the_prefill(make, theirs, override,
                                                                      early, version):
    """The version goes to the worker's pull (LoadSpec) and the lease renewals (Held); params
    of a prefill with none in common are unusable: the load fails at once (the request
    recomputed under that policy, counted invalid_params) and no lease is held."""
    h = make("kv_consumer", kv_load_failure_policy="recompute",
             extra_config={} if override is None else {"protocol_version_override": override})
    params = remote_prefill_params(h, 40)
    params["kvdisagg"] |= {"min_version": theirs[0], "version": theirs[1], "early": early}
    if early:
        params |= {"remote_block_ids": [], "remote_num_tokens": 0}
    req = h.add_request(40, kv_transfer_params=params, max_tokens=2)
    rid = req.request_id
    held = h.side.leases.held()
    s = h.step()
    (load,) = s.meta.loads
    if version is None:
        assert held == {}
        assert "early handoff needs protocol 5" in load.error if early else (
            f"speaks side-channel protocol {Versions(*theirs)}, this decode "
            f"{Versions(override, override) if override else SPOKEN}: no version in common"
            in load.error), load.error
        h.step(failed_recving={rid})
    else:
        assert not load.error and load.version == version
        assert held[rid].version == version
        h.step(finished_recving={rid})
    h.drain()
    assert h.final_output(rid).finish_reason == FinishReason.LENGTH
    assert recomputed(h) == ({} if version else {"invalid_params": 1})
    h.assert_no_leak()


@pytest.mark.parametrize("override", [None, 7])
def test_prefill_says_in_its_handoff_params_which_versions_it_speaks(make, override):
    h = make("kv_producer",
             extra_config={} if override is None else {"protocol_version_override": override})
    req = h.add_request(40, kv_transfer_params=dict(REMOTE_DECODE), max_tokens=1)
    rid = req.request_id
    s = h.step()
    extras = s.output(rid).kv_transfer_params["kvdisagg"]
    want = SPOKEN if override is None else Versions(override, override)
    assert (extras["min_version"], extras["version"]) == want
    h.step()
    h.step(finished_sending={rid})
    h.assert_no_leak()
