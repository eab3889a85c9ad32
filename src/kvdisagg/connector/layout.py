"""KV geometry: which bytes a block is, and whether two workers' blocks are interchangeable.

vLLM hands each worker one tensor per attention layer, ``[num_blocks, ...]`` with one block of
one layer contiguous (the connector asks for vLLM's ``LBHNC`` layout: per layer
``[num_blocks, kv_heads, block_size, ...]``; CPU_ATTN: ``[..., 2*head_dim]``). Block contents may
be packed per instruction set, but per head: a head's part of a block is its own contiguous
range, so whole heads move as opaque bytes between workers whose ``KvGeometry`` matches, whatever
their TP and PP (sharding.py says which heads and layers each decode rank pulls).

A pull reads some layers (global ids) and a range of heads of prefill's blocks. It is a list of
CopyRuns (pull-layer-major, then in the order of the handoff's blocks): both sides derive the
same list from the two block-id lists, so every transport moves the same ranges in the same order
(for tcp that is also the byte stream). Each side maps a CopyRun's layer to its own region and
the pull's heads to a ``Slice`` of each block (a window when TP differs, the whole page when
not)::

    layer 0: [b3 b4 -> d7 d8][b9 -> d2]   layer 1: [b3 b4 -> d7 d8][b9 -> d2]   ...

    prefill page (2 heads): [ h0 | h1 ]     decode page (1 head): [ h0 ]
    Slice(offset=head_bytes, nbytes=head_bytes) -> Slice(offset=0, nbytes=head_bytes)
"""

from __future__ import annotations

import ctypes
import hashlib
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec


@dataclass(frozen=True)
class LayerRegion:
    """One layer's KV pages, then (prefill only) its staging arena: block ids ``num_blocks``..
    name arena rows, where a finished handoff's KV waits after vLLM freed its paged blocks."""

    name: str
    pages: Any  # torch.Tensor [num_blocks, page_bytes] uint8 view of the layer's KV
    page_bytes: int
    num_blocks: int
    stage: Any = None  # torch.Tensor [stage_blocks, page_bytes] uint8, or None
    layer: int = 0  # the model's layer id (global, whatever the PP stage)
    heads: int = 1  # KV heads in each page (this rank's share)

    @property
    def stage_blocks(self) -> int:
        return 0 if self.stage is None else self.stage.shape[0]

    @property
    def head_bytes(self) -> int:
        return self.page_bytes // self.heads

    def rows(self, first: int, count: int) -> Any:
        """Blocks ``first..first+count`` of this layer, wholly in the pages or in the arena."""
        if first + count <= self.num_blocks:
            return self.pages[first:first + count]
        if first >= self.num_blocks:
            return self.stage[first - self.num_blocks:first - self.num_blocks + count]
        raise ValueError(f"blocks {first}..{first + count - 1} straddle pages and arena")


def layer_regions(kv_caches: dict[str, Any], heads: int = 0) -> list[LayerRegion]:
    """Per-layer uint8 page views of the tensors vLLM registered, in vLLM's layer order.

    ``heads``: this rank's KV heads per layer (0: read from each tensor's dim 1 under LBHNC, or
    1 for a tensor without a head dim, e.g. MLA's latent). A layer's id is the one integer in its
    name (``model.layers.3.self_attn.attn``), else its position."""
    regions = []
    for position, (name, tensor) in enumerate(kv_caches.items()):
        if not tensor.is_contiguous():
            raise ValueError(f"KV cache of layer {name} is not contiguous; DisaggConnector "
                             "needs one contiguous range per block (layout LBHNC/HND)")
        num_blocks = tensor.shape[0]
        pages = tensor.view(-1).view(dtype=_uint8()).view(num_blocks, -1)
        n = heads or (tensor.shape[1] if tensor.dim() >= 4 else 1)
        if pages.shape[1] % n:
            raise ValueError(f"KV cache of layer {name}: {pages.shape[1]}-byte pages do not "
                             f"split into {n} heads")
        numbers = [int(p) for p in name.split(".") if p.isdigit()]
        layer = numbers[0] if len(numbers) == 1 else position
        regions.append(LayerRegion(name, pages, pages.shape[1], num_blocks, layer=layer,
                                   heads=n))
    return regions


def with_arena(regions: Sequence[LayerRegion], blocks: int) -> list[LayerRegion]:
    """The regions, each with a staging arena of ``blocks`` blocks in host memory (pinned when
    the KV is on a GPU, so staging is one device-to-host copy)."""
    import dataclasses

    import torch

    pin = bool(regions) and regions[0].pages.device.type == "cuda"
    return [dataclasses.replace(r, stage=torch.empty((blocks, r.page_bytes), dtype=torch.uint8,
                                                     pin_memory=pin)) for r in regions]


def _uint8() -> Any:
    import torch

    return torch.uint8


class KvGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """What must be equal for a head of a block to move as raw bytes between two workers,
    whatever their TP and PP. Every worker of an instance has the same one."""

    model: str
    dtype: str  # the model's
    kv_dtype: str  # the KV cache's (e.g. an fp8 cache)
    block_size: int
    head_size: int
    kv_heads: int  # the model's KV heads (all TP ranks)
    layers: int  # the model's layers (all PP stages)
    head_bytes: int  # one head of one block
    machine: str = platform.machine()  # CPU blocks are packed per instruction set

    def fingerprint(self) -> str:
        """A short hash: equal only if the geometries are."""
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]

    def differences(self, other: KvGeometry, mine: str = "prefill",
                    theirs: str = "decode") -> str:
        """What differs, named: ``block_size: prefill 128, decode 16; dtype: ...`` ('' if
        nothing)."""
        return "; ".join(f"{field}: {mine} {getattr(self, field)}, {theirs} "
                         f"{getattr(other, field)}" for field in self.__struct_fields__
                         if getattr(self, field) != getattr(other, field))


def geometry_of(regions: Sequence[LayerRegion], *, model: str, dtype: str, kv_dtype: str,
                block_size: int, head_size: int, kv_heads: int, layers: int) -> KvGeometry:
    """This worker's geometry; every region must have the same head size in bytes."""
    head_bytes = {r.head_bytes for r in regions}
    if len(head_bytes) > 1:
        raise ValueError(f"KV layers of different head sizes ({sorted(head_bytes)} bytes): "
                         "DisaggConnector moves one head size per instance")
    return KvGeometry(model=model, dtype=dtype, kv_dtype=kv_dtype, block_size=block_size,
                      head_size=head_size, kv_heads=kv_heads, layers=layers,
                      head_bytes=head_bytes.pop() if head_bytes else 0)


class CopyRun(NamedTuple):
    """``count`` consecutive blocks of one layer: prefill's ``src``.. into decode's ``dst``..
    ``layer`` indexes the pull's layers (each side's Slices).

    A NamedTuple, not a frozen dataclass: a pull makes one per run per layer on both sides
    before any byte moves (a thousand for 16 MiB of scattered blocks), and a frozen
    dataclass costs ~1 us each to build, a tuple ~0.15 us."""

    layer: int
    src: int
    dst: int
    count: int  # type: ignore[assignment]  # a field named like tuple.count


def copy_runs(num_layers: int, src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[CopyRun]:
    """Pair prefill blocks with decode blocks and coalesce where both sides are consecutive.

    Both sides compute the same list from the same ids, so a two-sided transport (nccl) posts
    matching sends and receives, and a one-sided one (mooncake) gets one range per run.

    >>> [(r.src, r.dst, r.count) for r in copy_runs(1, [3, 4, 5, 9], [7, 8, 2, 3])]
    [(3, 7, 2), (5, 2, 1), (9, 3, 1)]
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    pairs: list[tuple[int, int, int]] = []
    if src_ids:
        s0, d0, n = src_ids[0], dst_ids[0], 0  # the open run; closed when either side jumps
        for s, d in zip(src_ids, dst_ids):
            if s != s0 + n or d != d0 + n:
                pairs.append((s0, d0, n))
                s0, d0, n = s, d, 0
            n += 1
        pairs.append((s0, d0, n))
    make = CopyRun._make
    return [make((layer, *pair)) for layer in range(num_layers) for pair in pairs]


class Slice(NamedTuple):
    """One pull layer on one side: ``region`` (an index into that side's regions) and the bytes
    ``offset..offset+nbytes`` of each of its blocks (the pull's heads)."""

    region: int
    offset: int
    nbytes: int


def whole_slices(regions: Sequence[LayerRegion]) -> list[Slice]:
    """Every region, whole pages: a pull of all of this worker's layers and heads."""
    return [Slice(i, 0, r.page_bytes) for i, r in enumerate(regions)]


def pull_slices(regions: Sequence[LayerRegion], layers: Sequence[int], first_head: int,
                heads: int) -> list[Slice]:
    """This side's Slice of each of ``layers`` (global ids) for heads ``first_head..``; raises
    ValueError naming what this worker does not hold (ids come off the wire)."""
    index = {r.layer: i for i, r in enumerate(regions)}
    out = []
    for layer in layers:
        i = index.get(layer)
        if i is None:
            raise ValueError(f"layer {layer} is not held here (this worker holds layers "
                             f"{sorted(index)[:4]}..{max(index, default=-1)})")
        r = regions[i]
        if first_head < 0 or heads < 1 or first_head + heads > r.heads:
            raise ValueError(f"heads {first_head}..{first_head + heads - 1} are not held here "
                             f"(this worker holds {r.heads} per layer)")
        out.append(Slice(i, first_head * r.head_bytes, heads * r.head_bytes))
    return out


class Span(NamedTuple):
    """``nbytes`` contiguous bytes of region ``region`` from ``offset`` bytes into its block
    ``block`` (a page, or an arena block from ``num_blocks`` on)."""

    region: int
    block: int
    offset: int
    nbytes: int


def spans(regions: Sequence[LayerRegion], slices: Sequence[Slice], runs: Sequence[CopyRun],
          side: str, per_block: bool = False) -> list[Span]:
    """The memory of ``runs`` on this side ("src" or "dst"), in order: one Span per run where
    the slice is a whole page (unless ``per_block``), else one per block."""
    out: list[Span] = []
    on_src = side == "src"
    for run in runs:
        sl = slices[run.layer]
        first = run.src if on_src else run.dst
        if not per_block and sl.nbytes == regions[sl.region].page_bytes:
            out.append(Span(sl.region, first, 0, sl.nbytes * run.count))
        else:
            out.extend(Span(sl.region, b, sl.offset, sl.nbytes)
                       for b in range(first, first + run.count))
    return out


def span_tensor(regions: Sequence[LayerRegion], span: Span) -> Any:
    """A span's memory as a flat uint8 tensor view."""
    r = regions[span.region]
    count = -(-(span.offset + span.nbytes) // r.page_bytes)
    return r.rows(span.block, count).reshape(-1)[span.offset:span.offset + span.nbytes]


def stage_into(regions: Sequence[LayerRegion], block_ids: Sequence[int],
               slots: Sequence[int]) -> None:
    """Copy the pages ``block_ids`` of every layer into arena blocks ``slots`` (ids from
    ``num_blocks`` on): prefill's paged blocks are then free to reuse.

    On CPU, one ``memmove`` per run of consecutive blocks, through ctypes, which releases the
    GIL: a torch copy holds it for the whole copy and runs an OpenMP team, and on a host whose
    instances share cores that team crawls, so the side-channel threads of this process (Hello
    replies, Reads) starved behind it until decode's pulls timed out. On a GPU, one gather and
    one device-to-host copy per layer.
    """
    if not regions:
        return
    if regions[0].pages.device.type == "cpu":
        for run in copy_runs(len(regions), block_ids, slots):
            r = regions[run.layer]
            src, dst = r.rows(run.src, run.count), r.rows(run.dst, run.count)
            if src.shape[0] != run.count or dst.shape[0] != run.count:
                raise ValueError(f"staging blocks {run.src}.. into {run.dst}..: out of range")
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), r.page_bytes * run.count)
        return
    import torch

    base = regions[0].num_blocks
    src_ids = torch.tensor(block_ids, dtype=torch.long)
    dst_ids = torch.tensor([s - base for s in slots], dtype=torch.long)
    for r in regions:
        r.stage.index_copy_(0, dst_ids, r.pages.index_select(
            0, src_ids.to(r.pages.device)).to(r.stage.device))


def run_bytes(slices: Sequence[Slice], runs_: Sequence[CopyRun]) -> int:
    return sum(slices[run.layer].nbytes * run.count for run in runs_)


def check_blocks(regions: Sequence[LayerRegion], block_ids: Sequence[int]) -> str:
    """'' if every id names a block of every layer, else why not (ids come off the wire)."""
    if not regions:
        return "no KV memory registered"
    limit = min(r.num_blocks + r.stage_blocks for r in regions)
    bad = [b for b in block_ids if not 0 <= b < limit]
    return f"block ids {bad[:8]} out of range (0..{limit - 1})" if bad else ""
