"""Worker side of DisaggConnector (runs in each vLLM worker process).

Prefill: registers the KV memory with a side-channel server and serves granted pulls.
Decode: runs each planned pull on a thread pool straight into the request's blocks, and reports
every load exactly once, done or failed, so vLLM's kv_load_failure_policy decides.

Must not import connector/scheduler.py.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvdisagg.config import ConnectorConfig
from kvdisagg.connector.layout import LayerRegion, layer_regions, layout_fingerprint
from kvdisagg.connector.metadata import DisaggMetadata, LoadSpec, WorkerHandshake
from kvdisagg.connector.stats import DisaggStats
from kvdisagg.connector.side_channel import HandoffTable, SideChannelServer, pull
from kvdisagg.errors import KvDisaggError
from kvdisagg.transport import load_transport

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


class DisaggWorker:
    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        kv = vllm_config.kv_transfer_config
        assert kv is not None
        self.vllm_config, self.config = vllm_config, config
        self.is_producer = kv.is_kv_producer
        self.tp_rank = get_tensor_model_parallel_rank()
        self.transport = load_transport(config.transport)
        self.table = HandoffTable()
        self.regions: list[LayerRegion] = []
        self.kv_layout = ""
        self.server: SideChannelServer | None = None
        self.stats = DisaggStats()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvdisagg-pull")
        self._inflight: dict[str, Future[int]] = {}
        self._released_unseen: set[str] = set()  # freed on our side, not yet finished in vLLM
        self._finished_seen: set[str] = set()
        self._lock = threading.Lock()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        model = self.vllm_config.model_config
        self.regions = layer_regions(kv_caches)
        self.kv_layout = layout_fingerprint(
            model=model.model, dtype=str(model.dtype),
            block_size=self.vllm_config.cache_config.block_size,
            tp_size=self.vllm_config.parallel_config.tensor_parallel_size, kv_caches=kv_caches)
        if self.is_producer:
            port = self.config.side_channel_port
            self.server = SideChannelServer(
                self.config.side_channel_host, port + self.tp_rank if port else 0,
                kv_layout=self.kv_layout, regions=self.regions, transport=self.transport,
                table=self.table, timeout_s=self.config.transfer_timeout_seconds)
            logger.info("kvdisagg: side channel of TP rank %d on %s:%d (layout %s)",
                        self.tp_rank, self.config.side_channel_host, self.server.port,
                        self.kv_layout)

    def handshake(self) -> WorkerHandshake:
        return WorkerHandshake(port=self.server.port if self.server else 0,
                               kv_layout=self.kv_layout, transport=self.transport.name)

    def start_load_kv(self, meta: DisaggMetadata) -> None:
        for send in meta.sends:
            self.table.add(send.req_id, send.token, send.block_ids, send.lease_s)
        for load in meta.loads:
            future = self._pool.submit(self._pull, load)
            if not load.release_only:
                self._inflight[load.req_id] = future

    def _pull(self, load: LoadSpec) -> int:
        if load.error:
            raise KvDisaggError(load.error)
        if load.transport != self.transport.name:
            raise KvDisaggError(f"prefill uses transport {load.transport!r}, this decode "
                                f"instance {self.transport.name!r}")
        start = time.perf_counter()
        try:
            nbytes = pull(host=load.host, port=load.ports[self.tp_rank],
                          handoff_id=load.handoff_id, token=load.token,
                          kv_layout=load.kv_layout, remote_block_ids=load.remote_block_ids,
                          local_regions=self.regions, local_block_ids=load.local_block_ids,
                          transport=self.transport,
                          timeout_s=self.config.transfer_timeout_seconds)
        except Exception:
            with self._lock:
                self.stats.add(pull_failures=1)
            raise
        elapsed = time.perf_counter() - start
        with self._lock:
            self.stats.add(pulls=1, pulled_bytes=nbytes, pull_seconds=elapsed,
                           pulled_blocks=len(load.local_block_ids))
        logger.info("kvdisagg: pulled %d blocks (%d bytes) for %s in %.1f ms",
                    len(load.local_block_ids), nbytes, load.req_id, elapsed * 1e3)
        return nbytes

    def take_stats(self) -> DisaggStats | None:
        with self._lock:
            if self.stats.is_empty():
                return None
            out, self.stats = self.stats, DisaggStats()
            return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving). Never blocks."""
        self._finished_seen |= finished_req_ids
        self._released_unseen |= self.table.take_finished()
        # vLLM only accepts a finished send once it has itself finished the request.
        sending = self._released_unseen & self._finished_seen
        self._released_unseen -= sending
        self._finished_seen -= sending
        recving, failed = set(), set()
        for req_id, future in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[req_id]
            recving.add(req_id)
            if (exc := future.exception()) is not None:
                failed.add(req_id)
                logger.error("kvdisagg: KV load of %s failed: %s", req_id, exc)
        return sending, recving, failed

    def shutdown(self) -> None:
        if self.server:
            self.server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
