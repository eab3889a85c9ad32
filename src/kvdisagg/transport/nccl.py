"""``nccl``: KV moved by point-to-point send/recv of ``torch.distributed`` process groups.

One two-rank group per side-channel connection, i.e. per (prefill worker, decode worker) pair:
prefill is rank 0 and hosts the rendezvous (a TCPStore on its side-channel address, one per
worker, on ``nccl_store_port`` + rank or a free port, a fresh prefix per group); decode joins
as rank 1 right after the Hello reply. The group lives as long as the connection and is dropped
with it, so a peer that goes away takes its group along. vLLM's default group is never touched.
The group's own connections (gloo's pair, NCCL's bootstrap and socket transport) use ports the
OS picks: docs/operations.md#fabric says what a firewall must allow.

``ProcessGroupNCCL`` when the KV cache is on CUDA, ``ProcessGroupGloo`` on CPU: the same code,
tested on CPU with gloo. The side channel runs one pull at a time per connection, so the
messages of two pulls never interleave.

A pull is a few gathered messages, not one message per CopyRun: both sides cut the same CopyRun
list into the same Messages (plan_messages: each layer's block rows in run order, consecutive
layers packed together, capped at MESSAGE_BYTES). A row is the pull's Slice of a block: the
whole page, or the window of the heads read when the two sides' TP differ (same size on both).
Prefill gathers a message's rows into one
buffer on the KV's device and sends it; decode receives into one buffer and scatters the rows
into its blocks (on CUDA ``index_select`` / ``index_copy_`` per layer; on CPU a ``memmove`` per
span, see _host_copy). A side whose rows of a message are one range of consecutive blocks (decode's
fresh blocks, often) sends or receives in place instead, with no copy. A 16 MiB pull of scattered
blocks is then 4 messages instead of a thousand. On GPUs with NCCL this means one kernel launch
and one network message per ~32 MiB instead of one per run, for a gather and a scatter copy in
device memory at HBM speed (TB/s, far above any link). Each side posts at most IN_FLIGHT messages
ahead, which bounds the extra memory a pull holds (a freed buffer is reused once NCCL's stream is
done with it, as the caching allocator tracks).

What is synchronized, and why. On CPU (gloo) ``Work.wait()`` blocks the host until the op is
done and the copies are ``memmove``s, done when they return: nothing else to wait for. On CUDA
(NCCL) the host only *enqueues*: ``Work.wait()`` makes the current stream wait for NCCL's (torch
documents that it blocks the host only when given a timeout), and the gather and scatter
(``index_select``/``index_copy_``) are kernels queued on the current stream. vLLM's forward
reads the pages once the load is reported done, on its own thread's stream, so ``recv`` must not
return before the bytes are in the pages; prefill frees its blocks once decode says Done, so
``send`` must not return before NCCL has read them. Each side therefore, through its ``sync``
(HostSync on CPU: nothing more; CudaSync on CUDA):

1. polls each op's ``Work.is_completed()`` (host-visible completion) until the deadline, before
   ``Work.wait()`` (which then returns at once, or raises the op's error);
2. after the last wait and the last scatter copy, records a ``torch.cuda.Event`` on the stream
   that ran them and polls ``Event.query()`` until it is done, or the deadline passes.

``recv`` and ``send`` return only then, so the side channel's Done (decode: the load is reported
done; prefill: the blocks may be freed) follows bytes that have landed. Polling rather than
``Event.synchronize()`` lets the deadline fire: a transfer that never completes raises
TransferTimeout (the connection is then closed, which aborts the NCCL group) instead of hanging.
"""

from __future__ import annotations

import array
import ctypes
import datetime
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, NamedTuple

import msgspec
import torch
import torch.distributed as dist

from kvdisagg.compat._torch import pair_group
from kvdisagg.connector.config import rank_port
from kvdisagg.connector.layout import CopyRun, LayerRegion, Slice
from kvdisagg.errors import ConfigError, IncompatiblePeerError, TransferFailed, TransferTimeout
from kvdisagg.transport.pull import Deadline, PullPlan, PullTransport

MESSAGE_BYTES = {"gloo": 4 << 20, "nccl": 32 << 20}
"""Most bytes per message. Gloo moves 2-8 MiB messages twice as fast on loopback as one of
16 MiB or more (measured: 2.8 vs 1.2 GB/s), and pipelines a pull's messages; NCCL only needs
enough to amortise a launch. Both sides use their common backend's value."""
IN_FLIGHT = 4  # messages posted ahead of the one being waited for: bounds the buffers held
POLL_FIRST_S, POLL_MAX_S = 1e-5, 2e-4
"""Pauses between polls of a CUDA op or event: doubling from the first to the longest, so a short
wait costs little latency and a long one little CPU."""


class Segment(NamedTuple):
    """One pull layer's rows of a message, on one side (block ids, in CopyRun order)."""

    layer: int
    ids: list[int]


def plan_messages(runs: Sequence[CopyRun], side: str, page_bytes: Sequence[int],
                  max_bytes: int) -> list[list[Segment]]:
    """Cut a pull into messages of at most ``max_bytes`` (or one block, if larger).
    ``page_bytes``: the bytes moved per block of each pull layer (its Slice).

    Both sides call this on the same CopyRun list with the same sizes, so the k-th message
    holds the same rows, in the same order, on both: prefill's ids on ``side="src"``, decode's
    on ``"dst"``. Layers are packed together while they fit; a layer that does not fit is split.

    >>> from kvdisagg.connector.layout import copy_runs
    >>> runs = copy_runs(2, [3, 4, 9], [0, 1, 2])
    >>> plan_messages(runs, "src", [8, 8], 48)
    [[Segment(layer=0, ids=[3, 4, 9]), Segment(layer=1, ids=[3, 4, 9])]]
    >>> plan_messages(runs, "dst", [8, 8], 16)
    [[Segment(layer=0, ids=[0, 1])], [Segment(layer=0, ids=[2]), Segment(layer=1, ids=[0])], \
[Segment(layer=1, ids=[1, 2])]]
    """
    messages: list[list[Segment]] = []
    room = 0  # bytes left in the last message
    on_src = side == "src"
    for run in runs:
        page, first, count = page_bytes[run.layer], run.src if on_src else run.dst, run.count
        while count:
            if room < page:
                messages.append([])
                room = max(max_bytes, page)
            take = min(count, room // page)
            message = messages[-1]
            if not message or message[-1].layer != run.layer:
                message.append(Segment(run.layer, []))
            message[-1].ids.extend(range(first, first + take))
            first, count, room = first + take, count - take, room - take * page
    return messages


def poll(done: Callable[[], bool], seconds: float) -> bool:
    """Whether ``done()`` turned true within ``seconds`` (it is called at least once), polled
    with pauses from POLL_FIRST_S doubling to POLL_MAX_S."""
    end = time.monotonic() + seconds
    pause = POLL_FIRST_S
    while not done():
        if time.monotonic() >= end:
            return False
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)
    return True


class HostSync:
    """How a side waits for its device: on CPU (gloo), through ``Work.wait()`` alone.

    ``waits_block``: ``Work.wait()`` blocks the host until the op is done (gloo), so it is not
    polled first. ``fence()`` does nothing: a copy on the host is done when it returns."""

    waits_block: ClassVar[bool] = True

    def fence(self, deadline: Deadline) -> None:
        """Either side's pull thread, once per ``send``/``recv``, after its last op was waited
        for: return once the device has finished every copy this thread queued (the scatter into
        the pages, or NCCL's reads of them), or raise TransferTimeout when ``deadline`` runs
        out."""


class CudaSync(HostSync):
    """On CUDA (NCCL): ``Work.wait()`` only makes the current stream wait for NCCL's, so each op
    is polled (``is_completed``) first, and ``fence()`` records an event on the current stream of
    the KV's device (the one that ran the copies, after the waits) and polls it.

    ``stream`` and ``event``: torch's by default; a test passes recording fakes."""

    waits_block: ClassVar[bool] = False

    def __init__(self, device: torch.device,
                 stream: Callable[[torch.device], Any] = torch.cuda.current_stream,
                 event: Callable[[], Any] = torch.cuda.Event) -> None:
        self.device, self._stream, self._event = device, stream, event

    def fence(self, deadline: Deadline) -> None:
        event = self._event()
        event.record(self._stream(self.device))
        bound = deadline.left()
        if not poll(event.query, bound):
            raise TransferTimeout(f"{deadline.what}: the KV copies on {self.device} not done "
                                  f"within {bound:.1f}s (transfer_timeout_seconds)")


class GroupInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill -> decode in the Hello reply: where to rendezvous for this connection's group."""

    store_host: str
    store_port: int
    group: str
    backend: str


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


class NcclTransport(PullTransport):
    name: ClassVar[str] = "nccl"
    sync: HostSync = HostSync()  # CudaSync when the KV is on CUDA (attach)

    def attach(self, regions: Sequence[LayerRegion], is_producer: bool) -> None:
        device = regions[0].pages.device if regions else torch.device("cpu")
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.sync = CudaSync(device) if device.type == "cuda" else HostSync()
        self._store: dist.TCPStore | None = None
        if is_producer:
            self._store = self._open_store()

    def _open_store(self) -> dist.TCPStore:
        """Prefill's rendezvous: on ``nccl_store_port`` + rank (a free port when 0), bound to
        ``side_channel_host`` alone. TCPStore binds every interface when it opens its socket
        itself, so it is handed one opened here (``master_listen_fd``; it closes it)."""
        host, base = self.config.side_channel_host, self.config.nccl_store_port
        port = rank_port("nccl_store_port", base, self.rank)
        try:
            sock = socket.create_server((host, port), backlog=64, family=(
                socket.AF_INET6 if ":" in host else socket.AF_INET))
        except OSError as exc:
            raise ConfigError(f"nccl_store_port={base}: rank {self.rank} cannot listen on "
                              f"{host}:{port}: {exc}") from None
        port = sock.getsockname()[1]
        return dist.TCPStore(host, port, None, True,
                             timeout=_timedelta(self.config.transfer_timeout_seconds),
                             wait_for_workers=False, master_listen_fd=sock.detach())

    def _live_store(self) -> dist.TCPStore:
        if self._store is None:  # a connection still being served after close()
            raise TransferFailed("nccl: this worker's transport is closed")
        return self._store

    def server_info(self) -> dict[str, Any]:
        return msgspec.to_builtins(GroupInfo(
            store_host=self.config.side_channel_host, store_port=self._live_store().port,
            group=secrets.token_hex(8), backend=self.backend))

    def open_server(self, sock: socket.socket, info: dict[str, Any], sent: dict[str, Any]) -> Any:
        return self._group(dist.PrefixStore(sent["group"], self._live_store()), rank=0,
                           timeout_s=self.config.transfer_timeout_seconds,
                           hostname=sock.getsockname()[0])

    def open_client(self, sock: socket.socket, info: dict[str, Any], deadline: Deadline) -> Any:
        try:
            group = msgspec.convert(info, GroupInfo)
        except msgspec.ValidationError as exc:
            raise TransferFailed(f"nccl: bad group info from prefill: {exc}") from None
        if group.backend != self.backend:
            raise IncompatiblePeerError(f"nccl: prefill's KV needs {group.backend}, decode's "
                                        f"{self.backend} (both on GPU, or both on CPU)")
        try:
            store = dist.TCPStore(group.store_host, group.store_port, None, False,
                                  timeout=_timedelta(deadline.left()))
        except (RuntimeError, ValueError) as exc:
            raise TransferFailed(f"nccl: rendezvous at {group.store_host}:{group.store_port} "
                                 f"failed: {exc}") from None
        return self._group(dist.PrefixStore(group.group, store), rank=1,
                           timeout_s=deadline.left(),
                           hostname=sock.getsockname()[0])

    def _group(self, store: dist.Store, rank: int, timeout_s: float, hostname: str) -> Any:
        """``hostname``: this end's address of the side channel, i.e. the interface that
        reaches the peer (gloo binds it; vLLM's own groups are never involved)."""
        try:
            return pair_group(store, rank, self.backend, timeout_s, hostname)
        except RuntimeError as exc:
            raise TransferFailed(f"nccl: forming the {self.backend} group failed: {exc}"
                                 ) from None

    def close_peer(self, peer: Any) -> None:
        if peer is not None and hasattr(peer, "abort") and self.backend == "nccl":
            peer.abort()

    def close(self) -> None:
        super().close()
        self._store = None  # its listener closes with it: a fixed port is free again

    def send(self, peer: Any, sock: socket.socket, plan: PullPlan, deadline: Deadline,
             grant: bytes) -> None:
        sock.sendall(grant)
        slices = plan.slices
        pending: deque[Any] = deque()  # posted sends; each holds its buffer until sent
        for k, message in enumerate(self._plan(plan, "src")):
            if len(pending) == IN_FLIGHT:
                self._wait([pending.popleft()], deadline)
            direct = self._direct(message, slices)
            pending.append(peer.send(
                [self._gather(message, slices) if direct is None else direct], 1, k))
        self._wait(list(pending), deadline)
        self.sync.fence(deadline)  # NCCL has read the pages: they may be freed after Done

    def recv(self, peer: Any, sock: socket.socket, plan: PullPlan, deadline: Deadline) -> None:
        messages, slices = self._plan(plan, "dst"), plan.slices

        def post(k: int) -> tuple[list[Segment], torch.Tensor | None, Any]:
            direct = self._direct(messages[k], slices)  # None: into a buffer, scattered here
            buf = self._buffer(messages[k], slices) if direct is None else None
            return messages[k], buf, peer.recv([direct if buf is None else buf], 0, k)

        pending = deque(post(k) for k in range(min(IN_FLIGHT, len(messages))))
        posted = len(pending)
        while pending:  # scatter each message while the next ones arrive
            message, buf, work = pending.popleft()
            self._wait([work], deadline)
            if posted < len(messages):
                pending.append(post(posted))
                posted += 1
            if buf is not None:
                self._scatter(message, slices, buf)
        self.sync.fence(deadline)  # the bytes are in the pages: the load may be reported done

    def _plan(self, plan: PullPlan, side: str) -> list[list[Segment]]:
        return plan_messages(plan.runs, side, [s.nbytes for s in plan.slices],
                             MESSAGE_BYTES[self.backend])

    def _direct(self, message: list[Segment], slices: Sequence[Slice]) -> torch.Tensor | None:
        """The KV rows themselves if ``message`` is one layer's consecutive paged blocks, whole
        pages (a contiguous range): sent or received in place, with no gather or scatter copy.
        Each side decides for itself; the peer sees the same bytes either way."""
        if len(message) != 1:
            return None
        sl, ids = slices[message[0].layer], message[0].ids
        region, first = self.regions[sl.region], ids[0]
        if sl.nbytes != region.page_bytes or first + len(ids) > region.num_blocks \
                or ids != list(range(first, first + len(ids))):
            return None
        return region.pages[first:first + len(ids)]

    def _buffer(self, message: list[Segment], slices: Sequence[Slice]) -> torch.Tensor:
        """One flat buffer for ``message``, on the KV's device."""
        nbytes = sum(len(seg.ids) * slices[seg.layer].nbytes for seg in message)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.regions[0].pages.device)

    def _parts(self, message: list[Segment], slices: Sequence[Slice],
               buf: torch.Tensor) -> list[torch.Tensor]:
        """``buf`` cut into each segment's rows ``[len(ids), slice bytes]``."""
        parts, offset = [], 0
        for seg in message:
            row = slices[seg.layer].nbytes
            parts.append(buf[offset:offset + len(seg.ids) * row].view(len(seg.ids), row))
            offset += len(seg.ids) * row
        return parts

    def _gather(self, message: list[Segment], slices: Sequence[Slice]) -> torch.Tensor:
        buf = self._buffer(message, slices)
        for seg, rows in zip(message, self._parts(message, slices, buf)):
            sl = slices[seg.layer]
            region = self.regions[sl.region]
            n, window = region.num_blocks, (sl.offset, sl.nbytes)
            if buf.device.type == "cpu":
                _host_copy(region, seg.ids, rows.data_ptr(), into_kv=False, window=window)
            elif max(seg.ids) < n:
                pages = region.pages.narrow(1, sl.offset, sl.nbytes)
                torch.index_select(pages, 0, _index(seg.ids, buf.device), out=rows)
            elif min(seg.ids) >= n:  # a staged handoff: the arena is pinned host memory
                index = _index([i - n for i in seg.ids], region.stage.device)
                rows.copy_(region.stage.narrow(1, sl.offset, sl.nbytes).index_select(0, index))
            else:  # part staged, part paged: row by row (the worker stages whole handoffs)
                for row, block in zip(rows, seg.ids):
                    row.copy_(region.rows(block, 1)[0][sl.offset:sl.offset + sl.nbytes])
        return buf

    def _scatter(self, message: list[Segment], slices: Sequence[Slice],
                 buf: torch.Tensor) -> None:
        for seg, rows in zip(message, self._parts(message, slices, buf)):
            sl = slices[seg.layer]
            region = self.regions[sl.region]
            if buf.device.type == "cpu":
                _host_copy(region, seg.ids, rows.data_ptr(), into_kv=True,
                           window=(sl.offset, sl.nbytes))
            elif max(seg.ids) < region.num_blocks:
                region.pages.narrow(1, sl.offset, sl.nbytes).index_copy_(
                    0, _index(seg.ids, buf.device), rows)
            else:  # decode has no arena today; row by row if it ever does
                for row, block in zip(rows, seg.ids):
                    region.rows(block, 1)[0][sl.offset:sl.offset + sl.nbytes].copy_(row)

    def _wait(self, works: list[Any], deadline: Deadline) -> None:
        """Wait for ``works``, each within what ``deadline`` leaves. Where ``Work.wait()`` need
        not block the host (NCCL), the op is polled until done first, so the bound holds. Gloo
        and NCCL report a timed-out op and a broken one alike (RuntimeError); a failure once the
        op's whole bound has passed is the timeout, judged by the clock rather than by the
        message's words."""
        for work in works:
            bound = deadline.left()
            started = time.monotonic()
            if not self.sync.waits_block and not poll(work.is_completed, bound):
                raise TransferTimeout(f"{deadline.what}: {self.backend} op not done within "
                                      f"{bound:.1f}s (transfer_timeout_seconds)")
            try:
                done = work.wait(_timedelta(bound))
            except RuntimeError as exc:
                if time.monotonic() - started >= bound:
                    raise TransferTimeout(f"{deadline.what}: {exc}") from None
                raise TransferFailed(f"{deadline.what}: {self.backend} transfer failed: {exc}"
                                     ) from None
            if not done:
                raise TransferTimeout(f"{deadline.what}: {self.backend} op timed out")


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    """``ids`` as an index tensor on ``device`` (from an array: 4x faster than from a list)."""
    return torch.frombuffer(array.array("q", ids), dtype=torch.long).to(device)


def block_runs(ids: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """``(first, count)`` of each run of consecutive ids, never across ``limit`` (where the
    pages end and the arena begins).

    >>> block_runs([4, 5, 6, 9, 10, 11], 10)
    [(4, 3), (9, 1), (10, 2)]
    """
    out: list[tuple[int, int]] = []
    for i in ids:
        if out and i == out[-1][0] + out[-1][1] and i != limit:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def _host_copy(region: LayerRegion, ids: Sequence[int], buf: int, into_kv: bool,
               window: tuple[int, int] | None = None) -> None:
    """Copy blocks ``ids`` of a CPU region to (or from) consecutive rows at address ``buf``;
    with ``window`` (offset, nbytes), only those bytes of each block (rows of nbytes).

    One ``memmove`` per span through ctypes, not a torch index op: a torch index kernel on CPU
    runs an OpenMP team, and with prefill's and decode's teams on shared cores every transfer
    crawled (1 MiB pulls took 7 ms instead of 0.8); ctypes also releases the GIL (see
    layout.stage_into, which copies the same way for the same reason)."""
    page, n = region.page_bytes, region.num_blocks
    offset, nbytes = window or (0, page)
    for first, count in block_runs(ids, n):
        if first < n:
            kv = region.pages.data_ptr() + first * page
        else:
            kv = region.stage.data_ptr() + (first - n) * page
        if nbytes == page:
            pieces: Iterable[tuple[int, int]] = ((kv, count * page),)
        else:
            pieces = ((kv + k * page + offset, nbytes) for k in range(count))
        for at, length in pieces:
            if into_kv:
                ctypes.memmove(at, buf, length)
            else:
                ctypes.memmove(buf, at, length)
            buf += length
