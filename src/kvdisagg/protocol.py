"""Wire messages: the handoff's kv_transfer_params and the side channel between workers.

kv_transfer_params keep vLLM NixlConnector's field names so any proxy built for it works; our own
fields live under one key, ``kvdisagg``, which proxies pass through untouched.

PROTOCOL_VERSION history:
  1: Hello / Read / Done over length-prefixed msgpack frames, one connection per pull.
  2: persistent connections (Hello once); Hello/Reply carry the transport's name and info;
     Read names decode's blocks too (transports pair the ranges); Done is one-way and ends
     every pull (prefill unpins, then frees the handoff).
  3: decode-paced leases: kv_transfer_params carry ``lease_s``; decode's scheduler keeps every
     handoff it holds alive with one-way Renew frames on a control connection (Hello with
     ``control``), so a lease runs out only when its decode stops renewing.
  4: any TP and PP on either side (sharding.py): kv_transfer_params carry ``stages`` and a port
     per prefill rank (PP-major); the fingerprint covers the model's geometry only and Hello
     carries the geometry itself (a refusal names what differs); Read names the layers and
     heads to read, Done how many readers prefill waits for; Wait frames keep a slow peer's
     waits alive (bounds measure silence, not duration);
     and KV checksums: a Read may ask for one (``checksum``: the algorithm, integrity.py); prefill
     then follows the bytes with a Checksum frame of what it sent, decode compares it with what
     landed in its blocks and says in Done whether it matched (``checksum_ok``).
  5: early handoffs: the proxy may send the decode leg together with the prefill leg, naming
     the handoff itself (``EarlyHandoff`` in prefill's request, ``early`` in decode's params,
     whose block ids and token count are then unknown); decode's Read names blocks by position
     (``first_block``) and waits at prefill until the handoff is offered; the grant (Reply)
     names prefill's blocks. Tokens are URL-safe ASCII.

Versions in common (no wire change, so still 5): an instance speaks every version from
MIN_PROTOCOL_VERSION to PROTOCOL_VERSION (``Versions``). Prefill's kv_transfer_params say which
(``version`` and ``min_version``), decode says in its Hello the highest version both speak,
and prefill accepts any version of its own range. Each instance exports its range on its
/metrics (``vllm:kvdisagg_protocol_version``, ``vllm:kvdisagg_protocol_version_min``), where
the proxy reads it and pairs only prefills and decodes with a version in common, so a fleet
in the middle of a rolling upgrade keeps serving. 5 speaks 4: a version-4 peer's frames are
5's without the fields 5 added (each has a default, and both sides ignore fields they do not
know), and an early handoff (5's one addition) is never sent to or asked of a peer below
EARLY_HANDOFF_VERSION. The range must only widen by keeping the old frames' meaning: a change
that does not (a field whose absence means something else) raises MIN_PROTOCOL_VERSION.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple

import msgspec

from kvdisagg.errors import TransferFailed
from kvdisagg.layout import KvGeometry

PROTOCOL_VERSION = 5
MIN_PROTOCOL_VERSION = 4
"""The oldest version this code still speaks (see the history above: 5 speaks 4)."""
EARLY_HANDOFF_VERSION = 5
"""Early handoffs (``early`` params, a Read by position) need this version on both sides."""
NAMESPACE = "kvdisagg"
MAX_FRAME_BYTES = 1 << 20  # control frames only; KV bytes travel outside frames

BlockId = Annotated[int, msgspec.Meta(ge=0)]
Token = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,128}$")]
"""A handoff's capability (secrets.token_urlsafe); ASCII, so hmac.compare_digest takes it."""
HandoffId = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]  # 0: no side channel (store transports)


class Versions(NamedTuple):
    """The protocol versions an instance speaks: every one from ``lo`` to ``hi``."""

    lo: int
    hi: int

    def common(self, other: Versions) -> int | None:
        """The version two instances speak to each other (the highest both speak), or None
        when they have none in common."""
        version = min(self.hi, other.hi)
        return version if version >= max(self.lo, other.lo) else None

    def __str__(self) -> str:
        return str(self.hi) if self.lo == self.hi else f"{self.lo}..{self.hi}"


SPOKEN = Versions(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)


def spoken(override: int | None = None) -> Versions:
    """What this instance speaks: ``SPOKEN``, or only ``override`` (the test-only connector
    key ``protocol_version_override``: an instance that announces another version)."""
    return SPOKEN if override is None else Versions(override, override)


class HandoffExtras(msgspec.Struct, frozen=True, kw_only=True):
    """Our fields of kv_transfer_params (under ``kvdisagg``)."""

    version: int = PROTOCOL_VERSION
    """The newest protocol version prefill speaks."""
    min_version: int = 0
    """The oldest one; 0 (params of an instance from before it was sent): ``version`` only."""
    transport: str
    kv_layout: str
    token: Token
    lease_expires: float
    lease_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 30.0
    """Lease length: decode renews each held handoff well within it."""
    ports: list[Port]
    """Side-channel port per prefill rank, PP-major (``pp_rank * tp_size + tp_rank``)."""
    stages: list[Annotated[int, msgspec.Meta(ge=0)]] = msgspec.field(default_factory=lambda: [0])
    """First layer of each of prefill's PP stages (one entry: no PP)."""
    early: bool = False
    """Sent to decode before prefill computed the handoff (the proxy's early dispatch): the
    block ids and token count are not known yet; decode reads the handoff by position."""

    def versions(self) -> Versions:
        """The protocol versions prefill speaks."""
        return Versions(self.min_version or self.version, self.version)


EARLY_PARAMS_KEY = "kvdisagg_early"
"""Key of a prefill request's ``kv_transfer_params`` naming the handoff it will offer (its id
and token chosen by the proxy, which sent the decode leg with them already)."""


class EarlyHandoff(msgspec.Struct, frozen=True, kw_only=True):
    handoff_id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{16,128}$")]
    token: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{16,128}$")]


RESUME_PARAMS_KEY = "kvdisagg_resume"
"""Key of a continuation's ``kv_transfer_params`` (the proxy's: the first token from prefill, a
migrated stream): how many of its prompt tokens are the original request's prompt, the rest
being tokens the client already got. Decode's detokenizer is then primed as the plain instance's
was after those tokens (compat/_vllm_detokenizer.py), so the next token's text is the same."""


SLO_PARAMS_KEY = "kvdisagg_slo"
"""Key of a request's ``kv_transfer_params`` carrying its RequestSlo, e.g.
``{"kvdisagg_slo": {"ttft_s": 0.5}}``: the one key a client may send there (the proxy passes it
on to prefill, validated, and drops everything else). A sibling of the ``kvdisagg`` handoff key,
not inside it: that key is the P->D wire format (HandoffExtras), written by prefill."""


class RequestSlo(msgspec.Struct, frozen=True, kw_only=True):
    """A request's own objectives (``kv_transfer_params["kvdisagg_slo"]``; unknown keys ignored)."""

    ttft_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] | None = None


class RemotePrefill(msgspec.Struct, frozen=True, kw_only=True):
    """kv_transfer_params that prefill returns and decode receives (unknown keys ignored)."""

    do_remote_prefill: bool
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: list[BlockId]
    remote_host: str
    remote_port: Port
    remote_num_tokens: Annotated[int, msgspec.Meta(ge=0)]
    tp_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    kvdisagg: HandoffExtras


def handoff_params(
    *, engine_id: str, request_id: str, block_ids: list[int], host: str, ports: list[int],
    num_tokens: int, transport: str, kv_layout: str, token: str, lease_s: float,
    stages: list[int] | None = None, versions: Versions = SPOKEN,
) -> dict[str, object]:
    """The dict prefill returns from request_finished (becomes the response's kv_transfer_params).
    ``ports``: one per rank, PP-major; ``stages``: the first layer of each PP stage;
    ``versions``: the protocol versions prefill speaks."""
    stages = list(stages or [0])
    params = RemotePrefill(
        do_remote_prefill=True, remote_engine_id=engine_id, remote_request_id=request_id,
        remote_block_ids=list(block_ids), remote_host=host, remote_port=ports[0],
        remote_num_tokens=num_tokens, tp_size=max(len(ports) // len(stages), 1),
        kvdisagg=HandoffExtras(version=versions.hi, min_version=versions.lo,
                               transport=transport, kv_layout=kv_layout, token=token,
                               lease_expires=time.time() + lease_s, lease_s=lease_s,
                               ports=list(ports), stages=stages),
    )
    out = msgspec.to_builtins(params)
    out["do_remote_decode"] = False
    return out


# ---- side channel ---------------------------------------------------------------------------


class Hello(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Decode -> prefill, first on a connection: refused unless prefill speaks the version
    and layout and transport match. ``info`` is the transport's own (e.g. nothing for tcp)."""

    version: int = PROTOCOL_VERSION
    """The version this connection speaks: the highest both sides speak (``Versions``)."""
    kv_layout: str
    transport: str = ""
    info: dict[str, Any] = {}
    control: bool = False
    """A control connection (lease renewals, releases) from decode's scheduler: no Reads, so
    the transport sets up no peer state for it."""
    geometry: KvGeometry | None = None
    """Decode's geometry, so that a refusal can name what differs (``kv_layout`` hashes it)."""


class Read(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Decode -> prefill: send these blocks of this handoff (a subset of what it holds).

    ``dst_block_ids`` (decode's blocks, same length) only shape the ranges both sides post;
    prefill never addresses memory with them."""

    handoff_id: HandoffId
    token: Token
    block_ids: list[BlockId]
    dst_block_ids: list[BlockId]
    first_block: Annotated[int, msgspec.Meta(ge=-1)] = -1
    """>= 0: an early Read (``block_ids`` empty): the handoff's blocks from this position
    on, as many as ``dst_block_ids``; prefill names them in its grant."""
    checksum: str = ""
    """Follow the bytes with a Checksum frame of this algorithm ('' = none)."""
    layers: list[Annotated[int, msgspec.Meta(ge=0)]] = []
    """The layers to read (the model's ids); empty: every layer prefill's worker holds."""
    heads: list[Annotated[int, msgspec.Meta(ge=0)]] = []
    """``[first, count]`` of the prefill worker's own heads to read; empty: all of them."""


class Checksum(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Prefill -> decode, after the bytes of a Read that asked for it: the checksum of the
    granted runs as prefill sent them (for a one-sided read, of its memory while pinned)."""

    algorithm: str
    digest: Annotated[bytes, msgspec.Meta(max_length=64)]


class Wait(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Prefill -> decode while a Read waits for its handoff (not yet offered by a busy engine):
    prefill is alive and working on it, so decode keeps waiting (bounds measure silence)."""


class Done(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Decode -> prefill, one-way, after every pull (or alone, to release without reading):
    prefill unpins and frees the handoff's blocks."""

    handoff_id: HandoffId
    token: Token
    ok: bool = True
    checksum_ok: bool = True
    """False: the bytes of this pull failed decode's checksum (prefill logs it, and frees the
    handoff all the same: the load fails on decode and the request is retried or recomputed)."""
    readers: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] = 1
    """Decode workers that read (or release) this prefill worker's part of the handoff: it is
    freed after that many Dones (sharding.py), at once with ``ok`` false (decode gave it up)."""


class HandoffRef(msgspec.Struct, array_like=True, frozen=True):
    handoff_id: HandoffId
    token: Token


class Renew(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Decode -> prefill, one-way: these handoffs are still held (queued on decode); restart
    their leases. Unknown ids and wrong tokens are ignored."""

    handoffs: list[HandoffRef]


class Reply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Prefill -> decode. For an accepted Read, ``nbytes`` of KV follow through the transport."""

    ok: bool
    error: str = ""
    kv_layout: str = ""
    nbytes: int = 0
    info: dict[str, Any] = {}
    block_ids: list[BlockId] = []
    """An early Read's grant: prefill's blocks it sends (in the Read's order)."""


Message = Hello | Read | Checksum | Done | Renew | Reply | Wait
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_header = struct.Struct("!I")


def encode_frame(msg: Message) -> bytes:
    body = _encoder.encode(msg)
    return _header.pack(len(body)) + body


def send_frame(sock: socket.socket, msg: Message) -> None:
    sock.sendall(encode_frame(msg))


def recv_frame(sock: socket.socket) -> Message:
    """Read one frame; raise TransferFailed on a closed peer, an oversized or malformed frame."""
    (size,) = _header.unpack(recv_exact(sock, _header.size))
    if size > MAX_FRAME_BYTES:
        raise TransferFailed(f"side-channel frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return _decoder.decode(recv_exact(sock, size))
    except msgspec.DecodeError as exc:
        raise TransferFailed(f"malformed side-channel frame: {exc}") from None


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise TransferFailed("peer closed the connection mid-message")
        got += k


IOV_MAX = 1024  # buffers per sendmsg/recvmsg_into call (Linux UIO_MAXIOV)
IOV_BYTES = 4 << 20  # ... and about this many bytes: more than a call moves on loopback


TimeLeft = Callable[[], float]  # seconds left of an operation's bound; raises when none


def send_views(sock: socket.socket, views: list[memoryview], left: TimeLeft) -> None:
    """Gather-write every byte of ``views`` in order: many buffers per system call, so
    scattered KV blocks cost one call per few MiB, not one per block. Each call gets what is
    left of the bound, so a peer that trickles bytes cannot stretch it."""
    views, i = list(views), 0
    while i < len(views):
        sock.settimeout(left())
        sent = sock.sendmsg(_batch(views, i))
        i = _advance(views, i, sent)


def recv_into_views(sock: socket.socket, views: list[memoryview], left: TimeLeft) -> None:
    """Scatter-read exactly ``sum(len(v))`` bytes into ``views`` in order (bounded as
    send_views).

    Measured and not kept: ``MSG_WAITALL`` on a blocking socket bounded by ``SO_RCVTIMEO``
    (one call per batch instead of one per ~64 KiB the kernel has ready) moved 1-16 MiB no
    faster on loopback; the two copies through the kernel dominate, not the Python loop."""
    views, i = list(views), 0
    while i < len(views):
        sock.settimeout(left())
        got = sock.recvmsg_into(_batch(views, i))[0]
        if got == 0:
            raise TransferFailed("peer closed the connection mid-message")
        i = _advance(views, i, got)


def _batch(views: list[memoryview], i: int) -> list[memoryview]:
    """The buffers from ``i`` for one call: a call converts every buffer it is given, so give
    it about as many as it can fill."""
    end, nbytes = i, 0
    while end < len(views) and end - i < IOV_MAX and nbytes < IOV_BYTES:
        nbytes += len(views[end])
        end += 1
    return views[i:end]


def _advance(views: list[memoryview], i: int, done: int) -> int:
    """Skip ``done`` bytes from ``views[i]`` on; return the first index not finished."""
    while i < len(views) and done >= len(views[i]):
        done -= len(views[i])
        i += 1
    if done:
        views[i] = views[i][done:]
    return i
