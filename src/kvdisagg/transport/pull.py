"""Pull transports: prefill keeps the blocks, decode reads them, then prefill frees them.

The control path is the same for every pull transport: a side channel (TCP, length-prefixed
msgpack frames, connector/protocol/frames.py) between each decode worker and each prefill worker
it reads from, opened once and kept:

    decode                               prefill
    Hello(version, layout,          ->   check (a refusal names what differs); Reply(info)
          geometry, transport, info)     (once per connection; a transport may set up a peer
                                         here: nccl joins a group)
    Read(handoff, token, blocks,    ->   pin the handoff if the token and blocks are its own
         layers, heads, checksum)   <-   Wait, Wait, ...  (while the handoff is not offered yet)
                                    <-   Reply(nbytes)
           ... the bytes move: send()/recv() of the subclass (tcp inline, nccl send/recv,
               mooncake a one-sided read of the memory advertised in the Hello reply) ...
                                    <-   Checksum(digest of what it sent)   (if asked)
    Done(handoff, token, readers,   ->   unpin; free once ``readers`` Dones came  (one-way)
         checksum_ok)

A decode worker reads the layers and heads its Part names (connector/sharding.py) from each
prefill worker it needs; a Part with no layers only sends Done (a replica no decode worker reads).

Checksums (connector/integrity.py) are computed here for every pull transport, over each side's
own KV memory (the spans of its layers and heads, in stream order): prefill after its send()
(for a one-sided read, while decode reads the pinned blocks), decode after its recv(), before it
reads prefill's frame, so the two hash at once. A mismatch fails the pull with ChecksumMismatch
after Done (prefill frees the handoff; the load is reported failed and vLLM's
kv_load_failure_policy applies).

Decode's scheduler keeps the handoffs it holds alive over a control connection of its own
(Hello with ``control``; no transport peer is set up for it):

    Renew([(handoff, token), ...])  ->   restart their leases            (one-way, periodic)
    Done(handoff, token)            ->   free without reading            (the request went away)

A decode worker keeps a small pool of connections per prefill worker: each pull owns one
connection from checkout to checkin, so concurrent pulls never share a socket.

Versions: a Hello speaks the version decode's scheduler chose for the handoff (``Fetch.version``:
the highest both instances speak, protocol.Versions); prefill accepts any version it speaks
(``protocol_version_override`` narrows that to one, for tests) and refuses others naming its
range. Pooled connections are kept per version.

Bounds measure liveness, not duration (``Silence``): every wait on the side channel and on the
data path ends when the peer has been silent for ``transfer_timeout_seconds``, however long the
whole pull takes while bytes (or Wait frames) keep coming. A killed peer is an error at once (its
connections reset), a stopped or unreachable one after that much silence.

Subclasses override the data-path hooks below; everything else (auth, leases, pinning, bounds,
connection reuse, errors) is here once.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from kvdisagg.connector.config import ConnectorConfig
from kvdisagg.connector.integrity import ALGORITHMS, Digester
from kvdisagg.connector.layout import (
    CopyRun,
    KvGeometry,
    LayerRegion,
    Slice,
    check_blocks,
    copy_runs,
    pull_slices,
    run_bytes,
    whole_slices,
)
from kvdisagg.connector.protocol.frames import (
    Checksum,
    Done,
    Hello,
    Read,
    Renew,
    Reply,
    Wait,
    encode_frame,
    recv_frame,
    send_frame,
)
from kvdisagg.connector.protocol.versions import spoken
from kvdisagg.connector.threads import start_thread
from kvdisagg.errors import (
    ChecksumMismatch,
    IncompatiblePeerError,
    PeerUnreachable,
    TransferFailed,
    TransferTimeout,
    TransportError,
)
from kvdisagg.tracing import Tracer, now_ns
from kvdisagg.transport.base import Fetch, Offer, PullTiming
from kvdisagg.transport.handoffs import HandoffTable

logger = logging.getLogger(__name__)

IDLE_CONNECTION_S = 600.0  # prefill drops a side-channel connection idle this long
POOLED_PER_PEER = 8  # idle connections decode keeps per prefill worker (one per pull thread)
SLOW_HANDSHAKE_S = 5.0  # a Hello answered later than this is logged (a starved or busy peer)


class Deadline:
    """One bound for a whole operation, handed out piecewise to each blocking call (used where
    the peer's liveness cannot be seen: a store that does not hold a chunk yet)."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds, self.what = seconds, what
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"{self.what} exceeded {self.seconds:.1f}s")
        return left


class Silence(Deadline):
    """A bound on the peer's silence, not on the operation: each blocking call gets the whole
    of it, so a pull goes on as long as the peer keeps sending (a slow, live peer never times
    out; a stopped one does, after ``seconds`` without a byte)."""

    def left(self) -> float:
        return self.seconds


class PullPlan(NamedTuple):
    """One Read as one side moves it: the runs, this side's Slice of each pull layer, the
    layers (the model's ids, in pull order) and ``(first, count)`` of prefill's own heads."""

    runs: list[CopyRun]
    slices: list[Slice]
    layers: tuple[int, ...]
    heads: tuple[int, int]


_PeerKey = tuple[str, int, int]  # a prefill worker's (host, port) and the version spoken


@dataclass
class _Connection:
    """Decode's side of one side-channel connection (owned by one pull at a time)."""

    sock: socket.socket
    peer: Any  # the subclass's per-connection state (open_client)
    uses: int = 0


class PullTransport:
    name: ClassVar[str] = ""
    keyed_by_tokens: ClassVar[bool] = False
    # Set by the worker (instrument): prefill's serve spans go to its tracer, their durations
    # to its stats.
    tracer: Tracer = Tracer.disabled()
    observe: Callable[[str, float], None] = staticmethod(lambda phase, seconds: None)

    def __init__(self, config: ConnectorConfig, tp_rank: int = 0) -> None:
        self.config, self.tp_rank = config, tp_rank
        self.rank = tp_rank  # this worker's rank in its instance (PP-major); set by register
        self.regions: list[LayerRegion] = []
        self.kv_layout = ""
        self.geometry: KvGeometry | None = None
        self.table = HandoffTable()
        self.versions = spoken(config.protocol_version_override)  # what prefill accepts
        self._listener: socket.socket | None = None
        self._closed = False
        self._idle: dict[_PeerKey, list[_Connection]] = {}
        self._conns_lock = threading.Lock()
        self._traces: dict[str, str] = {}  # prefill: handoff -> its traceparent, while held

    # ---- data-path hooks (override) ------------------------------------------------------
    def attach(self, regions: Sequence[LayerRegion], is_producer: bool) -> None:
        """Both sides, once: the worker's KV memory is known (register it with an engine)."""

    def server_info(self) -> dict[str, Any]:
        """Prefill: the transport's part of the Hello reply on a new connection."""
        return {}

    def client_info(self) -> dict[str, Any]:
        """Decode: the transport's part of Hello."""
        return {}

    def open_server(self, sock: socket.socket, info: dict[str, Any], sent: dict[str, Any]) -> Any:
        """Prefill, after replying to Hello (``sent`` is what server_info gave): per-connection
        state, e.g. a process group with this decode worker."""
        return None

    def open_client(self, sock: socket.socket, info: dict[str, Any], deadline: Deadline) -> Any:
        """Decode, after the Hello reply: per-connection state."""
        return None

    def close_peer(self, peer: Any) -> None:
        """Either side: a connection's state is no longer needed."""

    def send(self, peer: Any, sock: socket.socket, plan: PullPlan, deadline: Deadline,
             grant: bytes) -> None:
        """Prefill, for a granted Read: write ``grant`` (the encoded Reply) to ``sock``, then
        deliver the plan's runs (or nothing, for one-sided reads). Inline data may go in the
        same system call as the grant."""
        sock.sendall(grant)

    def recv(self, peer: Any, sock: socket.socket, plan: PullPlan, deadline: Deadline) -> None:
        """Decode, for a granted Read: fill the local side of the plan's runs."""
        raise NotImplementedError

    # ---- Transport ------------------------------------------------------------------------
    def register(self, regions: Sequence[LayerRegion], *, kv_layout: str, block_size: int,
                 is_producer: bool, geometry: KvGeometry | None = None,
                 rank: int | None = None, shape: Any = None) -> int:
        """``rank``: this worker's rank in its instance (PP-major); a fixed
        ``side_channel_port`` is that of rank 0, rank r listens on port + r."""
        self.regions, self.kv_layout, self.geometry = list(regions), kv_layout, geometry
        self.digester = Digester(self.regions)
        if rank is not None:
            self.rank = rank
        self.attach(self.regions, is_producer)
        if not is_producer:
            return 0
        port = self.config.side_channel_port
        self._listener = socket.create_server(
            (self.config.side_channel_host, port + self.rank if port else 0), backlog=64)
        start_thread(self._accept_loop, f"kvdisagg-{self.name}-accept")
        return self._listener.getsockname()[1]

    def instrument(self, tracer: Tracer, observe: Callable[[str, float], None]) -> None:
        self.tracer, self.observe = tracer, observe

    def step(self, running: bool) -> None:
        """Prefill's worker: an engine step started (``running``) or ended."""
        self.table.step(running)

    def expired_unread(self) -> int:
        return self.table.expired_unread

    def offer(self, offer: Offer) -> bool:
        if not self.table.add(offer.handoff_id, offer.token, offer.block_ids, offer.lease_s):
            return False
        if offer.trace:
            self._traces[offer.handoff_id] = offer.trace
        return True

    def expect(self, handoff_id: str, token: str) -> None:
        self.table.expect(handoff_id, token)

    def forget(self, handoff_id: str, why: str) -> None:
        self.table.forget(handoff_id, why)

    def take_released(self) -> set[str]:
        released = self.table.take_finished()
        for handoff_id in released:
            self._traces.pop(handoff_id, None)
        return released

    def fetch(self, fetch: Fetch, timeout_s: float, timing: PullTiming | None = None) -> int:
        """``timeout_s`` bounds prefill's silence, not the pull (Silence)."""
        deadline = Silence(timeout_s, f"pull of handoff {fetch.handoff_id} from "
                                      f"{fetch.host}:{fetch.port}")
        key = (fetch.host, fetch.port, fetch.version)
        # A pooled connection may have died since its last use (prefill restarted): drop the
        # pool and retry once on a fresh connection, before anything was granted.
        for attempt in (0, 1):
            conn = self._checkout(key, deadline)
            reused = conn.uses > 0
            conn.uses += 1
            if timing is not None:
                timing.marks.clear()  # a retry's connect includes the stale attempt
                timing.reused = reused
                timing.mark("connect")
            try:
                nbytes = self._pull(conn, fetch, deadline, timing)
            except _StaleConnection as exc:
                self._close_connection(conn)
                self._drop_idle(key)
                if attempt or not reused:
                    raise TransferFailed(f"{deadline.what}: {exc}") from None
                continue
            except BaseException:
                self._close_connection(conn)
                raise
            self._checkin(key, conn)
            return nbytes
        raise AssertionError("unreachable")

    def close(self) -> None:
        # shutdown() wakes the thread blocked in accept(); close() alone would leave the
        # listening socket accepting until that call returns.
        self._closed = True
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for key in list(self._idle):
            self._drop_idle(key)

    # ---- decode side ----------------------------------------------------------------------
    def _checkout(self, key: _PeerKey, deadline: Deadline) -> _Connection:
        """An idle pooled connection to ``key``, or a new one: the caller owns it."""
        with self._conns_lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop()
        return self._open(key, deadline)

    def _checkin(self, key: _PeerKey, conn: _Connection) -> None:
        with self._conns_lock:
            idle = self._idle.setdefault(key, [])
            if not self._closed and len(idle) < POOLED_PER_PEER:
                idle.append(conn)
                return
        self._close_connection(conn)

    def _drop_idle(self, key: _PeerKey) -> None:
        with self._conns_lock:
            idle = self._idle.pop(key, [])
        for conn in idle:
            self._close_connection(conn)

    def _open(self, key: _PeerKey, deadline: Deadline) -> _Connection:
        host, port, version = key
        try:
            sock = socket.create_connection((host, port), timeout=deadline.left())
        except TransferTimeout:
            raise
        except OSError as exc:
            raise PeerUnreachable(f"prefill side channel {host}:{port} unreachable: {exc}"
                                  ) from None
        start = time.monotonic()
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(deadline.left())
            send_frame(sock, Hello(version=version, kv_layout=self.kv_layout,
                                   transport=self.name, info=self.client_info(),
                                   geometry=self.geometry))
            reply = recv_frame(sock)
            if not isinstance(reply, Reply):
                raise TransferFailed(f"prefill {host}:{port} answered Hello with {reply!r}")
            if not reply.ok:
                raise IncompatiblePeerError(f"prefill {host}:{port} refused: {reply.error}")
            peer = self.open_client(sock, reply.info, deadline)
        except BaseException as exc:
            sock.close()
            if isinstance(exc, socket.timeout):
                raise TransferTimeout(f"{deadline.what}: prefill accepted the connection but "
                                      f"said nothing for {deadline.seconds:.1f}s (stopped, or "
                                      "its side channel is not served)") from None
            if isinstance(exc, OSError):
                raise TransferFailed(f"handshake with {host}:{port} broke: {exc}") from None
            raise
        if (took := time.monotonic() - start) > SLOW_HANDSHAKE_S:
            logger.warning("kvdisagg: handshake with prefill %s:%d took %.1fs", host, port, took)
        return _Connection(sock, peer)

    def _close_connection(self, conn: _Connection) -> None:
        try:
            self.close_peer(conn.peer)
        finally:
            conn.sock.close()

    def _pull_plan(self, fetch: Fetch, remote: Sequence[int] | None = None) -> PullPlan | None:
        """What decode reads: the fetch's Part (its layers this worker holds, its heads), or
        every layer and head (a Fetch without a Part: both sides sharded alike). None: the
        Part only releases. ``remote``: the prefill blocks to pair decode's with, instead of
        the fetch's (an early fetch names none until prefill's grant)."""
        if fetch.part is None:
            layers = tuple(r.layer for r in self.regions)
            slices, heads = whole_slices(self.regions), (0, 0)
        else:
            held = {r.layer for r in self.regions}
            layers = tuple(layer for layer in fetch.part.layers if layer in held)
            if not layers:
                return None
            heads = (fetch.part.src_head, fetch.part.heads)
            try:
                slices = pull_slices(self.regions, layers, fetch.part.dst_head, fetch.part.heads)
            except ValueError as exc:
                raise TransferFailed(f"decode cannot take its part: {exc}") from None
        runs = copy_runs(len(layers), fetch.remote_block_ids if remote is None else remote,
                         fetch.local_block_ids)
        return PullPlan(runs, slices, layers, heads)

    def _pull(self, conn: _Connection, fetch: Fetch, deadline: Deadline,
              timing: PullTiming | None) -> int:
        sock, where = conn.sock, f"prefill {fetch.host}:{fetch.port}"
        if fetch.kv_layout != self.kv_layout:
            raise IncompatiblePeerError(f"handoff kv_layout {fetch.kv_layout} != decode's "
                                        f"{self.kv_layout}")
        if error := check_blocks(self.regions, fetch.local_block_ids):
            raise TransferFailed(f"decode's {error}")
        # Early: prefill's blocks come with its grant; until then the plan names the layers
        # and heads to ask for (its runs, paired with decode's own ids for now, are redone
        # from the grant).
        plan = (self._pull_plan(fetch, fetch.local_block_ids if fetch.early else None)
                if fetch.local_block_ids else None)
        try:
            nbytes, mismatch = 0, ""
            if plan is not None:
                algorithm = self.digester.native if self.config.kv_checksum else None
                sock.settimeout(deadline.left())
                try:
                    send_frame(sock, Read(handoff_id=fetch.handoff_id, token=fetch.token,
                                          block_ids=[] if fetch.early
                                          else list(fetch.remote_block_ids),
                                          first_block=fetch.first_block if fetch.early else -1,
                                          dst_block_ids=list(fetch.local_block_ids),
                                          checksum=algorithm.value if algorithm else "",
                                          layers=list(plan.layers),
                                          heads=list(plan.heads) if plan.heads[1] else []))
                    reply = recv_frame(sock)
                except TimeoutError:
                    raise
                except (OSError, TransferFailed) as exc:
                    raise _StaleConnection(str(exc)) from None
                while isinstance(reply, Wait):  # prefill is alive; its engine has not
                    reply = recv_frame(sock)    # offered the handoff yet
                if not isinstance(reply, Reply):
                    raise TransferFailed(f"{where} answered {reply!r}")
                if not reply.ok:
                    raise TransferFailed(f"{where} refused the read: {reply.error}")
                if fetch.early:  # prefill's blocks, which only its grant names
                    if len(reply.block_ids) != len(fetch.local_block_ids):
                        raise TransferFailed(f"{where} granted {len(reply.block_ids)} blocks "
                                             f"for {len(fetch.local_block_ids)}")
                    plan = plan._replace(runs=copy_runs(len(plan.layers), reply.block_ids,
                                                        fetch.local_block_ids))
                nbytes = run_bytes(plan.slices, plan.runs)
                if nbytes != reply.nbytes:
                    raise IncompatiblePeerError(f"{where} sends {reply.nbytes} bytes, "
                                                f"decode expects {nbytes}")
                if timing is not None:
                    timing.mark("read")
                self.recv(conn.peer, sock, plan, deadline)
                if algorithm is not None:
                    mismatch = self._verify(sock, plan, algorithm, deadline, fetch, where)
                if timing is not None:
                    timing.mark("transfer")
            sock.settimeout(deadline.left())
            send_frame(sock, Done(handoff_id=fetch.handoff_id, token=fetch.token,
                                  checksum_ok=not mismatch,
                                  readers=fetch.part.readers if fetch.part else 1))
            if timing is not None:
                timing.mark("done")
            if mismatch:
                raise ChecksumMismatch(mismatch)
            return nbytes
        except TimeoutError:
            raise TransferTimeout(f"{deadline.what}: prefill silent for "
                                  f"{deadline.seconds:.1f}s") from None
        except TransportError:
            raise
        except OSError as exc:
            raise TransferFailed(f"pull from {where} broke: {exc}") from None

    def _verify(self, sock: socket.socket, plan: PullPlan, algorithm: Any,
                deadline: Deadline, fetch: Fetch, where: str) -> str:
        """Decode: hash what landed, then read prefill's checksum; '' if they match, else
        what to report (the handoff, the peer, both digests)."""
        mine = self.digester.digest(plan.runs, "dst", algorithm, plan.slices)
        sock.settimeout(deadline.left())
        theirs = recv_frame(sock)
        if not isinstance(theirs, Checksum) or theirs.algorithm != algorithm.value:
            raise TransferFailed(f"{where} answered a Read asking for a {algorithm.value} "
                                 f"checksum with {theirs!r}")
        if theirs.digest == mine:
            return ""
        return (f"KV checksum mismatch pulling handoff {fetch.handoff_id} from {where}: "
                f"{algorithm.value} {theirs.digest.hex()} sent, {mine.hex()} received "
                f"({run_bytes(plan.slices, plan.runs)} bytes into decode blocks "
                f"{list(fetch.local_block_ids)[:8]}...); the load fails")

    # ---- prefill side ---------------------------------------------------------------------
    def _accept_loop(self) -> None:
        """Accept until closed. An error of one pending connection (Linux passes a connection
        reset before accept() as accept's error) or a transient shortage (file descriptors,
        threads) must not end the loop: a prefill worker whose listener stopped accepting would
        look alive and answer no decode again."""
        assert self._listener is not None
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                logger.warning("kvdisagg: side channel accept failed (%s); still accepting", exc)
                time.sleep(0.05)
                continue
            try:
                start_thread(self._serve, f"kvdisagg-{self.name}-serve", sock,
                             time.monotonic())
            except RuntimeError as exc:  # can't start new thread
                logger.error("kvdisagg: cannot serve a side-channel connection: %s", exc)
                sock.close()
                time.sleep(0.05)

    def _serve(self, sock: socket.socket, accepted: float) -> None:
        peer = None
        timeout = self.config.transfer_timeout_seconds
        try:
            with sock:
                started = time.monotonic()
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(timeout)
                hello = recv_frame(sock)
                received = time.monotonic()
                error = self._check_hello(hello)
                info = {} if error else self.server_info()
                send_frame(sock, Reply(ok=not error, error=error, kv_layout=self.kv_layout,
                                       info=info))
                if (done := time.monotonic()) - accepted > SLOW_HANDSHAKE_S:
                    logger.warning("kvdisagg: a Hello took %.1fs to answer (serving thread "
                                   "started %.1fs after accept, Hello read %.1fs later, reply "
                                   "%.1fs later)", done - accepted, started - accepted,
                                   received - started, done - received)
                if error:
                    return
                assert isinstance(hello, Hello)
                control = hello.control
                if not control:
                    if _hung_up(sock):
                        return  # decode gave up on this Hello while we were stopped or busy
                    peer = self.open_server(sock, hello.info, info)
                while not self._closed:
                    sock.settimeout(IDLE_CONNECTION_S)
                    msg = recv_frame(sock)
                    sock.settimeout(timeout)
                    if control and isinstance(msg, Read):
                        send_frame(sock, Reply(ok=False, error="Read on a control connection"))
                        continue
                    self._handle(peer, sock, msg)
        except (OSError, TransportError) as exc:
            logger.debug("kvdisagg: side-channel connection ended: %s", exc)
        finally:
            if peer is not None:
                self.close_peer(peer)

    def _check_hello(self, msg: object) -> str:
        if not isinstance(msg, Hello):
            return f"expected Hello, got {type(msg).__name__}"
        if not self.versions.lo <= msg.version <= self.versions.hi:
            return (f"protocol version {msg.version}: prefill speaks {self.versions} (an "
                    "instance of another release: the proxy pairs only instances with a "
                    "version in common, docs/operations.md#rolling-upgrades)")
        if msg.transport != self.name:
            return f"transport {msg.transport!r} != prefill's {self.name!r}"
        if msg.kv_layout != self.kv_layout:
            what = (self.geometry.differences(msg.geometry)
                    if self.geometry is not None and msg.geometry is not None else "")
            return (f"KV layouts differ: {what or 'fingerprint prefill ' + self.kv_layout}"
                    f"{'' if what else ', decode ' + msg.kv_layout} (model, dtype, KV dtype, "
                    "block size, head size, KV heads, layers and CPU kind must match; TP and "
                    "PP may differ)")
        return ""

    def _read_plan(self, read: Read, blocks: Sequence[int] | None = None
                   ) -> tuple[PullPlan | None, str]:
        """Prefill's side of a Read: the layers and heads it names, checked against what this
        worker holds (ids come off the wire). ``blocks``: the handoff's blocks an early Read
        gets (by position), instead of the ids it names."""
        src = list(read.block_ids if blocks is None or read.first_block < 0 else blocks)
        if error := check_blocks(self.regions, src):
            return None, error
        if len(read.dst_block_ids) != len(src):
            return None, f"{len(src)} blocks to read into {len(read.dst_block_ids)}"
        if len(read.heads) not in (0, 2):
            return None, f"heads {read.heads}: expected [first, count]"
        try:
            if read.layers or read.heads:
                layers = read.layers or [r.layer for r in self.regions]
                first, count = read.heads or (0, self.regions[0].heads)
                slices = pull_slices(self.regions, layers, first, count)
            else:
                layers, slices = [r.layer for r in self.regions], whole_slices(self.regions)
        except ValueError as exc:
            return None, str(exc)
        heads = (slices[0].offset // self.regions[slices[0].region].head_bytes,
                 slices[0].nbytes // self.regions[slices[0].region].head_bytes) if slices \
            else (0, 0)
        return PullPlan(copy_runs(len(slices), src, read.dst_block_ids), slices,
                        tuple(layers), heads), ""

    def _handle(self, peer: Any, sock: socket.socket, msg: object) -> None:
        match msg:
            case Read(handoff_id=rid, token=token, checksum=checksum, first_block=first):
                start_ns = now_ns()
                early = first >= 0
                error = ""
                if early and msg.block_ids:
                    error = "a Read by position (first_block) names no block ids"
                if not error and checksum and checksum not in ALGORITHMS:
                    error = (f"unknown checksum algorithm {checksum!r} (prefill knows "
                             f"{sorted(ALGORITHMS)})")
                plan: PullPlan | None = None
                if not error and not early:
                    plan, error = self._read_plan(msg)  # checked before waiting
                src: tuple[int, ...] = ()
                if not error:
                    # A Read may come before the worker learnt of its handoff (that arrives in
                    # the next engine step's metadata, late on a busy host; an early Read comes
                    # before prefill computed it): it waits while the handoff may still come,
                    # telling decode it is alive (Wait) meanwhile.
                    error, src = self.table.pin(
                        rid, token, msg.block_ids, self.config.transfer_timeout_seconds,
                        keepalive=lambda: send_frame(sock, Wait()), first_block=first,
                        count=len(msg.dst_block_ids),
                        early_grace_s=self.config.transfer_timeout_seconds)
                pinned_ns = now_ns()
                if error:
                    send_frame(sock, Reply(ok=False, error=error))
                    return
                try:
                    if plan is None:  # an early Read: the blocks are known now
                        plan, error = self._read_plan(msg, src)
                        if error:
                            send_frame(sock, Reply(ok=False, error=error))
                            return
                    assert plan is not None
                    deadline = Silence(self.config.transfer_timeout_seconds,
                                       f"serving handoff {rid}")
                    self.send(peer, sock, plan, deadline, encode_frame(
                        Reply(ok=True, nbytes=run_bytes(plan.slices, plan.runs),
                              block_ids=list(src) if early else [])))
                    # One-sided reads happen now; the pin holds until decode says Done.
                    if checksum:
                        algorithm = ALGORITHMS[checksum]
                        digest = self.digester.digest(plan.runs, "src", algorithm,
                                                      plan.slices)
                        sock.settimeout(deadline.left())
                        send_frame(sock, Checksum(algorithm=checksum, digest=digest))
                    sock.settimeout(deadline.left())
                    done = recv_frame(sock)
                    if isinstance(done, Done) and not done.checksum_ok:
                        logger.warning("kvdisagg: decode %s received handoff %s corrupted (%s "
                                       "checksum mismatch); freeing it, decode fails the load",
                                       _peer_name(sock), rid, checksum)
                    if isinstance(done, Done) and done.handoff_id == rid:
                        if self.table.release(rid, done.token, done.readers,
                                              force=not done.ok):
                            end_ns = now_ns()
                            self.observe("serve", (end_ns - start_ns) / 1e9)
                            self.tracer.record("kvdisagg.serve", self._traces.get(rid, ""),
                                               start_ns, end_ns, {
                                                   "kvdisagg.handoff": rid,
                                                   "kvdisagg.pin_wait_ms":
                                                       (pinned_ns - start_ns) / 1e6})
                    else:
                        raise TransferFailed(f"expected Done for {rid}, got {done!r}")
                finally:
                    self.table.unpin(rid)
            case Done(handoff_id=rid, token=token, ok=ok, readers=readers):
                if not self.table.release(rid, token, readers, force=not ok):
                    logger.warning("kvdisagg: Done for unknown handoff %s (or wrong token)", rid)
            case Renew(handoffs=refs):
                self.table.renew([(r.handoff_id, r.token) for r in refs])
            case _:
                send_frame(sock, Reply(ok=False, error=f"unexpected {type(msg).__name__}"))


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "(gone)"


def _hung_up(sock: socket.socket) -> bool:
    """The peer closed its end (EOF waiting, nothing else): setting up a transport peer for
    it (nccl: a group formation that blocks until its timeout) would be wasted."""
    poller = select.poll()  # not select(): a vLLM process may hold fds past FD_SETSIZE
    poller.register(sock, select.POLLIN)
    if not poller.poll(0):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class _StaleConnection(Exception):
    """The connection broke before prefill granted anything: safe to retry on a new one."""
