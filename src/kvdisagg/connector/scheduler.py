"""Scheduler side of DisaggConnector (runs in vLLM's EngineCore process).

Prefill (producer): ``request_finished`` of a ``do_remote_decode`` request keeps its blocks under
a lease and returns the handoff's kv_transfer_params. Decode (consumer): a ``do_remote_prefill``
request claims its whole prompt as loadable asynchronously and the worker pulls it.

Must not import torch or kvdisagg.transport: all byte movement is the worker's.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

import msgspec

from kvdisagg.config import ConnectorConfig
from kvdisagg.connector.metadata import DisaggMetadata, LoadSpec, SendSpec, WorkerHandshake
from kvdisagg.protocol import RemotePrefill, handoff_params

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class DisaggScheduler:
    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig) -> None:
        kv = vllm_config.kv_transfer_config
        assert kv is not None
        self.config = config
        self.engine_id: str = kv.engine_id or ""
        self.is_producer, self.is_consumer = kv.is_kv_producer, kv.is_kv_consumer
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.ports: list[int] = []
        self.transport_name = ""  # the wire name the workers' transport reports
        self.kv_layout = ""
        self.keyed_by_tokens = False
        self._pulled: set[str] = set()  # decode requests whose load was already planned
        self._sends: list[SendSpec] = []
        self._loads: list[LoadSpec] = []

    def set_handshake(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Learn each TP rank's side-channel port and the layout fingerprint (once, at start)."""
        ranks = sorted((tp, m) for (pp, tp), m in metadata.items()
                       if pp == 0 and isinstance(m, WorkerHandshake))
        self.ports = [m.port for _, m in ranks]
        self.kv_layout = ranks[0][1].kv_layout if ranks else ""
        self.transport_name = ranks[0][1].transport if ranks else ""
        self.keyed_by_tokens = bool(ranks and ranks[0][1].keyed_by_tokens)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Side-effect free. The whole rest of the prompt is loadable; vLLM recomputes the last
        token itself (it sets computed = prompt - 1 after the load)."""
        params = request.kv_transfer_params
        if (not self.is_consumer or not params or not params.get("do_remote_prefill")
                or request.request_id in self._pulled):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if (not self.is_consumer or not params or not params.get("do_remote_prefill")
                or request.request_id in self._pulled):
            return
        self._pulled.add(request.request_id)  # never pull twice (recompute, preemption)
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        load = self._plan_load(request.request_id, params, local)
        if self.keyed_by_tokens and not load.error:
            load = dataclasses.replace(load, prompt_token_ids=tuple(request.prompt_token_ids))
        self._loads.append(load)

    def _plan_load(self, req_id: str, raw: dict[str, Any], local: list[int]) -> LoadSpec:
        try:
            p = msgspec.convert(raw, RemotePrefill)
        except msgspec.ValidationError as exc:
            return LoadSpec(req_id=req_id, error=f"invalid kv_transfer_params: {exc}")
        if len(p.kvdisagg.ports) != self.tp_size:
            return LoadSpec(req_id=req_id, error=f"prefill TP {len(p.kvdisagg.ports)} != "
                            f"decode TP {self.tp_size}")
        if len(p.remote_block_ids) < len(local):
            return LoadSpec(req_id=req_id, error=f"prefill offers {len(p.remote_block_ids)} "
                            f"blocks, decode needs {len(local)}")
        # Local prefix-cache hits are the leading blocks: pull only the tail.
        remote = p.remote_block_ids[len(p.remote_block_ids) - len(local):]
        return LoadSpec(req_id=req_id, host=p.remote_host, ports=tuple(p.kvdisagg.ports),
                        handoff_id=p.remote_request_id, token=p.kvdisagg.token,
                        transport=p.kvdisagg.transport,
                        kv_layout=p.kvdisagg.kv_layout, remote_block_ids=tuple(remote),
                        local_block_ids=tuple(local),
                        first_block=len(p.remote_block_ids) - len(local), release_only=not local)

    def build_connector_meta(self) -> DisaggMetadata:
        meta = DisaggMetadata(sends=self._sends, loads=self._loads)
        self._sends, self._loads = [], []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        self._pulled.discard(request.request_id)
        params = request.kv_transfer_params
        if (not self.is_producer or not params or not params.get("do_remote_decode")
                or not block_ids or request.status not in
                (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)):
            return False, None
        token = secrets.token_urlsafe(16)
        tokens = tuple(request.prompt_token_ids) if self.keyed_by_tokens else ()
        self._sends.append(SendSpec(request.request_id, token, tuple(block_ids),
                                    self.config.lease_seconds, tokens))
        return True, handoff_params(
            engine_id=self.engine_id, request_id=request.request_id, block_ids=block_ids,
            host=self.config.side_channel_host, ports=self.ports,
            num_tokens=request.num_computed_tokens, transport=self.transport_name,
            kv_layout=self.kv_layout, token=token,
            lease_expires=time.time() + self.config.lease_seconds)
