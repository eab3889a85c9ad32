"""DisaggConnector: the class vLLM instantiates; it only forwards to the side for its role."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvdisagg.connector.config import ConnectorConfig, parse_config
from kvdisagg.connector.metadata import DisaggMetadata, DisaggWorkerMeta

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _prefix_lookup(vllm_config: VllmConfig, config: ConnectorConfig) -> Any:
    """A store transport on a producer: look prompts up before computing them."""
    kv = vllm_config.kv_transfer_config
    if config.transport != "lmcache" or kv is None or not kv.is_kv_producer:
        return None
    from kvdisagg.transport.lmcache import PrefixLookup

    return PrefixLookup(config, vllm_config.cache_config.block_size)


class DisaggConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        assert vllm_config.kv_transfer_config is not None
        config = parse_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        if role == KVConnectorRole.SCHEDULER:
            from kvdisagg.connector.scheduler import DisaggScheduler

            self._scheduler: DisaggScheduler | None = DisaggScheduler(
                vllm_config, config, prefix_lookup=_prefix_lookup(vllm_config, config))
            self._worker: DisaggWorker | None = None
        else:
            from kvdisagg.connector.worker import DisaggWorker

            self._scheduler = None
            self._worker = DisaggWorker(vllm_config, config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBHNC"  # one contiguous range per (layer, block)

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        self._scheduler.update_connector_output(
            set(connector_output.finished_recving or ()),
            set(connector_output.failed_recving or ()),
            meta if isinstance(meta, DisaggWorkerMeta) else None)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> DisaggMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(
            idle=scheduler_output.total_num_scheduled_tokens == 0)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        assert self._scheduler is not None
        self._scheduler.set_handshake(metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): m for tp, m in metadata.items()})

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> Any:
        return self._worker.handshake() if self._worker else None

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Called first in every step, before this step can overwrite freed blocks: stage the
        handoffs whose paged blocks vLLM just freed."""
        assert self._worker is not None and isinstance(kv_connector_metadata, DisaggMetadata)
        self._worker.offer(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # Async loads arrive with attn_metadata None: unlike ExampleConnector, never skip them.
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, DisaggMetadata)
        self._worker.start_load_kv(meta)

    def build_connector_worker_meta(self) -> DisaggWorkerMeta | None:
        return self._worker.take_worker_meta() if self._worker else None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous and complete before the request is scheduled."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Pull mode: the KV stays in prefill's blocks until decode reads it."""

    def wait_for_save(self) -> None:
        """Nothing to flush in pull mode."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_kv_connector_stats(self) -> Any:
        if self._scheduler is not None:
            return self._scheduler.take_stats()
        return self._worker.take_stats() if self._worker else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        from kvdisagg.connector.stats import DisaggStats

        return DisaggStats(data=data) if data is not None else DisaggStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from kvdisagg.connector.stats import DisaggPromMetrics

        return DisaggPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker:
            self._worker.shutdown()
        if self._scheduler:
            self._scheduler.shutdown()
