"""Transfer counters: the worker reports them each step; vLLM logs them and exports them
as Prometheus counters ``vllm:kvdisagg_*`` on the instance's own /metrics."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvdisagg.scheduler import PROM_COUNTERS

FIELDS = {
    "pulls": "KV pulls completed by this decode instance",
    "pull_failures": "KV pulls that failed (reported to vLLM's kv_load_failure_policy)",
    "pulled_bytes": "KV bytes pulled from prefill instances",
    "pull_seconds": "Wall time spent in KV pulls, summed over pulls",
    "pulled_blocks": "KV blocks pulled from prefill instances",
    "handoffs_offered": "Handoffs this prefill instance offered to decode instances",
    "handoffs_staged": "Handoffs copied into the staging arena (paged blocks freed at once)",
    "handoffs_freed": "Handoffs freed: pulled, released by their decode, or expired",
    "handoffs_expired": "Handoffs freed unread because no decode renewed their lease",
    "lease_renewals": "Handoff leases this decode instance renewed on prefill instances",
    **PROM_COUNTERS,  # SloScheduler's, when it runs (--scheduler-cls)
}


class DisaggStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {k: 0 for k in FIELDS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in FIELDS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in FIELDS)

    def add(self, **values: float) -> None:
        for k, v in values.items():
            self.data[k] = self.data.get(k, 0) + v


class DisaggPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            k: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvdisagg_{k}", documentation=doc,
                                  labelnames=labelnames), per_engine_labelvalues)
            for k, doc in FIELDS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.items():
            if k in self.counters and v:
                self.counters[k][engine_idx].inc(v)
