"""Simulated workloads: request length pairs and Poisson arrivals, deterministic under a seed.

Arrivals for a rate sweep reuse one stream of unit-rate exponential gaps scaled by ``1/rate``
(common random numbers), so attainment changes with rate only because of the rate, not noise,
and the bisection in ``goodput`` sees a (nearly) monotone curve. Must not import ``vllm``.
"""

from __future__ import annotations

import csv
import json
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np

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
    """``sharegpt`` (DistServe's ShareGPT, OPT tokenizer), ``fixed:PROMPT:OUTPUT``, or a file.

    A file is CSV with ``prompt_len,output_len`` columns, or JSON lines with those keys (also
    accepted: ``prompt_tokens``/``output_tokens``, as in ``kvdisagg bench`` records).
    """
    if spec == "sharegpt":
        text = (
            resources.files("kvdisagg.planner")
            .joinpath("data/sharegpt_opt13b_lengths.csv")
            .read_text()
        )
        return _from_rows("sharegpt", csv.DictReader(text.splitlines()))
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
    text = path.read_text()
    if path.suffix == ".csv":
        return _from_rows(path.name, csv.DictReader(text.splitlines()))
    try:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError as exc:
        raise ConfigError(f"workload {spec}: not JSON lines ({exc})") from exc
    return _from_rows(path.name, rows)


def _from_rows(name: str, rows: object) -> LengthPool:
    prompt, output = [], []
    for row in rows:  # type: ignore[attr-defined]
        try:
            p = int(row.get("prompt_len", row.get("prompt_tokens")))
            o = int(row.get("output_len", row.get("output_tokens")))
        except (TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(
                f"workload {name}: row {row!r} lacks integer prompt_len/output_len"
            ) from exc
        if p < 1 or o < 1:
            raise ConfigError(f"workload {name}: row {row!r} has a length < 1")
        prompt.append(p)
        output.append(o)
    if not prompt:
        raise ConfigError(f"workload {name}: no rows")
    return LengthPool(name, tuple(prompt), tuple(output))


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
