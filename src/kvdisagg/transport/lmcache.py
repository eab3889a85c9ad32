"""``lmcache``: KV goes through an LMCache server, in chunks keyed by a hash of the token prefix.

Prefill stores a finished request's KV as chunks of ``lmcache_chunk_tokens`` tokens (a chunk is
its blocks' pages, layer-major) and frees the blocks as soon as they are stored; decode fetches
the chunks that cover the blocks it needs. A chunk's key hashes the layout and every token up to
its end, so any later request with the same prefix (the next turn of a chat, a shared document)
finds it: the prefill side looks its prompt up before computing (``PrefixLookup``) and loads the
stored chunks instead of recomputing them.

The wire is LMCache's own protocol (``lmcache.v1.protocol``: ClientMetaMessage, ServerMetaMessage,
CacheEngineKey), spoken over our own socket with a deadline on every call: LMCache's client
(``LMCServerConnector``) has no timeouts and needs its local CPU backend and allocator, which a
connector that already owns vLLM's KV memory does not want. Keys and bytes are what LMCache's
server stores; nothing here is a copy of its protocol.

Chunks are per prefill rank (its layers, its heads), keyed by the prefill instance's shape
(TP, PP stages) and the rank: a decode rank of another shape fetches the chunks of the prefill
ranks its Parts name (connector/sharding.py) and keeps the layers and heads it holds.

A stored chunk is its pages followed by a trailer (connector/integrity.py): the ``xxh3_64``
digest of the pages as prefill stored them (or a marker saying it has none, with ``kv_checksum``
off), and decode checks it after the GET, before the load is reported done; the key names this
format (``CHUNK_FORMAT``), so chunks of another one are never read as pages.

The server trusts its clients (any client can read any key) and its CPU backend never evicts:
run it on the serving network only, sized for the working set (docs/operations.md).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import (
    ClientCommand,
    ClientMetaMessage,
    ServerMetaMessage,
    ServerReturnCode,
)

from kvdisagg.connector.config import LMCACHE_URL, ConnectorConfig
from kvdisagg.connector.integrity import TRAILER_BYTES, digest_views, pack_trailer, unpack_trailer
from kvdisagg.connector.layout import (
    KvGeometry,
    LayerRegion,
    check_blocks,
    copy_runs,
    span_tensor,
    spans,
    whole_slices,
)
from kvdisagg.connector.protocol.sockets import recv_into_exact, recv_into_views, send_views
from kvdisagg.connector.sharding import Shape
from kvdisagg.errors import (
    ChecksumMismatch,
    ConfigError,
    PeerUnreachable,
    TransferFailed,
    TransferTimeout,
    TransportError,
)
from kvdisagg.tracing import Tracer
from kvdisagg.transport.base import Fetch, Offer, PullTiming
from kvdisagg.transport.pull import Deadline
from kvdisagg.transport.tcp import host_bytes

logger = logging.getLogger(__name__)

POLL_S = 0.01  # decode polls for chunks prefill has not stored yet
CHUNK_FORMAT = 2  # 2: pages, then a checksum trailer (1: pages alone)


@dataclass(frozen=True)
class Chunk:
    """Chunk ``index`` of a prompt: its key, and its blocks (indices in the prompt)."""

    index: int
    key: CacheEngineKey
    first_block: int
    num_blocks: int


def chunk_plan(prompt: Sequence[int], *, kv_layout: str, block_size: int, chunk_tokens: int,
               rank: int, shape: Shape = Shape(1)) -> list[Chunk]:
    """The chunks of ``prompt`` stored by rank ``rank`` of an instance of shape ``shape``: full
    ones, then a partial last one. Key i hashes the layout and tokens [0, end of chunk i), so
    equal prefixes give equal keys on every host; the shape is in the key's model name, so
    LMCache's ``world_size`` field is left at 1."""
    blocks_per_chunk = chunk_tokens // block_size
    digest = hashlib.blake2b(kv_layout.encode(), digest_size=16)
    chunks = []
    for index, start in enumerate(range(0, len(prompt), chunk_tokens)):
        tokens = prompt[start:start + chunk_tokens]
        digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
        step = digest.copy()
        step.update(struct.pack("<q", len(tokens)))  # a partial chunk never equals a full one
        key = CacheEngineKey(model_name=f"kvdisagg{CHUNK_FORMAT}-{kv_layout}-{shape.key()}",
                             world_size=1,
                             worker_id=rank, chunk_hash=int.from_bytes(step.digest(), "big"),
                             dtype=torch.uint8)
        chunks.append(Chunk(index, key, index * blocks_per_chunk,
                            -(-len(tokens) // block_size)))
    return chunks


def failure_key(handoff_id: str, *, kv_layout: str, rank: int,
                shape: Shape = Shape(1)) -> CacheEngineKey:
    """Where rank ``rank`` of prefill marks a handoff it could not store: decode, waiting for
    the handoff's chunks, finds the mark and fails the load at once instead of polling to its
    deadline for chunks that will never come."""
    digest = hashlib.blake2b(f"failed:{handoff_id}".encode(), digest_size=16).digest()
    return CacheEngineKey(model_name=f"kvdisagg{CHUNK_FORMAT}-failed-{kv_layout}-{shape.key()}",
                          world_size=1, worker_id=rank,
                          chunk_hash=int.from_bytes(digest, "big"), dtype=torch.uint8)


FAILURE_CHECK_S = 0.1  # how often a decode waiting for a chunk looks for prefill's failure mark
FAILURE_MARK_S = 2.0  # bound on writing the mark (the server may be what failed)


class LMCacheClient:
    """One connection to an LMCache server; every call bounded by the deadline it is given."""

    def __init__(self, url: str) -> None:
        match = LMCACHE_URL.fullmatch(url)
        if match is None:
            raise ConfigError(f"lmcache_url={url!r}: expected 'lm://host:port'")
        self.url = url
        self.address = (match["host"].strip("[]"), int(match["port"]))
        self._sock: socket.socket | None = None

    def _connect(self, deadline: Deadline) -> socket.socket:
        if self._sock is None:
            try:
                self._sock = socket.create_connection(self.address, timeout=deadline.left())
            except TransferTimeout:
                raise
            except OSError as exc:
                raise PeerUnreachable(f"LMCache server {self.url} unreachable: {exc}") from None
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(deadline.left())
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _call(self, deadline: Deadline, fn: Any) -> Any:
        """Run ``fn(sock)``; a broken or timed-out connection is closed (never reused
        half-read) and becomes a typed error."""
        try:
            return fn(self._connect(deadline))
        except TransportError:
            self.close()
            raise
        except TimeoutError:
            self.close()
            raise TransferTimeout(f"{deadline.what}: LMCache server {self.url} did not answer "
                                  f"within {deadline.seconds:.1f}s") from None
        except OSError as exc:
            self.close()
            raise TransferFailed(f"{deadline.what}: LMCache server {self.url}: {exc}") from None

    @staticmethod
    def _header(command: ClientCommand, key: CacheEngineKey, length: int = 0) -> bytes:
        return ClientMetaMessage(command, key, length, MemoryFormat.BINARY, torch.uint8,
                                 torch.Size([length, 0, 0, 0])).serialize()

    @staticmethod
    def _reply(sock: socket.socket) -> ServerMetaMessage:
        raw = bytearray(ServerMetaMessage.packlength())
        recv_into_exact(sock, memoryview(raw))
        try:
            return ServerMetaMessage.deserialize(bytes(raw))
        except ValueError as exc:  # an unknown return code or format: not an LMCache server
            raise TransferFailed(f"LMCache server sent a malformed reply: {exc}") from None

    def exists(self, key: CacheEngineKey, deadline: Deadline) -> bool:
        def call(sock: socket.socket) -> bool:
            sock.sendall(self._header(ClientCommand.EXIST, key))
            return self._reply(sock).code == ServerReturnCode.SUCCESS
        return self._call(deadline, call)

    def put(self, key: CacheEngineKey, parts: Sequence[memoryview], deadline: Deadline) -> None:
        """Store the concatenation of ``parts`` (no reply in LMCache's protocol)."""
        def call(sock: socket.socket) -> None:
            header = self._header(ClientCommand.PUT, key, sum(p.nbytes for p in parts))
            send_views(sock, [memoryview(header), *parts], deadline.left)
        self._call(deadline, call)

    def get_into(self, key: CacheEngineKey, parts: Sequence[memoryview],
                 deadline: Deadline) -> bool:
        """Scatter the value of ``key`` into ``parts`` (exactly its size); False if absent."""
        def call(sock: socket.socket) -> bool:
            sock.sendall(self._header(ClientCommand.GET, key))
            reply = self._reply(sock)
            if reply.code != ServerReturnCode.SUCCESS:
                return False
            expected = sum(p.nbytes for p in parts)
            if reply.length != expected:
                self.close()  # the value is still on the wire: drop the connection
                raise TransferFailed(f"LMCache chunk {key.to_string()} holds {reply.length} "
                                     f"bytes, expected {expected} (another layout?)")
            recv_into_views(sock, list(parts), deadline.left)
            return True
        return self._call(deadline, call)


class PrefixLookup:
    """Scheduler side of a prefill instance: how many leading tokens of a prompt are already
    stored (whole chunks, on every TP rank), so vLLM loads them instead of computing them."""

    def __init__(self, config: ConnectorConfig, block_size: int) -> None:
        self.config, self.block_size = config, block_size
        self._client = LMCacheClient(config.lmcache_url)
        self._lock = threading.Lock()

    def __call__(self, prompt: Sequence[int], kv_layout: str, shape: Shape) -> int:
        """Leading tokens of ``prompt`` stored by every rank of this instance (of ``shape``)."""
        chunk_tokens = self.config.lmcache_chunk_tokens
        plans = [chunk_plan(prompt, kv_layout=kv_layout, block_size=self.block_size,
                            chunk_tokens=chunk_tokens, rank=rank, shape=shape)
                 for rank in range(shape.world)]
        deadline = Deadline(min(self.config.transfer_timeout_seconds, 2.0), "LMCache lookup")
        tokens = 0
        try:
            with self._lock:
                for chunks in zip(*plans):
                    full = chunks[0].num_blocks * self.block_size == chunk_tokens
                    if not full or not all(self._client.exists(c.key, deadline)
                                           for c in chunks):
                        break
                    tokens += chunk_tokens
        except TransportError as exc:  # no server: compute everything, as without a cache
            logger.warning("kvdisagg: LMCache lookup failed: %s", exc)
        return tokens

    def close(self) -> None:
        self._client.close()


class _ChunkLayer(NamedTuple):
    """One layer of a stored chunk (a page of the rank that stored it per block) and where
    its bytes go here: ``region`` (-1: nowhere), ``nbytes`` from ``src_offset`` of each page
    into ``dst_offset`` of the region's block."""

    page: int
    region: int
    src_offset: int
    nbytes: int
    dst_offset: int


class LMCacheTransport:
    name: ClassVar[str] = "lmcache"
    keyed_by_tokens: ClassVar[bool] = True

    def __init__(self, config: ConnectorConfig, tp_rank: int = 0) -> None:
        self.config, self.tp_rank = config, tp_rank
        self.rank, self.shape = tp_rank, Shape(1)
        self.geometry: KvGeometry | None = None
        self.regions: list[LayerRegion] = []
        self.kv_layout, self.block_size = "", 0
        self._local = threading.local()
        self._clients: list[LMCacheClient] = []
        self._clients_lock = threading.Lock()
        self._stores: queue.Queue[Offer | None] = queue.Queue()
        self._released: set[str] = set()
        self._released_lock = threading.Lock()
        self._store_thread: threading.Thread | None = None

    # ---- Transport ------------------------------------------------------------------------
    def instrument(self, tracer: Tracer, observe: Callable[[str, float], None]) -> None:
        """Nothing of prefill's is served on LMCache's side: no spans or phases of its own."""

    def step(self, running: bool) -> None:
        """Stores are not tied to engine steps."""

    def expired_unread(self) -> int:
        return 0  # stored chunks outlive the handoff; the store evicts them by its own rules

    def register(self, regions: Sequence[LayerRegion], *, kv_layout: str, block_size: int,
                 is_producer: bool, geometry: KvGeometry | None = None,
                 rank: int | None = None, shape: Shape | None = None) -> int:
        """``rank``/``shape``: this worker's rank and its instance's parallelism (the keys of
        what it stores)."""
        if self.config.lmcache_chunk_tokens % block_size:
            raise ConfigError(f"lmcache_chunk_tokens={self.config.lmcache_chunk_tokens} must be "
                              f"a multiple of vLLM's block size {block_size}")
        self.regions, self.kv_layout, self.block_size = list(regions), kv_layout, block_size
        self.geometry = geometry
        if rank is not None:
            self.rank = rank
        if shape is not None:
            self.shape = shape
        self._host = [host_bytes(r.pages) if r.pages.device.type == "cpu" else None
                      for r in self.regions]
        if is_producer or self.config.lmcache_store_decoded:
            self._store_thread = threading.Thread(target=self._store_loop, daemon=True,
                                                  name="kvdisagg-lmcache-store")
            self._store_thread.start()
        return 0  # no side channel: the server is the rendezvous

    def chunks(self, prompt: Sequence[int], rank: int | None = None,
               shape: Shape | None = None) -> list[Chunk]:
        """The chunks rank ``rank`` of an instance of ``shape`` stores (default: this one)."""
        return chunk_plan(prompt, kv_layout=self.kv_layout, block_size=self.block_size,
                          chunk_tokens=self.config.lmcache_chunk_tokens,
                          rank=self.rank if rank is None else rank,
                          shape=self.shape if shape is None else shape)

    def offer(self, offer: Offer) -> bool:
        self._stores.put(offer)
        return True

    def expect(self, handoff_id: str, token: str) -> None:
        """Early handoffs are for pull transports: a store is looked up by tokens anyway."""

    def forget(self, handoff_id: str, why: str) -> None:
        pass

    def take_released(self) -> set[str]:
        with self._released_lock:
            out, self._released = self._released, set()
        return out

    def fetch(self, fetch: Fetch, timeout_s: float, timing: PullTiming | None = None) -> int:
        """Fill local blocks with prompt blocks ``first_block``..; chunks prefill has not
        stored yet are waited for until the deadline."""
        deadline = Deadline(timeout_s, f"fetch of {fetch.handoff_id or 'prefix'} from LMCache")
        if fetch.kv_layout != self.kv_layout:
            raise TransferFailed(f"handoff kv_layout {fetch.kv_layout} != {self.kv_layout}")
        if error := check_blocks(self.regions, fetch.local_block_ids):
            raise TransferFailed(f"local {error}")
        wanted = range(fetch.first_block, fetch.first_block + len(fetch.local_block_ids))
        prompt_blocks = -(-len(fetch.prompt_token_ids) // self.block_size)
        if fetch.first_block < 0 or wanted.stop > prompt_blocks:
            raise TransferFailed(f"blocks {wanted.start}..{wanted.stop - 1} asked of a "
                                 f"{len(fetch.prompt_token_ids)}-token prompt")
        part = fetch.part
        if part is not None and not part.layers:
            return 0  # a release-only Part: the store keeps nothing per reader
        layout = self._chunk_layout(fetch)
        client = self._client()
        failed = failure_key(fetch.handoff_id, kv_layout=self.kv_layout,
                             rank=self.rank if part is None else part.src,
                             shape=self.shape if part is None else fetch.prefill or self.shape)
        nbytes = 0
        chunks = (self.chunks(fetch.prompt_token_ids) if part is None else
                  self.chunks(fetch.prompt_token_ids, part.src, fetch.prefill or self.shape))
        for chunk in chunks:
            blocks = range(chunk.first_block, chunk.first_block + chunk.num_blocks)
            needed = [b for b in blocks if b in wanted]
            if not needed:
                continue
            dst = {b: fetch.local_block_ids[b - fetch.first_block] for b in needed}
            if all(h is not None for h in self._host):
                parts = self._scatter_views(blocks, dst, layout)
                self._get(client, chunk, parts, deadline, failed)
            else:
                self._fetch_staged(client, chunk, dst, layout, deadline, failed)
            nbytes += len(needed) * sum(c.nbytes for c in layout)
        return nbytes

    def _get(self, client: LMCacheClient, chunk: Chunk, parts: list[memoryview],
             deadline: Deadline, failed: CacheEngineKey) -> None:
        """GET a chunk into ``parts`` (waiting for it until the deadline), then check its
        checksum against the pages as they landed."""
        trailer = memoryview(bytearray(TRAILER_BYTES))
        self._receive(client, chunk, [*parts, trailer], deadline, failed)
        try:
            stored = unpack_trailer(trailer)
        except ValueError as exc:
            raise TransferFailed(f"LMCache chunk {chunk.key.to_string()}: {exc}") from None
        if stored is None or not self.config.kv_checksum:
            return  # stored without a checksum (its writer had kv_checksum off), or unchecked
        if (landed := digest_views(parts)) != stored:
            raise ChecksumMismatch(
                f"KV checksum mismatch in LMCache chunk {chunk.index} "
                f"({chunk.key.to_string()}) from {client.url}: xxh3_64 {stored.hex()} stored, "
                f"{landed.hex()} received; the load fails")

    def _receive(self, client: LMCacheClient, chunk: Chunk, parts: list[memoryview],
                 deadline: Deadline, failed: CacheEngineKey) -> None:
        """GET the chunk, polling while prefill has not stored it yet, until the deadline or
        until prefill's failure mark for the handoff shows up."""
        next_check = time.monotonic()
        while not client.get_into(chunk.key, parts, deadline):
            if time.monotonic() >= next_check:
                if client.exists(failed, deadline):
                    raise TransferFailed(f"prefill could not store this handoff in LMCache "
                                         f"({client.url}; prefill's log says why)")
                next_check = time.monotonic() + FAILURE_CHECK_S
            time.sleep(min(POLL_S, deadline.left()))

    def _chunk_layout(self, fetch: Fetch) -> list[_ChunkLayer]:
        """The layers of a chunk of the rank read (layer-major) and where each goes here."""
        if fetch.part is None:
            return [_ChunkLayer(r.page_bytes, i, 0, r.page_bytes, 0)
                    for i, r in enumerate(self.regions)]
        part = fetch.part
        if self.geometry is None:
            raise TransferFailed("lmcache: no KV geometry registered; cannot map a Part")
        prefill = fetch.prefill or self.shape
        stage = part.src // prefill.tp
        index = {r.layer: i for i, r in enumerate(self.regions)}
        head = self.geometry.head_bytes
        out = []
        for layer in prefill.layers(stage, self.geometry.layers):
            i = index.get(layer, -1) if layer in part.layers else -1
            if i >= 0 and part.dst_head + part.heads > self.regions[i].heads:
                raise TransferFailed(
                    f"lmcache: heads {part.dst_head}..{part.dst_head + part.heads - 1}"
                    f" are not held here"
                )
            out.append(_ChunkLayer(part.src_width * head, i, part.src_head * head,
                                   part.heads * head if i >= 0 else 0, part.dst_head * head))
        return out

    def _scatter_views(self, blocks: range, dst: dict[int, int],
                       layout: list[_ChunkLayer]) -> list[memoryview]:
        """Where each byte of a chunk goes (layer-major): into its decode block (the heads
        read, at this rank's heads), or a discard buffer (blocks decode already holds, layers
        or heads it does not)."""
        parts: list[memoryview] = []

        def discard(n: int) -> memoryview:
            # Bytes of its own for each: the checksum covers the whole chunk as it landed.
            return memoryview(bytearray(n))

        for page, i, offset, nbytes, into in layout:
            if i < 0:
                parts.extend(discard(page) for _ in blocks)
                continue
            host, mine = self._host[i], self.regions[i]
            assert host is not None  # called only when every layer's pages are host memory
            for b in blocks:
                if b not in dst:
                    parts.append(discard(page))
                    continue
                if offset:
                    parts.append(discard(offset))
                start = dst[b] * mine.page_bytes + into
                parts.append(host[start:start + nbytes])
                if page - offset - nbytes:
                    parts.append(discard(page - offset - nbytes))
        return parts

    def _fetch_staged(self, client: LMCacheClient, chunk: Chunk, dst: dict[int, int],
                      layout: list[_ChunkLayer], deadline: Deadline,
                      failed: CacheEngineKey) -> None:
        """KV off the host (CUDA): the chunk through one host buffer, then page copies."""
        scratch = torch.empty(sum(c.page for c in layout) * chunk.num_blocks, dtype=torch.uint8)
        self._get(client, chunk, [host_bytes(scratch)], deadline, failed)
        at = 0
        for page, i, offset, nbytes, into in layout:
            if i >= 0:
                mine = self.regions[i]
                for b, block in dst.items():
                    src = at + (b - chunk.first_block) * page + offset
                    mine.pages[block][into:into + nbytes].copy_(scratch[src:src + nbytes])
            at += page * chunk.num_blocks

    def close(self) -> None:
        if self._store_thread is not None:
            self._stores.put(None)
            self._store_thread.join(timeout=self.config.transfer_timeout_seconds)
        with self._clients_lock:
            for client in self._clients:
                client.close()

    # ---- store: prefill's handoffs, decode's finished requests -----------------------------
    def _client(self) -> LMCacheClient:
        """One connection per thread (fetches run on a pool; the store on its own thread)."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = LMCacheClient(self.config.lmcache_url)
            with self._clients_lock:
                self._clients.append(client)
        return client

    def _store_loop(self) -> None:
        while (offer := self._stores.get()) is not None:
            try:
                self._store(offer)
            except TransportError as exc:
                logger.error("kvdisagg: storing %s in LMCache failed: %s", offer.handoff_id, exc)
                if offer.token:  # a handoff a decode waits for (not a finished decode's KV)
                    self._mark_failed(offer.handoff_id)
            finally:
                with self._released_lock:  # stored or not, the blocks go back to vLLM
                    self._released.add(offer.handoff_id)

    def _mark_failed(self, handoff_id: str) -> None:
        """Tell the decode waiting for ``handoff_id`` that its chunks will not come (best
        effort: with the server down, decode's own GETs fail anyway)."""
        key = failure_key(handoff_id, kv_layout=self.kv_layout, rank=self.rank, shape=self.shape)
        try:
            self._client().put(key, [memoryview(b"\x01")],
                               Deadline(FAILURE_MARK_S, f"failure mark of {handoff_id}"))
        except TransportError as exc:
            logger.warning("kvdisagg: could not mark %s as failed in LMCache either: %s",
                           handoff_id, exc)

    def _store(self, offer: Offer) -> None:
        deadline = Deadline(self.config.transfer_timeout_seconds,
                            f"store of {offer.handoff_id} in LMCache")
        client = self._client()
        if error := check_blocks(self.regions, offer.block_ids):
            raise TransferFailed(error)
        for chunk in self.chunks(offer.prompt_token_ids):
            block_ids = offer.block_ids[chunk.first_block:chunk.first_block + chunk.num_blocks]
            if len(block_ids) < chunk.num_blocks:
                raise TransferFailed(f"{len(offer.block_ids)} blocks for a "
                                     f"{len(offer.prompt_token_ids)}-token prompt")
            if client.exists(chunk.key, deadline):
                continue  # a shared prefix, stored by an earlier request
            runs = copy_runs(len(self.regions), block_ids, range(chunk.num_blocks))
            parts = [host_bytes(_on_host(span_tensor(self.regions, span)))
                     for span in spans(self.regions, whole_slices(self.regions), runs, "src")]
            digest = digest_views(parts) if self.config.kv_checksum else None
            client.put(chunk.key, [*parts, memoryview(pack_trailer(digest))], deadline)


def _on_host(tensor: Any) -> Any:
    return tensor if tensor.device.type == "cpu" else tensor.cpu()
