"""Simulated traces: request lengths drawn from a ``LengthPool`` and Poisson arrivals,
deterministic under a seed.

Arrivals for a rate sweep reuse one stream of unit-rate exponential gaps scaled by ``1/rate``
(common random numbers), so attainment changes with rate only because of the rate, not noise,
and the bisection in ``goodput`` sees a (nearly) monotone curve. A pool read from a file is
read by ``kvdisagg bench``'s dataset loader (bench/workload.py ``parse_dataset``: one format for
both commands). Must not import ``vllm``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np

from kvdisagg.bench.workload import parse_dataset
from kvdisagg.errors import ConfigError


class LengthPool(msgspec.Struct, frozen=True):
    """A pool of (prompt_len, output_len) pairs that requests are drawn from (with replacement)."""

    name: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]

    def mean(self) -> tuple[float, float]:
        return float(np.mean(self.prompt)), float(np.mean(self.output))


class Requests(NamedTuple):
    """One simulated trace: arrival times (s) and lengths, numpy arrays of equal length."""

    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray


def load_lengths(spec: str) -> LengthPool:
    """``sharegpt`` (DistServe's ShareGPT, OPT tokenizer), ``fixed:PROMPT:OUTPUT``, or a dataset
    file, ``.csv`` or ``.jsonl`` (``kvdisagg bench``'s format: bench/workload.py
    ``parse_dataset``). ConfigError for a spec or file it cannot read.
    """
    if spec == "sharegpt":
        text = (
            resources.files("kvdisagg.planner")
            .joinpath("data/sharegpt_opt13b_lengths.csv")
            .read_text()
        )
        return _pool("sharegpt", text, ".csv")
    if spec.startswith("fixed:"):
        try:
            _, p, o = spec.split(":")
            pl, ol = int(p), int(o)
        except ValueError as exc:
            raise ConfigError(f"workload {spec!r}: expected fixed:PROMPT_LEN:OUTPUT_LEN") from exc
        if pl < 1 or ol < 1:
            raise ConfigError(f"workload {spec!r}: lengths must be >= 1")
        return LengthPool(spec, (pl,), (ol,))
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"workload {spec!r}: not 'sharegpt', 'fixed:P:O' or an existing file")
    return _pool(path.name, path.read_text(), path.suffix)


def _pool(name: str, text: str, suffix: str) -> LengthPool:
    try:
        rows = parse_dataset(text, suffix, name)
    except ValueError as exc:
        raise ConfigError(f"workload: {exc}") from exc
    return LengthPool(name, tuple(r.prompt_len for r in rows), tuple(r.output_len for r in rows))


class TraceSeed(NamedTuple):
    """Unit-rate arrival gaps and drawn lengths; ``at_rate`` turns it into a trace."""

    gaps: np.ndarray
    prompt: np.ndarray
    output: np.ndarray

    def at_rate(self, rate: float) -> Requests:
        if rate <= 0:
            raise ConfigError(f"rate must be > 0, got {rate}")
        return Requests(np.cumsum(self.gaps) / rate, self.prompt, self.output)


def draw(lengths: LengthPool, n: int, *, seed: int = 0, poisson: bool = True) -> TraceSeed:
    """``n`` requests with lengths drawn from ``lengths`` and Poisson (or even) arrival gaps."""
    if n < 1:
        raise ConfigError(f"number of requests must be >= 1, got {n}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(lengths.prompt), size=n)
    gaps = rng.exponential(1.0, size=n) if poisson else np.ones(n)
    gaps[0] = 0.0 if not poisson else gaps[0]
    return TraceSeed(gaps, np.asarray(lengths.prompt, dtype=np.int64)[idx],
                     np.asarray(lengths.output, dtype=np.int64)[idx])
