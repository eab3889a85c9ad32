"""KV geometry helpers: staging copies exactly the blocks asked for, and nothing else."""

from __future__ import annotations

import pytest
import torch

from kvdisagg.layout import layer_regions, stage_into, with_arena


def regions(num_blocks: int = 8, arena: int = 6):
    g = torch.Generator().manual_seed(3)
    caches = {f"layer.{i}": torch.rand((num_blocks, 2, 4, 8), generator=g) for i in range(3)}
    rs = with_arena(layer_regions(caches), arena)
    for r in rs:
        r.stage.zero_()
    return rs


def test_stage_into_copies_each_block_to_its_slot():
    rs = regions()
    base = rs[0].num_blocks
    blocks, slots = [2, 3, 7, 0], [base + 1, base + 2, base + 5, base + 0]  # two runs coalesce
    stage_into(rs, blocks, slots)
    for r in rs:
        for b, s in zip(blocks, slots):
            assert torch.equal(r.stage[s - base], r.pages[b]), (r.name, b, s)
        untouched = [i for i in range(r.stage_blocks) if i + base not in slots]
        assert all(int(r.stage[i].count_nonzero()) == 0 for i in untouched)


def test_stage_into_refuses_blocks_past_the_arena():
    rs = regions(arena=2)
    base = rs[0].num_blocks
    with pytest.raises(ValueError, match="out of range"):
        stage_into(rs, [1, 2, 3], [base, base + 1, base + 2])
