"""The side channel's wire frames between a decode worker and a prefill worker: msgspec Structs
in one tagged union (``Message``), sent as length-prefixed msgpack frames.

Which frames each version has, and how a release speaks older peers' frames: versions.py. The
handoff a frame names (its id, token and blocks) is the one kv_transfer_params announced
(params.py). KV bytes never travel in frames (sockets.py, the transports).
"""

from __future__ import annotations

import socket
import struct
from typing import Annotated, Any

import msgspec

from kvdisagg.connector.layout import KvGeometry
from kvdisagg.connector.protocol.params import BlockId, Token
from kvdisagg.connector.protocol.sockets import recv_exact
from kvdisagg.connector.protocol.versions import PROTOCOL_VERSION
from kvdisagg.errors import TransferFailed

MAX_FRAME_BYTES = 1 << 20  # control frames only; KV bytes travel outside frames

HandoffId = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]


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
    freed after that many Dones (connector/sharding.py), at once with ``ok`` false (decode gave
    it up)."""


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
