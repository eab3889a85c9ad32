"""vLLM 0.32's private model-runner methods that the plugin wraps on CPU (plugin._cpu_seeded_chunks
says why): ``CPUModelRunner._sample``, where a dropped sample draws from a seeded request's
generator, and ``_bookkeeping_sync``, where vLLM rewinds that generator by offset, which a CPU
generator refuses. Here and nowhere else."""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_model_runner import CPUModelRunner


def rewind_dropped_samples_on_cpu() -> None:
    """Wrap both methods once: the generators of this step's dropped samples get their state
    back after sampling and are hidden from vLLM's own rewind."""
    sample, bookkeeping = CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync
    if getattr(sample, "_kvdisagg", False):
        return

    def dropped_cpu_generators(runner: Any) -> dict[int, Any]:
        batch = runner.input_batch
        dropped = runner.discard_request_mask.np[:batch.num_reqs].nonzero()[0]
        return {int(i): gen for i in dropped
                if (gen := batch.generators.get(int(i))) is not None
                and gen.device.type == "cpu"}

    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        states = [(gen, gen.get_state()) for gen in dropped_cpu_generators(self).values()]
        try:
            return sample(self, *args, **kwargs)
        finally:
            for gen, state in states:
                gen.set_state(state)

    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        generators = self.input_batch.generators
        rewound = dropped_cpu_generators(self)
        for i in rewound:
            del generators[i]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(rewound)

    _sample._kvdisagg = True  # type: ignore[attr-defined]
    CPUModelRunner._sample = _sample
    CPUModelRunner._bookkeeping_sync = _bookkeeping_sync
