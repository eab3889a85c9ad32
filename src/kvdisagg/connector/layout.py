"""KV geometry: which bytes a block is, and whether two workers' blocks are interchangeable.

vLLM hands each worker one tensor per attention layer, ``[num_blocks, ...]`` with one block of
one layer contiguous (CPU_ATTN: ``[num_blocks, kv_heads, block_size, 2*head_dim]``; CUDA HND is
the same shape order under ``LBHNC``). Block contents may be packed per instruction set, so blocks
move as opaque bytes between workers whose layout fingerprints match.

The byte stream of a pull is, for each layer in order, the pages of the listed blocks in order:

    layer 0: [b3][b4][b5][b9]   layer 1: [b3][b4][b5][b9]   ...

Each side coalesces its own consecutive block ids into one memory range, independently.
"""

from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass
from typing import Any, Iterator, Sequence


@dataclass(frozen=True)
class LayerRegion:
    name: str
    pages: Any  # torch.Tensor [num_blocks, page_bytes] uint8 view of the layer's KV
    page_bytes: int
    num_blocks: int


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


def runs(block_ids: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Coalesce block ids into (first_block, count) runs of consecutive ids, order kept.

    >>> list(runs([3, 4, 5, 9, 10, 2]))
    [(3, 3), (9, 2), (2, 1)]
    """
    start = prev = None
    count = 0
    for b in block_ids:
        if prev is not None and b == prev + 1:
            count += 1
        else:
            if start is not None:
                yield start, count
            start, count = b, 1
        prev = b
    if start is not None:
        yield start, count


def block_views(regions: Sequence[LayerRegion], block_ids: Sequence[int]) -> list[memoryview]:
    """The memory of ``block_ids`` in stream order, one view per (layer, run)."""
    views = []
    for region in regions:
        for first, count in runs(block_ids):
            views.append(memoryview(region.pages[first:first + count].numpy()).cast("B"))
    return views


def stream_bytes(regions: Sequence[LayerRegion], num_blocks: int) -> int:
    return sum(r.page_bytes for r in regions) * num_blocks
