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

    def prefill_stage_s(self, sum_len: float, sum_sq: float) -> float:
        """Seconds one pipeline stage spends on a prefill batch (first-stage overheads included)."""
        a, b, c = self._pre
        ms = (a + b * sum_len + c * sum_sq) / self.pp + self._pp_oh
        ms += self._it + self._it_tok * sum_len
        return ms * 1e-3 * self.scale

    def prefill_s(self, sum_len: float, sum_sq: float) -> float:
        """Seconds from start to end of a prefill batch through all stages of an idle pipeline."""
        return self.prefill_stage_s(sum_len, sum_sq) * self.pp

    def decode_stage_s(self, batch: int, sum_ctx1: float) -> float:
        """Seconds one stage spends on a decode step; ``sum_ctx1`` = sum of (context + 1)."""
        a, b, c = self._small if batch < self._thr else self._large
        ms = (a + b * sum_ctx1 + c * batch) / self.pp
        ms += self._it + self._it_tok * (sum_ctx1 - batch)
        return ms * 1e-3 * self.scale

    def decode_s(self, batch: int, sum_ctx1: float) -> float:
        """Seconds for one decode step through all stages of an idle pipeline."""
        return self.decode_stage_s(batch, sum_ctx1) * self.pp
