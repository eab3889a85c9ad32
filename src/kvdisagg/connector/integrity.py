"""KV checksums: what decode verifies before vLLM uses the blocks it received.

A pull's bytes are a stream: its CopyRuns in order (layout.py), each run's blocks of one layer.
Its checksum is a hash of that stream, so it does not depend on how either side cuts it into
buffers (prefill's views are not decode's: each side merges what is adjacent in its own
memory), and both sides compute it over their own KV memory: prefill over what it sends, decode
over what landed in its blocks.

Algorithms (``Algorithm``), chosen per pull by decode (``Read.checksum``) for its own memory:

- ``xxh3_64`` for KV in host memory: xxHash's XXH3, 64 bits, read straight from memoryviews of
  the paged KV (no copy), with the GIL released (prefill's side-channel threads must not starve
  while a serve thread hashes). 11-13 GB/s on one core here, 5x blake3 (already a vLLM
  dependency) and 6x zlib's crc32/adler32 (benchmarks/transfer.py, docs/benchmarks.md).
- ``wsum64`` for KV on a GPU: two sums over the stream's 64-bit words in device memory (the
  words, and each word times its position), two reductions per run and one sync per pull. Any
  single changed word changes it, and so does a word moved elsewhere; it is not a hash, and it
  is computed where the KV is, without a copy to the host.

A side asked for the other algorithm than its memory suits still computes it (a GPU prefill
asked for ``xxh3_64`` copies the runs to the host): a mixed pair verifies, slowly.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import xxhash

from kvdisagg.connector.layout import (
    CopyRun,
    LayerRegion,
    Slice,
    Span,
    span_tensor,
    spans,
    whole_slices,
)


class Algorithm(str, enum.Enum):
    XXH3_64 = "xxh3_64"
    WSUM64 = "wsum64"


ALGORITHMS = {a.value: a for a in Algorithm}


def digest_views(views: Iterable[Any]) -> bytes:
    """XXH3-64 of the concatenation of ``views`` (buffers: memoryview, bytearray, numpy),
    8 bytes big-endian; however the bytes are cut into views, the digest is the same."""
    h = xxhash.xxh3_64()
    for view in views:
        h.update(view)
    return h.digest()


def wsum64(tensors: Iterable[Any]) -> bytes:
    """The ``wsum64`` digest of the concatenation of ``tensors`` (contiguous, any device):
    ``(sum w_i, sum w_i * (i + 1))`` mod 2**64 over the stream's 64-bit words ``w_i``,
    16 bytes. A tail shorter than a word (a stream of odd length) counts as bytes."""
    import torch

    sums: dict[Any, list[Any]] = {}  # device -> [s1, s2]: one sync per device at the end
    offset = 0  # position of the next word in the stream
    tail = b""
    for tensor in tensors:
        raw = tensor.reshape(-1).view(torch.uint8)
        if tail or raw.numel() % 8:  # a misaligned piece: through bytes (never for KV pages)
            data = tail + bytes(raw.cpu().numpy())
            cut = len(data) - len(data) % 8
            tail = data[cut:]
            raw = torch.frombuffer(bytearray(data[:cut]), dtype=torch.uint8) if cut else None
            if raw is None:
                continue
        words = raw.view(torch.int64)
        n = words.numel()
        index = torch.arange(offset + 1, offset + n + 1, dtype=torch.int64, device=words.device)
        acc = sums.setdefault(words.device, [0, 0])
        acc[0] = acc[0] + words.sum()
        acc[1] = acc[1] + (words * index).sum()  # int64 arithmetic wraps: mod 2**64
        offset += n
    s1 = sum(int(a) for a, _ in sums.values())
    s2 = sum(int(b) for _, b in sums.values())
    for k, byte in enumerate(tail):
        s1, s2 = s1 + byte, s2 + byte * (offset + k + 1)
    mask = (1 << 64) - 1
    return struct.pack(">QQ", s1 & mask, s2 & mask)


class Digester:
    """Checksums of a pull's bytes over one worker's KV memory (pages and staging arena).

    On a GPU, ``wsum64`` reduces each span (a run of whole pages, or one block's heads): a
    pull of sub-block head windows costs a reduction per block (not gathered into one)."""

    def __init__(self, regions: Sequence[LayerRegion]) -> None:
        self.regions = list(regions)
        on_host = bool(regions) and all(r.pages.device.type == "cpu" for r in regions)
        self.native = Algorithm.XXH3_64 if on_host or not regions else Algorithm.WSUM64
        # One byte view per layer's pages and arena (host KV): sliced per run, no tensor made.
        self._host = [(_host_bytes(r.pages), _host_bytes(r.stage) if r.stage_blocks else None)
                      for r in regions] if on_host else None

    def digest(self, runs: Sequence[CopyRun], side: str, algorithm: Algorithm | None = None,
               slices: Sequence[Slice] | None = None) -> bytes:
        """The checksum of ``runs`` on this side (``"src"``: prefill, ``"dst"``: decode):
        each run's blocks of its pull layer, the bytes of ``slices`` (this side's heads of
        each pull layer; default: every layer, whole pages), in the pull's stream order."""
        algorithm = algorithm or self.native
        pieces = spans(self.regions, slices if slices is not None
                       else whole_slices(self.regions), runs, side)
        if algorithm is Algorithm.XXH3_64:
            return digest_views(self._views(pieces))
        return wsum64(span_tensor(self.regions, sp) for sp in pieces)

    def _views(self, pieces: Sequence[Span]) -> Iterable[Any]:
        if self._host is None:  # device KV asked for xxh3: through host copies
            yield from (_host_bytes(span_tensor(self.regions, sp).cpu()) for sp in pieces)
            return
        for sp in pieces:
            region = self.regions[sp.region]
            page, n = region.page_bytes, region.num_blocks
            pages, arena = self._host[sp.region]
            if sp.block >= n:
                if arena is None:
                    raise ValueError(f"block {sp.block} of layer {region.layer} is not in this "
                                     "worker's KV memory")
                buf, at = arena, (sp.block - n) * page + sp.offset
            else:
                buf, at = pages, sp.block * page + sp.offset
            if at + sp.nbytes > len(buf):
                raise ValueError(f"bytes {at}..{at + sp.nbytes} of layer {region.layer} are "
                                 "not in this worker's KV memory")
            yield buf[at:at + sp.nbytes]


def _host_bytes(tensor: Any) -> memoryview:
    return memoryview(tensor.numpy()).cast("B")


# ---- a digest stored with bytes at rest (the lmcache transport's chunks) ----------------------

_TRAILER = struct.Struct(">4sB3x16s")  # magic, algorithm code (0: none), digest (padded)
TRAILER_BYTES = _TRAILER.size
_MAGIC = b"KVDC"
_CODES = {None: 0, Algorithm.XXH3_64: 1}


def pack_trailer(digest: bytes | None) -> bytes:
    """What follows a stored value: its ``xxh3_64`` digest, or a marker saying it has none."""
    return _TRAILER.pack(_MAGIC, _CODES[Algorithm.XXH3_64 if digest else None],
                         digest or b"")


def unpack_trailer(raw: bytes | memoryview) -> bytes | None:
    """The digest a stored value carries (None: stored without one); ValueError if ``raw`` is
    not a trailer (another format under the same key)."""
    magic, code, digest = _TRAILER.unpack(bytes(raw))
    if magic != _MAGIC or code not in _CODES.values():
        raise ValueError(f"not a kvdisagg chunk trailer (magic {magic!r}, code {code})")
    return digest[:8] if code else None
