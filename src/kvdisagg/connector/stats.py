"""Transfer counters and phase timings: the workers (and the scheduler) report them each step;
vLLM logs them and exports them on the instance's own /metrics, as Prometheus counters
``vllm:kvdisagg_*`` (``vllm:kvdisagg_recomputed_prompts_total`` with a ``reason`` label), the
gauge ``vllm:kvdisagg_retiring`` and the histogram ``vllm:kvdisagg_phase_seconds{phase=...}``.

Two gauges are set once, when vLLM's API server builds its metrics (no engine step needed, so
the proxy's first probe of a new process reads them): ``vllm:kvdisagg_protocol_version`` and
``vllm:kvdisagg_protocol_version_min``, the side-channel protocol versions the instance speaks
(protocol.Versions), which the proxy reads to pair only instances with a version in common."""

from __future__ import annotations

from typing import Any, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvdisagg.connector.config import parse_config
from kvdisagg.connector.protocol.versions import Versions, spoken


class SloStats(NamedTuple):
    """SloScheduler's counters since start (monotonic)."""

    deadline_misses: int
    """Requests first admitted after their TTFT deadline."""
    reordered: int
    """Steps in which deadline ordering changed the waiting queue's order."""
    batch_cap_in_force: int
    """Steps that ended with the batch at the TPOT cap while requests were waiting."""
    backpressure_steps: int
    """Steps in which new prompts waited because held KV was above ``held_kv_share``."""


PROM_COUNTERS = {f"sched_{name}": doc for name, doc in zip(SloStats._fields, (
    "Requests SloScheduler first admitted after their TTFT deadline",
    "Steps in which SloScheduler's deadline order changed the waiting queue",
    "Steps that ended at SloScheduler's TPOT batch cap while requests waited",
    "Steps in which new prompts waited because KV held for handoffs exceeded held_kv_share",
), strict=True)}
"""SloStats as ``kv_connector_stats`` keys (``sched_`` + field, in field order): DisaggConnector's
metrics export them as ``vllm:kvdisagg_sched_*`` counters on the instance's /metrics."""


FIELDS = {
    "pulls": "KV pulls completed by this decode instance",
    "pull_failures": "KV pulls that failed (reported to vLLM's kv_load_failure_policy)",
    "checksum_failures": "KV loads whose bytes failed their checksum (also pull failures): "
                         "corrupted in flight or at rest, never used",
    "pulled_bytes": "KV bytes pulled from prefill instances",
    "pull_seconds": "Wall time spent in KV pulls, summed over pulls",
    "pulled_blocks": "KV blocks pulled from prefill instances",
    "handoffs_offered": "Handoffs this prefill instance offered to decode instances",
    "handoffs_staged": "Handoffs copied into the staging arena (paged blocks freed at once)",
    "handoffs_freed": "Handoffs freed: pulled, released by their decode, or expired",
    "handoffs_expired": "Handoffs freed unread because no decode renewed their lease",
    "lease_renewals": "Handoff leases this decode instance renewed on prefill instances",
    "decoded_stored": "Finished requests whose KV (prompt and answer) this decode instance "
                      "stored for the next turn (transport lmcache)",
    **PROM_COUNTERS,  # SloScheduler's, when it runs (--scheduler-cls)
}

GAUGES = {  # set when reported (the last value stands); aggregated as the maximum
    "retiring": "1 once this instance is retiring (SIGTERM): it takes no new requests and "
                "exits when the handoffs it holds and its running requests are done",
}

VERSION_GAUGES = {  # set once at start (versions_of); the proxy pairs instances by them
    "protocol_version": "The newest side-channel protocol version this instance speaks "
                        "(prefill: serves; decode: pulls with)",
    "protocol_version_min": "The oldest side-channel protocol version this instance speaks: "
                            "it pairs with any instance whose range overlaps its own",
}


def versions_of(vllm_config: Any) -> Versions:
    """The protocol versions the instance of ``vllm_config`` speaks (its connector config's
    ``protocol_version_override``, a test setting, narrows them to one)."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(kv, "kv_connector_extra_config", None) if kv is not None else None
    return spoken(parse_config(extra).protocol_version_override)


PHASES = {  # the handoff timeline on an instance (docs/operations.md, "Handoff timeline")
    "queue": "decode: a planned pull waiting for a pull thread",
    "connect": "decode: opening a side-channel connection and its Hello (0 when reused)",
    "read": "decode: Read sent until prefill granted it",
    "transfer": "decode: the KV bytes moving, then their checksum verified",
    "done": "decode: Done sent (prefill may free the KV)",
    "load": "decode scheduler: a load planned until the engine saw it finished",
    "stage": "prefill: copying a finished handoff into the staging arena",
    "serve": "prefill: a Read received until decode's Done",
}
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_PHASE_KEY = "phase_seconds"  # data[_PHASE_KEY][phase]: the step's observations

RECOMPUTED = {  # reasons of vllm:kvdisagg_recomputed_prompts_total (docs/operations.md)
    "load_failed": "its KV load failed (peer gone, timeout, checksum) and "
                   "kv_load_failure_policy is recompute",
    "invalid_params": "its kv_transfer_params could not be used (malformed, another TP size, "
                      "fewer blocks than the prompt) and kv_load_failure_policy is recompute",
    "not_read": "vLLM read no cached KV for it (prompt logprobs need every prompt token "
                "computed)",
}
_RECOMPUTED_KEY = "recomputed_prompts"  # data[_RECOMPUTED_KEY][reason]: a count


class DisaggStats(KVConnectorStats):
    data: dict[str, Any]  # FIELDS' counts, and the phase/recomputed dicts

    def reset(self) -> None:
        self.data = {k: 0 for k in FIELDS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in FIELDS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        for k in GAUGES:
            if k in other.data:
                self.data[k] = max(self.data.get(k, 0), other.data[k])
        for reason, n in other.data.get(_RECOMPUTED_KEY, {}).items():
            counts = self.data.setdefault(_RECOMPUTED_KEY, {})
            counts[reason] = counts.get(reason, 0) + n
        for phase, values in other.data.get(_PHASE_KEY, {}).items():
            self.data.setdefault(_PHASE_KEY, {}).setdefault(phase, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Counters as they are, phases as their mean in ms (vLLM's periodic log line)."""
        out = {k: v for k, v in self.data.items() if k not in (_PHASE_KEY, _RECOMPUTED_KEY)}
        for reason, n in self.data.get(_RECOMPUTED_KEY, {}).items():
            out[f"recomputed_{reason}"] = n
        for phase, values in self.data.get(_PHASE_KEY, {}).items():
            if values:
                out[f"{phase}_ms_mean"] = round(1e3 * sum(values) / len(values), 3)
        return out

    def is_empty(self) -> bool:
        return not (any(self.data.get(k) for k in FIELDS) or self.data.get(_PHASE_KEY)
                    or any(k in self.data for k in GAUGES)
                    or any(self.data.get(_RECOMPUTED_KEY, {}).values()))

    def add(self, **values: float) -> None:
        for k, v in values.items():
            self.data[k] = self.data.get(k, 0) + v

    def recomputed(self, reason: str) -> None:
        """A request that arrived with a handoff computed its prompt itself (RECOMPUTED)."""
        counts = self.data.setdefault(_RECOMPUTED_KEY, {})
        counts[reason] = counts.get(reason, 0) + 1

    def observe(self, **seconds: float) -> None:
        """One observation per named phase (PHASES)."""
        phases = self.data.setdefault(_PHASE_KEY, {})
        for phase, v in seconds.items():
            phases.setdefault(phase, []).append(v)


class DisaggPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            k: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvdisagg_{k}", documentation=doc,
                                  labelnames=labelnames), per_engine_labelvalues)
            for k, doc in FIELDS.items()}
        self.gauges = {
            k: create_metric_per_engine(
                self._gauge_cls(name=f"vllm:kvdisagg_{k}", documentation=doc,
                                labelnames=labelnames, multiprocess_mode="mostrecent"),
                per_engine_labelvalues)
            for k, doc in GAUGES.items()}
        versions = versions_of(vllm_config)
        for k, doc in VERSION_GAUGES.items():
            gauge = self._gauge_cls(name=f"vllm:kvdisagg_{k}", documentation=doc,
                                    labelnames=labelnames, multiprocess_mode="mostrecent")
            for engine in create_metric_per_engine(gauge, per_engine_labelvalues).values():
                engine.set(versions.lo if k.endswith("_min") else versions.hi)
        histogram = self._histogram_cls(
            name="vllm:kvdisagg_phase_seconds", labelnames=[*labelnames, "phase"],
            documentation="Handoff timeline phases on this instance (phase label: "
            + "; ".join(f"{k}: {v}" for k, v in PHASES.items()) + ")", buckets=PHASE_BUCKETS)
        self.phases = {idx: {p: histogram.labels(*values, p) for p in PHASES}
                       for idx, values in per_engine_labelvalues.items()}
        recomputed = self._counter_cls(
            name="vllm:kvdisagg_recomputed_prompts", labelnames=[*labelnames, "reason"],
            documentation="Requests that arrived with a handoff (do_remote_prefill) but whose "
            "prompt this decode instance computed itself (reason label: "
            + "; ".join(f"{k}: {v}" for k, v in RECOMPUTED.items()) + ")")
        self.recomputed = {idx: {r: recomputed.labels(*values, r) for r in RECOMPUTED}
                           for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.items():
            if k in self.counters and v:
                self.counters[k][engine_idx].inc(v)
            elif k in self.gauges:
                self.gauges[k][engine_idx].set(v)
        for phase, values in transfer_stats_data.get(_PHASE_KEY, {}).items():
            if (hist := self.phases.get(engine_idx, {}).get(phase)) is not None:
                for v in values:
                    hist.observe(v)
        for reason, n in transfer_stats_data.get(_RECOMPUTED_KEY, {}).items():
            if n and (counter := self.recomputed.get(engine_idx, {}).get(reason)) is not None:
                counter.inc(n)
