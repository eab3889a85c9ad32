"""The planner's latency profile: file format, fitting from measured samples, DistServe import.

A profile holds, per parallelism config ``(tp, pp)`` of one model on one kind of hardware,
DistServe's latency model (OSDI'24, ``simdistserve/estimators``; coefficients in milliseconds)::

    prefill_ms(batch) = (a + b*sum(L_i) + c*sum(L_i^2)) / pp  [per stage]   + pp_overhead_ms*pp
    decode_ms(batch)  = (a + b*sum(ctx_i + 1) + c*B) / pp      [per stage]
                        (decode_small if B < decode_bs_threshold else decode_large)
    every iteration, first stage: + iter_overhead_ms + iter_overhead_per_token_ms * sum(ctx_i)

``L_i`` is the prompt length of request ``i`` of a prefill batch, ``ctx_i`` the tokens already
in the KV cache of decode request ``i`` (prompt + tokens generated so far), ``B`` the decode batch
size. ``max_num_tokens`` is the KV-cache capacity of one instance in tokens (also the prefill
token budget). The file is JSON, ``msgspec``-typed and versioned (``PROFILE_VERSION``).

Interface used by ``kvdisagg profile`` (stable; new fields get defaults):

    samples: list[LatencySample]      # one measured prefill or decode batch each
    profile = fit_profile(samples, model=..., hardware=..., max_num_tokens={(1, 1): 12345})
    save_profile(profile, "profile.json")

``fit_profile`` groups samples by ``(tp, pp)`` and fits each phase by least squares on relative
error (DistServe's procedure: rows divided by the measured time), dropping a regressor whose
coefficient comes out negative, so noisy CPU measurements still give a monotone model. Measured
samples already include per-iteration overheads, so fitted configs set the overhead terms to 0.

This module must not import ``vllm``.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import numpy as np

from kvdisagg.errors import ConfigError

# Version history:
#   1: first format (DistServe model per (tp, pp); KV bytes per token for transfer time).
PROFILE_VERSION = 1

Coeffs = tuple[float, float, float]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


class LatencySample(msgspec.Struct, frozen=True, kw_only=True):
    """One measured batch: what ``kvdisagg profile`` records and ``fit_profile`` consumes."""

    phase: Literal["prefill", "decode"]
    batch_size: PositiveInt
    num_tokens: Annotated[int, msgspec.Meta(ge=0)]
    """prefill: sum of prompt lengths; decode: sum over the batch of (context length + 1)."""
    seconds: Annotated[float, msgspec.Meta(gt=0)]
    """Wall time of one iteration (prefill: the whole batch's forward; decode: one step)."""
    tp: PositiveInt = 1
    pp: PositiveInt = 1
    sum_sq_tokens: int | None = None
    """prefill only: sum of squared prompt lengths; None means equal lengths (num_tokens^2/B)."""

    @classmethod
    def uniform(
        cls, phase: Literal["prefill", "decode"], batch_size: int, input_len: int, seconds: float,
        *, tp: int = 1, pp: int = 1,
    ) -> LatencySample:
        """A batch of ``batch_size`` requests of equal length (DistServe's profiling grid).

        For decode, ``input_len`` is each request's context length (tokens already cached).
        """
        if phase == "prefill":
            return cls(
                phase=phase,
                batch_size=batch_size,
                num_tokens=batch_size * input_len,
                sum_sq_tokens=batch_size * input_len * input_len,
                seconds=seconds,
                tp=tp,
                pp=pp,
            )
        return cls(phase=phase, batch_size=batch_size, num_tokens=batch_size * (input_len + 1),
                   seconds=seconds, tp=tp, pp=pp)

    def squares(self) -> float:
        """Sum of squared prompt lengths (prefill regressor)."""
        if self.sum_sq_tokens is not None:
            return float(self.sum_sq_tokens)
        return self.num_tokens * self.num_tokens / self.batch_size


class ParallelProfile(msgspec.Struct, frozen=True, kw_only=True):
    """DistServe's latency model for one ``(tp, pp)`` config; coefficients in milliseconds."""

    tp: PositiveInt
    pp: PositiveInt = 1
    prefill: Coeffs
    """[a, b, c]: a + b*sum(L) + c*sum(L^2), whole model (divided by pp per stage)."""
    decode_small: Coeffs
    """[a, b, c]: a + b*sum(ctx+1) + c*B for B < decode_bs_threshold."""
    decode_large: Coeffs
    """Same form for B >= decode_bs_threshold."""
    decode_bs_threshold: PositiveInt = 95
    max_num_tokens: PositiveInt | None = None
    """KV-cache capacity of one instance in tokens; None: unknown (treated as unbounded)."""
    pp_overhead_ms: NonNegFloat = 0.0
    """Added once per pipeline stage to a prefill (DistServe: 1 ms)."""
    iter_overhead_ms: NonNegFloat = 0.0
    """Added to every iteration (DistServe's Ray overhead: 2 ms)."""
    iter_overhead_per_token_ms: NonNegFloat = 0.0
    """Added per cached/prompt token to every iteration (DistServe: 1e-4 ms)."""

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    """A profile file: one model on one kind of hardware and engine, several parallelism configs."""

    version: int = PROFILE_VERSION
    model: str
    hardware: str = "unknown"
    engine: str = "vllm"
    """The serving engine measured ("vllm", "vllm-cpu", "distserve"...)."""
    kv_bytes_per_token: Annotated[int, msgspec.Meta(ge=0)] = 0
    """KV-cache bytes per token for the whole model (all layers); 0: unknown (no transfer cost)."""
    source: str = ""
    configs: tuple[ParallelProfile, ...] = ()

    def get(self, tp: int, pp: int = 1) -> ParallelProfile:
        """The config for ``(tp, pp)``; ConfigError naming the available ones if absent."""
        for cfg in self.configs:
            if cfg.tp == tp and cfg.pp == pp:
                return cfg
        have = ", ".join(f"tp{c.tp}pp{c.pp}" for c in self.configs) or "none"
        raise ConfigError(f"profile of {self.model!r} has no config tp={tp} pp={pp} (has: {have})")

    def parallel_configs(self) -> list[tuple[int, int]]:
        return sorted((c.tp, c.pp) for c in self.configs)


# ---------------------------------------------------------------------------------------------
# Files

def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(profile), indent=1) + b"\n")


def load_profile(
    path: str | Path, *, model: str | None = None, engine: str = "distserve"
) -> Profile:
    """Load our profile file, or a DistServe ``profiler-*.json`` (then ``model`` is required).

    A DistServe file is recognised by its layout (``{model: {tp: {"prefill": ...}}}``); its KV
    capacities come from ``max_num_tokens.csv`` in the same directory when present.
    """
    p = Path(path)
    try:
        raw = json.loads(p.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read profile {p}: {exc}") from exc
    if isinstance(raw, dict) and "version" in raw:
        if raw["version"] != PROFILE_VERSION:
            raise ConfigError(
                f"profile {p} has version {raw['version']}, this kvdisagg reads {PROFILE_VERSION}; "
                "refit it with `kvdisagg profile`")
        try:
            return msgspec.convert(raw, Profile)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"profile {p}: {exc}") from exc
    if model is None:
        models = ", ".join(raw) if isinstance(raw, dict) else "?"
        raise ConfigError(f"{p} is a DistServe profile; pass --model (one of: {models})")
    csv_path = p.with_name("max_num_tokens.csv")
    return load_distserve_profile(p, model, engine=engine,
                                  max_num_tokens_csv=csv_path if csv_path.exists() else None)


# DistServe constants (simdistserve/estimators/time_estimator.py @82831f1, transcribed).
DISTSERVE_PP_OVERHEAD_MS = 1.0
DISTSERVE_ITER_OVERHEAD_MS = 2.0
DISTSERVE_ITER_OVERHEAD_PER_TOKEN_MS = 1e-4
# KV bytes per token at fp16 = 2 (K,V) * layers * hidden * 2 bytes.
_OPT_KV_BYTES = {"facebook/opt-13b": 2 * 40 * 5120 * 2, "facebook/opt-66b": 2 * 64 * 9216 * 2,
                 "facebook/opt-175b": 2 * 96 * 12288 * 2}


def load_distserve_profile(
    coeff_json: str | Path, model: str, *, engine: str = "distserve",
    max_num_tokens_csv: str | Path | None = None, hardware: str = "A100-80GB",
) -> Profile:
    """Convert DistServe's shipped ``profiler-a100-80g.*.json`` (+ ``max_num_tokens.csv``).

    DistServe's coefficients are per TP; PP is applied by the formula (work / pp per stage), so a
    config is emitted for every ``(tp, pp)`` the CSV lists as runnable (only pp=1 without a CSV).
    """
    data = json.loads(Path(coeff_json).read_bytes())
    if model not in data:
        raise ConfigError(f"{coeff_json} has no model {model!r} (has: {', '.join(data)})")
    capacity: dict[tuple[int, int], int] = {}
    if max_num_tokens_csv is not None:
        with open(max_num_tokens_csv, newline="") as f:
            for row in csv.DictReader(f):
                if row["model"] == model:
                    capacity[(int(row["tp"]), int(row["pp"]))] = int(row["max_num_tokens"])
    configs = []
    for tp_s, entry in sorted(data[model].items(), key=lambda kv: int(kv[0])):
        tp = int(tp_s)
        pps = sorted(pp for (t, pp) in capacity if t == tp) if capacity else [1]
        for pp in pps:
            configs.append(ParallelProfile(
                tp=tp, pp=pp,
                prefill=_coeffs(entry["prefill"]),
                decode_small=_coeffs(entry["decoding_smallbs"]),
                decode_large=_coeffs(entry["decoding_largebs"]),
                decode_bs_threshold=int(entry.get("decoding_large_small_bs_threshold", 95)),
                max_num_tokens=capacity.get((tp, pp)),
                pp_overhead_ms=DISTSERVE_PP_OVERHEAD_MS,
                iter_overhead_ms=DISTSERVE_ITER_OVERHEAD_MS,
                iter_overhead_per_token_ms=DISTSERVE_ITER_OVERHEAD_PER_TOKEN_MS,
            ))
    return Profile(model=model, hardware=hardware, engine=engine,
                   kv_bytes_per_token=_OPT_KV_BYTES.get(model, 0),
                   source=f"DistServe {Path(coeff_json).name}", configs=tuple(configs))


def _coeffs(v: Sequence[float]) -> Coeffs:
    if len(v) != 3:
        raise ConfigError(f"expected 3 coefficients [a, b, c], got {list(v)}")
    return (float(v[0]), float(v[1]), float(v[2]))


# ---------------------------------------------------------------------------------------------
# Fitting

def fit_profile(
    samples: Sequence[LatencySample], *, model: str = "unknown", hardware: str = "unknown",
    engine: str = "vllm", kv_bytes_per_token: int = 0,
    max_num_tokens: int | Mapping[tuple[int, int], int] | None = None,
    decode_bs_threshold: int = 95, source: str = "kvdisagg profile",
) -> Profile:
    """Fit DistServe's latency model per ``(tp, pp)`` from measured batches.

    Each ``(tp, pp)`` needs at least 3 prefill and 3 decode samples. Decode samples with
    ``batch_size >= decode_bs_threshold`` get their own curve when there are at least 3 of them
    (otherwise the small-batch curve is used for all sizes). ``max_num_tokens`` is the KV capacity,
    one number for all configs or one per ``(tp, pp)``.
    """
    groups: dict[tuple[int, int], list[LatencySample]] = defaultdict(list)
    for s in samples:
        groups[(s.tp, s.pp)].append(s)
    if not groups:
        raise ConfigError("fit_profile: no samples")
    configs = []
    for (tp, pp), group in sorted(groups.items()):
        pre = [s for s in group if s.phase == "prefill"]
        dec = [s for s in group if s.phase == "decode"]
        if len(pre) < 3 or len(dec) < 3:
            raise ConfigError(
                f"fit_profile: tp={tp} pp={pp} has {len(pre)} prefill and {len(dec)} decode "
                "samples; "
                "need at least 3 of each (measure more batch sizes/lengths)"
            )
        prefill = _fit(
            [(1.0, s.num_tokens, s.squares()) for s in pre], [s.seconds * 1e3 for s in pre]
        )
        small = [s for s in dec if s.batch_size < decode_bs_threshold]
        large = [s for s in dec if s.batch_size >= decode_bs_threshold]
        if len(small) < 3:
            small = dec
        d_small = _fit(
            [(1.0, s.num_tokens, s.batch_size) for s in small], [s.seconds * 1e3 for s in small]
        )
        d_large = d_small
        if len(large) >= 3:
            d_large = _fit([(1.0, s.num_tokens, s.batch_size) for s in large],
                           [s.seconds * 1e3 for s in large])
        cap = (
            max_num_tokens.get((tp, pp)) if isinstance(max_num_tokens, Mapping) else max_num_tokens
        )
        configs.append(
            ParallelProfile(
                tp=tp,
                pp=pp,
                prefill=prefill,
                decode_small=d_small,
                decode_large=d_large,
                decode_bs_threshold=decode_bs_threshold,
                max_num_tokens=cap,
            )
        )
    return Profile(
        model=model,
        hardware=hardware,
        engine=engine,
        kv_bytes_per_token=kv_bytes_per_token,
        source=source,
        configs=tuple(configs),
    )


def _fit(rows: Sequence[tuple[float, float, float]], y_ms: Sequence[float]) -> Coeffs:
    """Least squares on relative error, with non-negative coefficients (tiny active set)."""
    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray(y_ms, dtype=np.float64)
    w = 1.0 / y
    active = [0, 1, 2]
    coef = np.zeros(3)
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        # Drop the most negative coefficient and refit: the latency model must not decrease.
        active.pop(int(np.argmin(sol)))
    if not all(math.isfinite(c) for c in coef):
        raise ConfigError(f"fit_profile: fit did not converge on {len(rows)} samples")
    return (float(coef[0]), float(coef[1]), float(coef[2]))
