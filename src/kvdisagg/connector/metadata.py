"""Plain data the scheduler side hands to the worker side each step (pickled by vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvdisagg.connector.layout import KvGeometry
from kvdisagg.connector.protocol.versions import PROTOCOL_VERSION
from kvdisagg.connector.sharding import Part, Shape


@dataclass(frozen=True)
class SendSpec:
    """Prefill: serve these blocks of request ``req_id`` to a holder of ``token``. With
    ``stage_from``, first copy those paged blocks into arena blocks ``block_ids`` (before
    this step's forward: vLLM has freed the paged ones)."""

    req_id: str
    token: str
    block_ids: tuple[int, ...]
    lease_s: float
    prompt_token_ids: tuple[int, ...] = ()  # only for store transports (lmcache)
    stage_from: tuple[int, ...] = ()
    trace: str = ""  # traceparent of the request's prefill leg (tracing.py)
    handoff_id: str = ""  # an early handoff's id, named by the proxy ('': ``req_id``)


@dataclass(frozen=True)
class LoadSpec:
    """Decode: pull ``remote_block_ids`` into ``local_block_ids``; a non-empty ``error`` means
    the handoff was unusable, and the worker reports the load failed at once.

    ``ports``: one per prefill rank (PP-major). ``parts``: what each decode rank (index: its
    rank, PP-major) reads from which prefill rank (sharding.py); empty: rank r reads all of
    prefill rank r (store lookups of one's own instance)."""

    req_id: str
    host: str = ""
    ports: tuple[int, ...] = ()
    prefill: Shape | None = None
    parts: tuple[tuple[Part, ...], ...] = ()
    handoff_id: str = ""
    token: str = ""
    transport: str = ""
    kv_layout: str = ""
    early: bool = False  # read by position before prefill offered it (transport.Fetch)
    remote_block_ids: tuple[int, ...] = ()
    local_block_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()  # only for store transports (lmcache)
    first_block: int = 0  # index in the prompt of the first local block
    release_only: bool = False
    error: str = ""
    trace: str = ""  # traceparent of the scheduler's kvdisagg.load span (tracing.py)
    version: int = PROTOCOL_VERSION  # the side-channel version to speak (transport.Fetch)


@dataclass
class DisaggMetadata(KVConnectorMetadata):
    sends: list[SendSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    expects: list[tuple[str, str]] = field(default_factory=list)
    """Prefill: early handoffs (id, token) whose requests reached the engine."""
    forgets: list[tuple[str, str]] = field(default_factory=list)
    """Prefill: expected early handoffs (id, why) that will not be offered."""


@dataclass(frozen=True)
class WorkerHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler once at start-up: where its side channel listens, its layout."""

    port: int
    kv_layout: str
    transport: str
    geometry: KvGeometry | None = None
    stages: tuple[int, ...] = (0,)  # first layer of each PP stage of this instance
    keyed_by_tokens: bool = False  # the transport needs prompt token ids (store transports)
    num_blocks: int = 0  # paged blocks; arena blocks are numbered from here
    stage_blocks: int = 0  # arena blocks (0: handoffs keep their paged blocks until pulled)


@dataclass
class DisaggWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler each step: staged handoffs freed (pulled, released or expired), with
    how many workers freed each; the arena blocks are reusable once every rank (TP x PP) has."""

    released: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, DisaggWorkerMeta)
        for req_id, n in other.released.items():
            self.released[req_id] = self.released.get(req_id, 0) + n
        return self
