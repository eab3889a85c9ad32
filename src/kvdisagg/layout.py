"""KV geometry: which bytes a block is, and whether two workers' blocks are interchangeable.

vLLM hands each worker one tensor per attention layer, ``[num_blocks, ...]`` with one block of
one layer contiguous (CPU_ATTN: ``[num_blocks, kv_heads, block_size, 2*head_dim]``; CUDA HND is
the same shape order under ``LBHNC``). Block contents may be packed per instruction set, so blocks
move as opaque bytes between workers whose layout fingerprints match.

A pull is a list of CopyRuns (layer-major, then in the order of the handoff's blocks): both
sides derive the same list from the two block-id lists, so every transport moves the same ranges
in the same order (for tcp that is also the byte stream):

    layer 0: [b3 b4 -> d7 d8][b9 -> d2]   layer 1: [b3 b4 -> d7 d8][b9 -> d2]   ...
"""

from __future__ import annotations

import ctypes
import hashlib
import platform
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence


@dataclass(frozen=True)
class LayerRegion:
    """One layer's KV pages, then (prefill only) its staging arena: block ids ``num_blocks``..
    name arena rows, where a finished handoff's KV waits after vLLM freed its paged blocks."""

    name: str
    pages: Any  # torch.Tensor [num_blocks, page_bytes] uint8 view of the layer's KV
    page_bytes: int
    num_blocks: int
    stage: Any = None  # torch.Tensor [stage_blocks, page_bytes] uint8, or None

    @property
    def stage_blocks(self) -> int:
        return 0 if self.stage is None else self.stage.shape[0]

    def rows(self, first: int, count: int) -> Any:
        """Blocks ``first..first+count`` of this layer, wholly in the pages or in the arena."""
        if first + count <= self.num_blocks:
            return self.pages[first:first + count]
        if first >= self.num_blocks:
            return self.stage[first - self.num_blocks:first - self.num_blocks + count]
        raise ValueError(f"blocks {first}..{first + count - 1} straddle pages and arena")


def layer_regions(kv_caches: dict[str, Any]) -> list[LayerRegion]:
    """Per-layer uint8 page views of the tensors vLLM registered, in vLLM's layer order."""
    regions = []
    for name, tensor in kv_caches.items():
        if not tensor.is_contiguous():
            raise ValueError(f"KV cache of layer {name} is not contiguous; DisaggConnector "
                             "needs one contiguous range per block (layout LBHNC/HND)")
        num_blocks = tensor.shape[0]
        pages = tensor.view(-1).view(dtype=_uint8()).view(num_blocks, -1)
        regions.append(LayerRegion(name, pages, pages.shape[1], num_blocks))
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


def layout_fingerprint(*, model: str, dtype: str, block_size: int, tp_size: int,
                       kv_caches: dict[str, Any]) -> str:
    """Compatibility hash: equal only if raw blocks can be copied between the two workers."""
    parts = [f"model={model}", f"dtype={dtype}", f"block_size={block_size}", f"tp={tp_size}",
             f"machine={platform.machine()}"]
    parts += [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in kv_caches.items()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


class CopyRun(NamedTuple):
    """``count`` consecutive blocks of one layer: prefill's ``src``.. into decode's ``dst``..

    A NamedTuple, not a frozen dataclass: a pull makes one per run per layer on both sides
    before any byte moves (a thousand for 16 MiB of scattered blocks), and a frozen
    dataclass costs ~1 us each to build, a tuple ~0.15 us."""

    layer: int
    src: int
    dst: int
    count: int


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


def run_tensor(regions: Sequence[LayerRegion], run: CopyRun, side: str) -> Any:
    """The (contiguous) memory of ``run`` on this side: ``side`` is "src" or "dst"."""
    return regions[run.layer].rows(run.src if side == "src" else run.dst, run.count)


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


def run_bytes(regions: Sequence[LayerRegion], runs_: Sequence[CopyRun]) -> int:
    pages = [r.page_bytes for r in regions]
    return sum(pages[run.layer] * run.count for run in runs_)


def check_blocks(regions: Sequence[LayerRegion], block_ids: Sequence[int]) -> str:
    """'' if every id names a block of every layer, else why not (ids come off the wire)."""
    if not regions:
        return "no KV memory registered"
    limit = min(r.num_blocks + r.stage_blocks for r in regions)
    bad = [b for b in block_ids if not 0 <= b < limit]
    return f"block ids {bad[:8]} out of range (0..{limit - 1})" if bad else ""
