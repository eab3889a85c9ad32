"""``mooncake``: decode reads prefill's registered KV memory with Mooncake's TransferEngine.

Both workers register their KV memory with an engine (RDMA on GPU fleets, TCP anywhere).
Prefill advertises its engine endpoint and each layer's base address (with the layer's id and
heads) in the Hello reply; decode then reads granted blocks one-sidedly, one range per CopyRun
(per block when it reads some of a block's heads: another TP), in batches within the engine's
limits. The side channel still decides what may be read: decode asks with the handoff's token,
prefill pins the handoff, and only after decode's Done may the blocks be freed and reused.
Concurrent pulls' reads go to the engine together (``JoinedReads``).

Mooncake reports errors as return codes, never exceptions: every one is checked here.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

from kvdisagg.connector.config import MOONCAKE_MAX_PORT, MOONCAKE_PORTS_PER_RANK, rank_port
from kvdisagg.connector.layout import LayerRegion, Slice
from kvdisagg.errors import ConfigError, IncompatiblePeerError, TransferFailed
from kvdisagg.transport.pull import Deadline, PullPlan, PullTransport

MAX_BATCH = 512  # the TCP transport fails batches over ~1k entries at once ("queue-full")


class MemoryInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill -> decode in the Hello reply: where prefill's KV lives in its engine."""

    endpoint: str
    bases: list[int]
    page_bytes: list[int]
    num_blocks: list[int]
    stage_bases: list[int] = []  # each layer's staging arena (block ids from num_blocks on)
    stage_blocks: list[int] = []
    layers: list[int] = []  # each region's layer id (the model's)
    heads: list[int] = []  # each region's KV heads (its page holds that many)


def rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def bound_ports(base: int, rank: int) -> tuple[int, int] | None:
    """Rank ``rank``'s engine ports when ``mooncake_port`` is ``base`` (None: 0, Mooncake's own
    range), set as the range Mooncake draws its ports from.

    The only bound the engine takes: ``initialize`` has no port argument (a ``host:port`` is
    honoured only with a metadata server and ``MC_LEGACY_RPC_PORT_BINDING``); the engine draws
    its RPC/handshake port, and over TCP its data port, at random within ``MC_MIN_RPC_PORT``
    .. ``MC_MAX_RPC_PORT``, which it reads once, when ``mooncake.engine`` loads (checked with
    0.3.13). So this runs before that import, in each worker's own process.
    """
    first = rank_port("mooncake_port", base, rank, MOONCAKE_PORTS_PER_RANK, MOONCAKE_MAX_PORT)
    if not first:
        return None
    last = first + MOONCAKE_PORTS_PER_RANK - 1
    os.environ["MC_MIN_RPC_PORT"], os.environ["MC_MAX_RPC_PORT"] = str(first), str(last)
    return first, last


def check_devices(device: str, present: Sequence[str], rank: int) -> None:
    """Refuse ``rdma`` without the devices it names (or without any): Mooncake (0.3.13) then
    initializes all the same and moves KV over TCP without a word."""
    if not present:
        raise ConfigError("mooncake_protocol=rdma but /sys/class/infiniband lists no RDMA "
                          "device: set mooncake_protocol to tcp (or auto), or load the NIC's "
                          "driver")
    missing = [d for d in device.split(",") if d and d not in present]
    if missing:
        raise ConfigError(f"mooncake_device: rank {rank}'s {', '.join(missing)} not in "
                          f"/sys/class/infiniband (found: {', '.join(present) or 'none'})")


class MooncakeTransport(PullTransport):
    name: ClassVar[str] = "mooncake"

    def attach(self, regions: Sequence[LayerRegion], is_producer: bool) -> None:
        ports = bound_ports(self.config.mooncake_port, self.rank)
        from mooncake.engine import TransferEngine  # after bound_ports: it reads them on load

        protocol = self.config.mooncake_protocol
        if protocol == "auto":
            protocol = "rdma" if rdma_devices() else "tcp"
        device = self.config.mooncake_device_of(self.rank)
        if protocol == "rdma":
            check_devices(device, rdma_devices(), self.rank)
        self.engine = TransferEngine()
        rc = self.engine.initialize(self.config.side_channel_host,
                                    self.config.mooncake_metadata_server, protocol, device)
        if rc != 0:
            within = f", ports {ports[0]}-{ports[1]} (mooncake_port): are they free?" \
                if ports else ""
            raise ConfigError(f"mooncake: TransferEngine.initialize({protocol!r}, device "
                              f"{device!r}{within}) returned {rc}")
        rpc_port = self.engine.get_rpc_port()
        if ports and not ports[0] <= rpc_port <= ports[1]:
            raise ConfigError(
                f"mooncake_port={self.config.mooncake_port}: rank {self.rank}'s engine listens "
                f"on {rpc_port}, not within {ports[0]}-{ports[1]}: mooncake.engine was loaded "
                "in this process before (it reads MC_MIN_RPC_PORT/MC_MAX_RPC_PORT once, when "
                "it loads), so this worker cannot bound its ports")
        self.protocol = protocol
        self.reads = JoinedReads(self.engine)
        self._registered: list[int] = []
        for addr, nbytes in _spans(regions):
            rc = self.engine.register_memory(addr, nbytes)
            if rc != 0:
                raise ConfigError(f"mooncake: register_memory of {nbytes} bytes returned {rc}")
            self._registered.append(addr)
        # This worker's memory: what prefill advertises, and how decode addresses its own side.
        self._memory = MemoryInfo(
            endpoint=f"{self.config.side_channel_host}:{rpc_port}",
            bases=[r.pages.data_ptr() for r in regions],
            page_bytes=[r.page_bytes for r in regions],
            num_blocks=[r.num_blocks for r in regions],
            stage_bases=[r.stage.data_ptr() if r.stage_blocks else 0 for r in regions],
            stage_blocks=[r.stage_blocks for r in regions],
            layers=[r.layer for r in regions], heads=[r.heads for r in regions])

    def server_info(self) -> dict[str, Any]:
        return msgspec.to_builtins(self._memory)

    def open_client(self, sock: socket.socket, info: dict[str, Any], deadline: Deadline) -> Any:
        try:
            peer = msgspec.convert(info, MemoryInfo)
        except msgspec.ValidationError as exc:
            raise TransferFailed(f"mooncake: bad memory info from prefill: {exc}") from None
        n = len(peer.bases)
        if not (len(peer.num_blocks) == len(peer.page_bytes) == len(peer.layers)
                == len(peer.heads) == n) or 0 in peer.heads:
            raise IncompatiblePeerError("mooncake: prefill advertises malformed memory")
        if peer.stage_blocks and not (len(peer.stage_blocks) == len(peer.stage_bases) == n):
            raise IncompatiblePeerError("mooncake: prefill advertises a malformed arena")
        return peer

    def recv(self, peer: MemoryInfo, sock: socket.socket, plan: PullPlan,
             deadline: Deadline) -> None:
        # Addresses by arithmetic on each layer's base, not a tensor slice per run (~2 us
        # each: 2 ms of a 16 MiB pull of scattered blocks went to building these lists).
        remote_slices = _remote_slices(peer, plan)
        whole = all(s.nbytes == self._memory.page_bytes[s.region] for s in plan.slices) and \
            all(s.nbytes == peer.page_bytes[s.region] for s in remote_slices)
        local, remote, lengths = [], [], []
        for run in plan.runs:
            mine, theirs = plan.slices[run.layer], remote_slices[run.layer]
            if whole:
                local.append(_address(self._memory, mine.region, run.dst, run.count, "decode's"))
                remote.append(_address(peer, theirs.region, run.src, run.count, "prefill's"))
                lengths.append(run.count * mine.nbytes)
                continue
            for k in range(run.count):
                local.append(_address(self._memory, mine.region, run.dst + k, 1, "decode's")
                             + mine.offset)
                remote.append(_address(peer, theirs.region, run.src + k, 1, "prefill's")
                              + theirs.offset)
                lengths.append(mine.nbytes)
        deadline.left()
        if (error := self.reads.read(peer.endpoint, local, remote, lengths)) is not None:
            raise TransferFailed(f"mooncake: {error}")

    def close(self) -> None:
        super().close()
        for addr in getattr(self, "_registered", []):
            self.engine.unregister_memory(addr)
        self._registered = []


class _Read:
    """One pull's ranges, waiting to be read (or, ``lead`` set, to lead the next reads)."""

    __slots__ = ("local", "remote", "lengths", "woken", "lead", "error")

    def __init__(self, local: list[int], remote: list[int], lengths: list[int]) -> None:
        self.local, self.remote, self.lengths = local, remote, lengths
        self.woken = threading.Event()  # read, or handed the lead
        self.lead = False
        self.error: str | None = None


class JoinedReads:
    """Concurrent pulls' engine reads from one prefill, issued together.

    **Why.** Decode's workers pull a burst of handoffs on separate threads, and Mooncake's TCP
    transport slows down under concurrent batch reads: 8 handoffs of 4 MiB took 135 ms read
    apart against 64 ms as one read (``benchmarks/transfer.py --burst 8``). One batch of many
    ranges is what the engine is built for (RDMA posts them together too).

    **How.** Per prefill endpoint, one thread at a time leads: it takes every read queued for
    that endpoint so far, its own included, issues them ``MAX_BATCH`` ranges at a time, wakes
    their pulls, and hands the lead to the oldest read queued meanwhile. Endpoints never wait
    for each other (a slow prefill holds up only reads from itself). A failed batch fails the
    reads it carried ranges of; a leader interrupted midway fails every read it took, so no
    pull is told its bytes arrived unless the engine said so.
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._queues: dict[str, list[_Read]] = {}  # an endpoint's key exists while it has a lead

    def read(self, endpoint: str, local: list[int], remote: list[int],
             lengths: list[int]) -> str | None:
        """Read ``lengths[i]`` bytes at ``remote[i]`` of ``endpoint``'s memory into
        ``local[i]``; None, or why it failed."""
        if not lengths:
            return None
        mine = _Read(local, remote, lengths)
        with self._lock:
            queue = self._queues.get(endpoint)
            if queue is not None:  # a read from this endpoint is in flight: wait for it
                queue.append(mine)
            else:
                self._queues[endpoint] = []
        if queue is not None:
            mine.woken.wait()  # the engine's own timeouts bound the read in flight
            if not mine.lead:
                return mine.error
            with self._lock:
                batch, self._queues[endpoint] = self._queues[endpoint], []
        else:
            batch = [mine]
        issued = False
        try:
            self._issue(endpoint, batch)
            issued = True
        finally:
            with self._lock:
                if waiting := self._queues[endpoint]:  # queued while this batch was in flight
                    waiting[0].lead = True
                    waiting[0].woken.set()
                else:
                    del self._queues[endpoint]
            for r in batch:
                if not issued and r.error is None:
                    r.error = f"reads from {endpoint} interrupted"
                if r is not mine:
                    r.woken.set()
        return mine.error

    def _issue(self, endpoint: str, reads: list[_Read]) -> None:
        local = [a for r in reads for a in r.local]
        remote = [a for r in reads for a in r.remote]
        lengths = [n for r in reads for n in r.lengths]
        ends, end = [], 0  # where each read's ranges end in the joined lists
        for r in reads:
            end += len(r.lengths)
            ends.append(end)
        for i in range(0, len(lengths), MAX_BATCH):
            j = min(i + MAX_BATCH, len(lengths))
            try:
                rc = self._engine.batch_transfer_sync_read(
                    endpoint, local[i:j], remote[i:j], lengths[i:j])
            except Exception as exc:  # not Mooncake's way, but a pull must not hang on it
                rc = repr(exc)
            if rc == 0:
                continue
            error = f"batch read of {j - i} ranges from {endpoint} returned {rc}"
            for r, stop in zip(reads, ends):
                if stop - len(r.lengths) < j and stop > i and r.error is None:
                    r.error = error


def _remote_slices(peer: MemoryInfo, plan: PullPlan) -> list[Slice]:
    """Prefill's Slice of each pull layer, from the memory it advertised."""
    index = {layer: i for i, layer in enumerate(peer.layers)}
    out = []
    for layer in plan.layers:
        i = index.get(layer)
        if i is None:
            raise TransferFailed(f"mooncake: prefill advertises no memory of layer {layer}")
        head = peer.page_bytes[i] // peer.heads[i]
        first, count = plan.heads if plan.heads[1] else (0, peer.heads[i])
        out.append(Slice(i, first * head, count * head))
    return out


def _address(memory: MemoryInfo, layer: int, first: int, count: int, whose: str) -> int:
    """Where blocks ``first..first+count`` of ``layer`` live in ``memory``: its pages, or its
    staging arena."""
    n, page = memory.num_blocks[layer], memory.page_bytes[layer]
    staged = memory.stage_blocks[layer] if memory.stage_blocks else 0
    if first + count <= n:
        return memory.bases[layer] + first * page
    if first >= n and first + count <= n + staged:
        return memory.stage_bases[layer] + (first - n) * page
    raise TransferFailed(f"mooncake: blocks {first}..{first + count - 1} are not {whose} "
                         f"({n} pages, {staged} staged)")


def _spans(regions: Sequence[LayerRegion]) -> list[tuple[int, int]]:
    """Each region's memory (pages and arena), merged where adjacent (vLLM allocates one
    buffer for every layer's pages)."""
    memory = [(r.pages.data_ptr(), r.page_bytes * r.num_blocks) for r in regions]
    memory += [(r.stage.data_ptr(), r.page_bytes * r.stage_blocks) for r in regions
               if r.stage_blocks]
    spans: list[tuple[int, int]] = []
    for addr, nbytes in sorted(memory):
        if spans and spans[-1][0] + spans[-1][1] == addr:
            spans[-1] = (spans[-1][0], spans[-1][1] + nbytes)
        elif spans and addr < spans[-1][0] + spans[-1][1]:
            raise ConfigError("mooncake: KV regions overlap")
        else:
            spans.append((addr, nbytes))
    return spans
