"""KV geometry helpers: staging copies exactly the blocks asked for, and nothing else."""

from __future__ import annotations

import pytest
import torch

from kvdisagg.connector.layout import copy_runs, layer_regions, stage_into, with_arena


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


@pytest.mark.parametrize("src, dst, expected", [
    ([], [], []),
    ([7], [2], [(7, 2, 1)]),
    ([3, 4, 5, 9, 10, 2], [0, 1, 2, 3, 4, 5], [(3, 0, 3), (9, 3, 2), (2, 5, 1)]),
    ([3, 4, 5], [0, 1, 7], [(3, 0, 2), (5, 7, 1)]),  # broken on the destination side only
    ([5, 4, 3], [0, 1, 2], [(5, 0, 1), (4, 1, 1), (3, 2, 1)]),
])
def test_copy_runs_coalesce_where_both_sides_are_consecutive(src, dst, expected):
    got = copy_runs(2, src, dst)
    assert [(r.src, r.dst, r.count) for r in got if r.layer == 0] == expected
    assert [(r.src, r.dst, r.count) for r in got if r.layer == 1] == expected
    assert [r.layer for r in got] == sorted(r.layer for r in got)


def test_copy_runs_refuses_mismatched_lists():
    with pytest.raises(ValueError, match="2 source blocks for 1"):
        copy_runs(1, [1, 2], [3])
