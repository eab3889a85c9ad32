"""Side-channel messages of protocol version 4, as release 4 defined them (src/kvdisagg/protocol.py
at commit 2513288, docstrings left out): what a peer of that release encodes and decodes, so
tests can check that this release speaks 4 (tests/unit/connector/protocol/test_frames.py: the
frames; tests/unit/transport/test_pull.py: a pull over a real socket). Release 4's frames are
in kvdisagg/connector/protocol/frames.py now."""

from __future__ import annotations

from typing import Any

import msgspec

from kvdisagg.connector.layout import KvGeometry


class V4Hello(msgspec.Struct, tag="Hello", frozen=True, kw_only=True):
    version: int = 4
    kv_layout: str
    transport: str = ""
    info: dict[str, Any] = {}
    control: bool = False
    geometry: KvGeometry | None = None


class V4Read(msgspec.Struct, tag="Read", frozen=True, kw_only=True):
    handoff_id: str
    token: str
    block_ids: list[int]
    dst_block_ids: list[int]
    checksum: str = ""
    layers: list[int] = []
    heads: list[int] = []


class V4Checksum(msgspec.Struct, tag="Checksum", frozen=True, kw_only=True):
    algorithm: str
    digest: bytes


class V4Wait(msgspec.Struct, tag="Wait", frozen=True, kw_only=True):
    pass


class V4Done(msgspec.Struct, tag="Done", frozen=True, kw_only=True):
    handoff_id: str
    token: str
    ok: bool = True
    checksum_ok: bool = True
    readers: int = 1


class V4HandoffRef(msgspec.Struct, array_like=True, frozen=True):
    handoff_id: str
    token: str


class V4Renew(msgspec.Struct, tag="Renew", frozen=True, kw_only=True):
    handoffs: list[V4HandoffRef]


class V4Reply(msgspec.Struct, tag="Reply", frozen=True, kw_only=True):
    ok: bool
    error: str = ""
    kv_layout: str = ""
    nbytes: int = 0
    info: dict[str, Any] = {}


V4Message = V4Hello | V4Read | V4Checksum | V4Done | V4Renew | V4Reply | V4Wait
