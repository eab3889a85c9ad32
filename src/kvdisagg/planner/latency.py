"""Evaluate a ``ParallelProfile`` for one batch, in seconds (the simulator's clock unit).

Pure arithmetic, called once per simulated iteration, so it avoids allocation: callers pass the
batch aggregates (sums) they maintain incrementally. Must not import ``vllm``.
"""

from __future__ import annotations

from kvdisagg.planner.profile import ParallelProfile


class LatencyModel:
    """Stage times of one instance config; ``pp`` stages each take ``work / pp``."""

    __slots__ = ("_pre", "_small", "_large", "_thr", "pp", "_pp_oh", "_it", "_it_tok", "scale")

    def __init__(self, cfg: ParallelProfile, *, scale: float = 1.0) -> None:
        self._pre = cfg.prefill
        self._small = cfg.decode_small
        self._large = cfg.decode_large
        self._thr = cfg.decode_bs_threshold
        self.pp = cfg.pp
        self._pp_oh = cfg.pp_overhead_ms
        self._it = cfg.iter_overhead_ms
        self._it_tok = cfg.iter_overhead_per_token_ms
        self.scale = scale
        """Multiplies every time (for what-if slower or faster hardware)."""

    def prefill_stages_s(self, sum_len: float, sum_sq: float) -> tuple[float, float]:
        """Seconds (first stage, each later stage) of a prefill batch.

        Each stage does ``work / pp + pp_overhead_ms * pp`` (DistServe's literal form); only the
        first stage pays the per-iteration overhead.
        """
        a, b, c = self._pre
        stage = (a + b * sum_len + c * sum_sq) / self.pp + self._pp_oh * self.pp
        first = stage + self._it + self._it_tok * sum_len
        return first * 1e-3 * self.scale, stage * 1e-3 * self.scale

    def prefill_s(self, sum_len: float, sum_sq: float) -> float:
        """Seconds from start to end of a prefill batch through all stages of an idle pipeline."""
        first, other = self.prefill_stages_s(sum_len, sum_sq)
        return first + other * (self.pp - 1)

    def decode_stages_s(self, batch: int, sum_ctx1: float) -> tuple[float, float]:
        """Seconds (first stage, each later stage) of a decode step; ``sum_ctx1`` = sum(ctx + 1)."""
        a, b, c = self._small if batch < self._thr else self._large
        stage = (a + b * sum_ctx1 + c * batch) / self.pp
        first = stage + self._it + self._it_tok * (sum_ctx1 - batch)
        return first * 1e-3 * self.scale, stage * 1e-3 * self.scale

    def decode_s(self, batch: int, sum_ctx1: float) -> float:
        """Seconds for one decode step through all stages of an idle pipeline."""
        first, other = self.decode_stages_s(batch, sum_ctx1)
        return first + other * (self.pp - 1)

    def decode_linear_s(self, batch: int) -> tuple[float, float]:
        """``(c0, c1)`` with ``decode_s(batch, s) == c0 + c1 * s`` for this batch size.

        The simulator uses it to jump over decode steps in closed form when nothing else happens.
        """
        a, b, c = self._small if batch < self._thr else self._large
        k = 1e-3 * self.scale
        return (a + c * batch + self._it - self._it_tok * batch) * k, (b + self._it_tok) * k
