"""The plugin's two workarounds for vLLM 0.32 on CPU hosts, on vLLM's real classes."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")

from kvdisagg import plugin  # noqa: E402

PD_ARGV = ["vllm", "serve", "m", "--kv-transfer-config", '{"kv_connector":"DisaggConnector"}']


def test_busy_waits_of_a_disagg_instance_pause_to_hand_the_gil_over(monkeypatch):
    from vllm.distributed.device_communicators import shm_broadcast

    monkeypatch.setattr(shm_broadcast, "sched_yield", shm_broadcast.sched_yield)
    assert not plugin._gil_friendly_spin(["vllm", "serve", "m"])  # not a kvdisagg instance
    assert not getattr(shm_broadcast.sched_yield, "_kvdisagg", False)
    sleeps: list[float] = []
    monkeypatch.setattr("time.sleep", sleeps.append)
    assert plugin._gil_friendly_spin(PD_ARGV)
    patched = shm_broadcast.sched_yield
    assert plugin._gil_friendly_spin(PD_ARGV) and shm_broadcast.sched_yield is patched
    for _ in range(3 * plugin.SPIN_PAUSE_EVERY):
        patched()
    assert sleeps == [plugin.SPIN_PAUSE_S] * 3


@pytest.mark.parametrize("first_stage, allocated", [(False, True), (True, False)])
def test_a_later_pipeline_stage_gets_its_receive_buffer(monkeypatch, first_stage, allocated):
    from vllm.v1.worker.cpu_worker import CPUWorker

    monkeypatch.setattr(CPUWorker, "compile_or_warm_up_model", lambda self: "warmed")
    plugin._cpu_pp_receive_buffer()
    plugin._cpu_pp_receive_buffer()  # idempotent: wrapped once
    assert CPUWorker.compile_or_warm_up_model._kvdisagg
    made = []
    runner = types.SimpleNamespace(
        intermediate_tensors=None, max_num_tokens=8, device="cpu",
        model_config=types.SimpleNamespace(dtype="float32"),
        model=types.SimpleNamespace(make_empty_intermediate_tensors=lambda **kw: made.append(kw)
                                    or "buffer"))
    monkeypatch.setattr("vllm.distributed.parallel_state.get_pp_group",
                        lambda: types.SimpleNamespace(is_first_rank=first_stage))
    worker = types.SimpleNamespace(model_runner=runner)
    assert CPUWorker.compile_or_warm_up_model(worker) == "warmed"
    assert (runner.intermediate_tensors == "buffer") is allocated
    assert made == ([{"batch_size": 8, "dtype": "float32", "device": "cpu"}] if allocated else [])


@pytest.mark.parametrize("argv, serves", [
    (PD_ARGV, True),
    (["vllm", "serve", "m", '--kv-transfer-config={"kv_connector": "DisaggConnector"}'], True),
    (["vllm", "serve", "m", "--kv_transfer_config", '{"kv_connector":"DisaggConnector"}'], True),
    (["vllm", "serve", "m", "--kv-transfer-config", '{"kv_connector":"NixlConnector"}'], False),
    (["vllm", "serve", "DisaggConnector"], False),  # the word alone is not the config
    (["vllm", "serve", "m", "--kv-transfer-config"], False),
    (["vllm", "serve", "m", "--kv-transfer-config", "{not json"], False),
])
def test_a_disagg_instance_is_recognised_by_its_kv_transfer_config(argv, serves):
    assert plugin.serves_disagg_connector(argv) is serves
