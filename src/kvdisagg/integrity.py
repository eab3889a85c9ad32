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

from kvdisagg.layout import CopyRun, LayerRegion


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
    """Checksums of CopyRuns over one worker's KV memory (pages and staging arena)."""

    def __init__(self, regions: Sequence[LayerRegion]) -> None:
        self.regions = list(regions)
        on_host = bool(regions) and all(r.pages.device.type == "cpu" for r in regions)
        self.native = Algorithm.XXH3_64 if on_host or not regions else Algorithm.WSUM64
        # One byte view per layer's pages and arena (host KV): sliced per run, no tensor made.
        self._host = [(_host_bytes(r.pages), _host_bytes(r.stage) if r.stage_blocks else None)
                      for r in regions] if on_host else None

    def digest(self, runs: Sequence[CopyRun], side: str,
               algorithm: Algorithm | None = None) -> bytes:
        """The checksum of ``runs`` on this side (``"src"``: prefill, ``"dst"``: decode)."""
        algorithm = algorithm or self.native
        if algorithm is Algorithm.XXH3_64:
            return digest_views(self._views(runs, side))
        return wsum64(self._tensors(runs, side))

    def _views(self, runs: Sequence[CopyRun], side: str) -> Iterable[Any]:
        if self._host is None:  # device KV asked for xxh3: through host copies
            yield from (_host_bytes(t.cpu()) for t in self._tensors(runs, side))
            return
        on_src = side == "src"
        for layer, src, dst, count in runs:
            first = src if on_src else dst
            region = self.regions[layer]
            page, n = region.page_bytes, region.num_blocks
            pages, arena = self._host[layer]
            if first + count <= n:
                yield pages[first * page:(first + count) * page]
            elif first >= n and arena is not None:
                yield arena[(first - n) * page:(first - n + count) * page]
            else:
                raise ValueError(f"blocks {first}..{first + count - 1} of layer {layer} are "
                                 "not in this worker's KV memory")

    def _tensors(self, runs: Sequence[CopyRun], side: str) -> Iterable[Any]:
        """The runs' rows in stream order, consecutive runs of one layer's pages (or arena)
        gathered into one tensor: a few reductions per layer, not per run (on a GPU, a
        thousand scattered runs would be a thousand kernel launches each)."""
        import torch

        group: list[int] = []  # block ids of the open group, in stream order
        key: tuple[int, bool] | None = None  # (layer, in the arena)
        for run in (*runs, None):
            if run is not None:
                first = run.src if side == "src" else run.dst
                region = self.regions[run.layer]
                staged = first >= region.num_blocks
                if (run.layer, staged) == key:
                    group.extend(range(first, first + run.count))
                    continue
            if key is not None:
                layer, in_arena = key
                open_region = self.regions[layer]
                base = open_region.num_blocks if in_arena else 0
                rows = open_region.stage if in_arena else open_region.pages
                if group == list(range(group[0], group[0] + len(group))):
                    yield open_region.rows(group[0], len(group))  # one range: no gather
                else:
                    ids = torch.tensor([b - base for b in group], device=rows.device)
                    yield rows.index_select(0, ids)
            if run is None:
                return
            key, group = (run.layer, staged), list(range(first, first + run.count))


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
