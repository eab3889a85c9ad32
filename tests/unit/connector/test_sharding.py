"""The head/layer mapping between two instances' shards (kvdisagg.connector.sharding), for every
(prefill TP, PP) x (decode TP, PP) pair of up to 4 ranks per side: every decode rank gets each
(layer, head) it holds exactly once, from a prefill rank that holds it, and every prefill rank is
released by exactly as many Dones as it waits for."""

from __future__ import annotations

import itertools

import pytest

from kvdisagg.connector.sharding import Part, Shape, check, even_stages, parts, plan

RANKS = 4
SHAPES = [(tp, pp) for tp in range(1, RANKS + 1) for pp in range(1, RANKS + 1)
          if tp * pp <= RANKS]
KV_HEADS = [1, 2, 3, 4, 8]
LAYERS = [4, 7]  # 7: uneven stages


def shape(tp: int, pp: int, layers: int, uneven: bool = False) -> Shape:
    if uneven and pp > 1:  # a VLLM_PP_LAYER_PARTITION-like split: a long first stage
        return Shape(tp, (0, *range(layers - pp + 1, layers)))
    return Shape(tp, even_stages(layers, pp))


def cases():
    for p, d, kv_heads, layers in itertools.product(SHAPES, SHAPES, KV_HEADS, LAYERS):
        if all(kv_heads % tp == 0 or tp % kv_heads == 0 for tp in (p[0], d[0])):
            yield p, d, kv_heads, layers


ALL = list(cases())


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven-prefill"])
def test_every_pair_covers_each_layer_and_head_once_and_releases_each_prefill_rank(uneven):
    assert len(ALL) > 300
    for (ptp, ppp), (dtp, dpp), kv_heads, layers in ALL:
        prefill, decode = shape(ptp, ppp, layers, uneven), shape(dtp, dpp, layers)
        where = (prefill, decode, kv_heads, layers)
        assert check(prefill, decode, kv_heads=kv_heads, num_layers=layers) == "", where
        all_parts = plan(prefill, decode, kv_heads, layers)
        assert len(all_parts) == decode.world, where
        for pp_d, tp_d in itertools.product(range(decode.pp), range(decode.tp)):
            d = decode.rank(pp_d, tp_d)
            mine = parts(prefill, decode, kv_heads=kv_heads, num_layers=layers, rank=d)
            assert mine == all_parts[d]
            assert len({p.src for p in mine}) == len(mine), where  # one Part per prefill rank
            my_heads = decode.heads(tp_d, kv_heads)
            got: dict[tuple[int, int], int] = {}
            for part in mine:
                pp_p, tp_p = divmod(part.src, prefill.tp)
                src_heads = prefill.heads(tp_p, kv_heads)
                assert part.src_width == len(src_heads), where
                for layer in part.layers:
                    assert layer in prefill.layers(pp_p, layers), (where, part)
                    for k in range(part.heads):
                        head = my_heads[part.dst_head + k]
                        assert src_heads[part.src_head + k] == head, (where, part)
                        key = (layer, head)
                        assert key not in got, (where, part, key)
                        got[key] = part.src
            wanted = {(layer, head) for layer in decode.layers(pp_d, layers) for head in my_heads}
            assert set(got) == wanted, where
        # Each prefill rank gets exactly ``readers`` Dones (a Part each), >= 1.
        for p in range(prefill.world):
            naming = [part for mine in all_parts for part in mine if part.src == p]
            assert naming and all(part.readers == len(naming) for part in naming), (where, p)


@pytest.mark.parametrize("tp, pp", SHAPES)
def test_equal_shapes_pull_rank_to_rank_whole(tp: int, pp: int) -> None:
    s = Shape(tp, even_stages(4, pp))
    for d, mine in enumerate(plan(s, s, 4, 4)):
        (part,) = mine
        assert part == Part(d, tuple(s.layers(d // tp, 4)), 0, 0, 4 // tp, 4 // tp, 1)


def test_the_docstrings_diagrams() -> None:
    # K=4: prefill TP2 -> decode TP4, a split: two decode ranks read each prefill rank.
    split = plan(Shape(2), Shape(4), 4, 1)
    assert [(p.src, p.src_head, p.heads, p.readers) for (p,) in split] == \
        [(0, 0, 1, 2), (0, 1, 1, 2), (1, 0, 1, 2), (1, 1, 1, 2)]
    # K=2: prefill TP4 -> decode TP1, a gather: replicas 1 and 3 only released.
    (gather,) = plan(Shape(4), Shape(1), 2, 1)
    assert [(p.src, p.layers, p.dst_head) for p in gather] == \
        [(0, (0,), 0), (2, (0,), 1), (1, (), 0), (3, (), 0)]
    # 4 layers: prefill PP1 -> decode PP2, and PP2 -> PP1.
    assert [[(p.src, p.layers) for p in mine] for mine in plan(Shape(1), Shape(1, (0, 2)), 2, 4)] \
        == [[(0, (0, 1))], [(0, (2, 3))]]
    assert [[(p.src, p.layers) for p in mine] for mine in plan(Shape(1, (0, 2)), Shape(1), 2, 4)] \
        == [[(0, (0, 1)), (1, (2, 3))]]


def test_replicated_heads_are_read_one_to_one_when_tps_match() -> None:
    """TP4 over 2 KV heads on both sides: each rank reads its own replica, none is idle."""
    assert [[p.src for p in mine] for mine in plan(Shape(4), Shape(4), 2, 2)] == [
        [0],
        [1],
        [2],
        [3],
    ]


@pytest.mark.parametrize("prefill, decode, why", [
    (Shape(3), Shape(1), "prefill TP 3 cannot shard the model's 2 KV heads"),
    (Shape(1), Shape(3), "decode TP 3 cannot shard the model's 2 KV heads"),
    (Shape(1, (1,)), Shape(1), "prefill PP stages start at layers [1]"),
    (Shape(1, (0, 0)), Shape(1), "not a split of the model's 4 layers"),
    (Shape(1), Shape(1, (0, 4)), "decode PP stages start at layers [0, 4]"),
    (Shape(0), Shape(1), "prefill TP 0 < 1"),
])
def test_check_says_why_a_pair_cannot_work(prefill, decode, why) -> None:
    assert why in check(prefill, decode, kv_heads=2, num_layers=4)


def test_even_stages_match_vllms_default_split() -> None:
    from vllm.distributed.utils import get_pp_indices

    for layers, pp in itertools.product(range(4, 13), range(1, 5)):
        assert even_stages(layers, pp) == tuple(get_pp_indices(layers, r, pp)[0]
                                                for r in range(pp)), (layers, pp)
