"""The plugin (kvdisagg/plugin.py): its two workarounds for vLLM 0.32 on CPU hosts, on vLLM's real
classes, how it recognises a DisaggConnector instance, and its OpenMP setting on shared cores."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")

from kvdisagg import plugin

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


# ---- the plugin's OpenMP setting on shared cores ----------------------------------------------


@pytest.mark.parametrize("environ, argv, applied", [
    ({}, PD_ARGV, True),                                        # vLLM's defaults: shared cores
    ({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, PD_ARGV, True),
    ({"VLLM_CPU_OMP_THREADS_BIND": "0"}, PD_ARGV, False),       # own cores: left alone
    ({"OMP_WAIT_POLICY": "ACTIVE"}, PD_ARGV, False),            # the user's choice wins
    ({}, ["vllm", "serve", "m"], False),                        # not a kvdisagg instance
])
def test_plugin_makes_openmp_wait_passively_only_on_shared_cores(environ, argv, applied):
    from kvdisagg.plugin import PASSIVE_OMP_ENV, _passive_omp_on_shared_cores

    before = dict(environ)
    assert _passive_omp_on_shared_cores(environ, argv) is applied
    assert environ == ({**before, **PASSIVE_OMP_ENV} if applied else before)


def test_a_dropped_sample_leaves_a_seeded_cpu_generator_where_it_was(monkeypatch):
    """The CPU rewind around vLLM's CPUModelRunner: sampling a chunk's dropped token draws from
    the request's generator, which is put back; vLLM's own (CUDA) rewind never sees it; a kept
    sample advances its generator as usual."""
    import numpy as np
    import torch
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    def sample(self, logits, spec):  # draws as vLLM's sampler does, one per seeded request
        return {i: torch.rand(1, generator=g).item()
                for i, g in self.input_batch.generators.items()}

    def bookkeeping(self, *args):  # vLLM 0.32's rewind, which a CPU generator refuses
        for i in np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0]:
            if (gen := self.input_batch.generators.get(int(i))) is not None:
                gen.set_offset(gen.get_offset() - 4)
        return "kept"

    monkeypatch.setattr(CPUModelRunner, "_sample", sample)
    monkeypatch.setattr(CPUModelRunner, "_bookkeeping_sync", bookkeeping)
    with pytest.raises(RuntimeError, match="does not use offset"):  # the bug, unpatched
        bookkeeping(types.SimpleNamespace(
            input_batch=types.SimpleNamespace(num_reqs=1, generators={0: torch.Generator()}),
            discard_request_mask=types.SimpleNamespace(np=np.array([True]))))
    plugin._cpu_seeded_chunks()
    plugin._cpu_seeded_chunks()  # idempotent: wrapped once
    assert CPUModelRunner._sample._kvdisagg
    chunked, last = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    generators = {0: chunked, 2: last}
    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(num_reqs=3, generators=generators),
        discard_request_mask=types.SimpleNamespace(np=np.array([True, True, False, False])))
    first = CPUModelRunner._sample(runner, None, None)
    assert CPUModelRunner._bookkeeping_sync(runner) == "kept"
    assert generators == {0: chunked, 2: last}
    # The chunk's generator draws its first number again; the other one has moved on.
    again = CPUModelRunner._sample(runner, None, None)
    assert again[0] == first[0] == torch.rand(1, generator=torch.Generator().manual_seed(1)).item()
    assert again[2] != first[2]
