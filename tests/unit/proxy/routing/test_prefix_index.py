"""The prefix index (proxy/routing/prefix_index.py) as a pure data structure: events in, predicted
prefix-cache hits out. The ZMQ side is tests/unit/proxy/test_kv_events.py."""

from __future__ import annotations

import pytest

from kvdisagg.proxy.routing.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvdisagg.proxy.routing.prefix_index import PrefixIndex, vllm_hit_tokens
from kvdisagg.proxy.routing.prompt_keys import BlockExtra

BS = 4
A, B = "http://a:8000", "http://b:8000"


def stored(hashes: list[int], parent: int | None, tokens: list[int], bs: int = BS,
           **kw) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=bs, medium=kw.pop("medium", "GPU"), **kw)


def removed(*hashes: int, **kw) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=kw.pop("medium", "GPU"), **kw)


T = list(range(100, 140))  # a prompt: blocks T[0:4], T[4:8], ...


def test_chain_across_events_and_the_vllm_cap() -> None:
    idx = PrefixIndex()
    idx.apply(A, [stored([1, 2], None, T[:8])])
    idx.apply(A, [stored([3], 2, T[8:12])])  # parent by vLLM hash: chained to our key of block 2
    assert idx.cached_tokens(T[:13]) == {A: 12}
    assert idx.cached_tokens(T[:20]) == {A: 12}
    # The last prompt token is always computed: a fully cached 12-token prompt reuses 8.
    assert idx.cached_tokens(T[:12]) == {A: 8}
    assert idx.cached_tokens(T[:3]) == {A: 0}
    assert idx.cached_tokens([7] + T[1:13]) == {A: 0}  # first block differs
    assert idx.cached_tokens(T[:4] + [7] + T[5:13]) == {A: 4}  # second block differs
    assert vllm_hit_tokens(3, 12, BS) == 8 and vllm_hit_tokens(3, 13, BS) == 12
    assert vllm_hit_tokens(5, 0, BS) == 0


def test_same_tokens_under_another_parent_are_another_block() -> None:
    idx = PrefixIndex()
    idx.apply(A, [stored([1], None, T[:4]), stored([9], None, T[4:8])])  # T[4:8] as a prompt start
    assert idx.cached_tokens(T[:9]) == {A: 4}
    assert idx.cached_tokens(T[4:9]) == {A: 4}


def test_orphans_are_skipped() -> None:
    idx = PrefixIndex()
    idx.apply(A, [stored([5], 4, T[4:8])])  # parent 4 never seen (stored before we listened)
    inst = idx.get(A)
    assert inst is not None and inst.counters.orphans == 1 and inst.blocks == 0
    idx.apply(A, [stored([6], 5, T[8:12])])  # its child is an orphan too
    assert inst.counters.orphans == 2 and idx.cached_tokens(T[:13]) == {A: 0}


def test_copies_and_eviction() -> None:
    idx = PrefixIndex()
    idx.apply(A, [stored([1, 2], None, T[:8])])
    idx.apply(A, [stored([1, 2], None, T[:8])])  # two requests computed the same prefix at once
    idx.apply(A, [removed(2)])  # one copy evicted: the other is still there
    assert idx.cached_tokens(T[:9]) == {A: 8}
    idx.apply(A, [removed(2)])
    assert idx.cached_tokens(T[:9]) == {A: 4}
    idx.apply(A, [removed(77)])  # never seen: nothing to undo
    idx.apply(A, [removed(1, 1)])
    assert idx.cached_tokens(T[:9]) == {A: 0}
    inst = idx.get(A)
    assert inst is not None and inst.blocks == 0 and inst.copies == 0
    assert idx._holders == {}  # nothing left behind


def test_a_hole_in_the_chain_stops_the_hit() -> None:
    idx = PrefixIndex()
    idx.apply(A, [stored([1, 2, 3], None, T[:12])])
    idx.apply(A, [removed(2)])
    assert idx.cached_tokens(T[:13]) == {A: 4}


def test_instances_apart_and_together() -> None:
    idx = PrefixIndex()
    idx.apply(A, [stored([1, 2, 3], None, T[:12])])
    idx.apply(B, [stored([51], None, T[:4])])  # B's own hash values: keys still agree
    assert idx.cached_tokens(T[:13]) == {A: 12, B: 4}
    assert idx.cached_tokens(T[:13], instances=[B]) == {B: 4}
    idx.apply(A, [AllBlocksCleared()])
    assert idx.cached_tokens(T[:13]) == {A: 0, B: 4}
    inst = idx.get(A)
    assert inst is not None and inst.counters.cleared == 1
    idx.remove(B)
    assert idx.cached_tokens(T[:13]) == {A: 0}
    assert idx._holders == {}


def test_extra_keys_salt_and_lora() -> None:
    idx = PrefixIndex()
    # vLLM publishes the salt on the first block only, the LoRA name on every block.
    idx.apply(A, [stored([1, 2], None, T[:8], extra_keys=[["s1"], None])])
    idx.apply(B, [stored([1, 2], None, T[:8], lora_name="ad", extra_keys=[["ad", "s1"], ["ad"]])])
    assert idx.cached_tokens(T[:9]) == {A: 0, B: 0}
    assert idx.cached_tokens(T[:9], BlockExtra(cache_salt="s1")) == {A: 8, B: 0}
    assert idx.cached_tokens(T[:9], BlockExtra(cache_salt="s2")) == {A: 0, B: 0}
    assert idx.cached_tokens(T[:9], BlockExtra("ad", "s1")) == {A: 0, B: 8}
    assert idx.cached_tokens(T[:9], BlockExtra("ad")) == {A: 0, B: 0}


def test_multimodal_blocks_never_match_text() -> None:
    idx = PrefixIndex()
    idx.apply(A, [stored([1, 2], None, T[:8], extra_keys=[None, [["img-hash", 1]]])])
    assert idx.cached_tokens(T[:9]) == {A: 4}


def test_other_tiers_and_sizes_are_ignored() -> None:
    idx = PrefixIndex()
    idx.apply(A, [stored([1], None, T[:4], medium="CPU")])  # an offloading tier
    idx.apply(A, [stored([2], None, T[:4])])
    idx.apply(A, [stored([3], None, T[:8], bs=8)])  # another block size (partial blocks)
    idx.apply(A, [stored([4, 5], None, T[:4])])  # token ids do not fill the blocks
    inst = idx.get(A)
    assert inst is not None and inst.block_size == BS and inst.counters.ignored == 1 + 1 + 2
    assert idx.cached_tokens(T[:9]) == {A: 4}
    idx.apply(A, [removed(2, medium="CPU")])
    assert idx.cached_tokens(T[:9]) == {A: 4}


def test_several_kv_cache_groups_disable_the_instance() -> None:
    idx = PrefixIndex()
    idx.apply(A, [stored([1], None, T[:4], group_idx=0)])
    idx.apply(B, [stored([1], None, T[:4])])
    idx.apply(A, [stored([1], None, T[:4], group_idx=1)])
    inst = idx.get(A)
    assert inst is not None and inst.disabled and "groups" in inst.disabled
    assert idx.cached_tokens(T[:9]) == {B: 4}  # A: unknown, so absent (not zero)
    idx.apply(A, [stored([2], None, T[4:8])])
    assert inst.blocks == 0


def test_block_sizes_per_instance() -> None:
    idx = PrefixIndex()
    idx.apply(A, [stored([1, 2], None, T[:8])])
    idx.apply(B, [stored([1], None, T[:8], bs=8)])
    assert idx.cached_tokens(T[:9]) == {A: 8, B: 8}
    assert idx.cached_tokens(T[:8]) == {A: 4, B: 0}


def test_the_bound_drops_a_runaway_view() -> None:
    idx = PrefixIndex(max_blocks=3)
    idx.apply(A, [stored([1, 2, 3], None, T[:12])])
    assert idx.cached_tokens(T[:13]) == {A: 12}
    idx.apply(A, [stored([4], 3, T[12:16])])
    inst = idx.get(A)
    assert inst is not None and inst.counters.overflows == 1 and inst.blocks == 0
    assert idx._holders == {}


def test_bad_ids() -> None:
    """(The keys themselves: tests/unit/proxy/routing/test_prompt_keys.py.)"""
    idx = PrefixIndex()
    idx.apply(A, [stored([1], None, T[:4])])
    with pytest.raises(ValueError):
        idx.cached_tokens([-1] + T[1:9])


def test_a_prompt_being_computed_counts_as_held_until_dropped() -> None:
    """A burst sharing a prefix: the first prompt is noted on the instance computing it, so
    the next, arriving before any event, predicts the hit there."""
    idx = PrefixIndex()
    idx.apply(A, [stored([1], None, T[:4])])
    idx.apply(B, [stored([50], None, [9, 9, 9, 9])])  # B's block size is known, nothing shared
    first = idx.note_pending(B, idx.lookup(T[:13], BlockExtra(cache_salt="s")))
    assert idx.cached_tokens(T[:13]) == {A: 4, B: 0}  # another salt: another prefix
    second = idx.note_pending(B, idx.lookup(T[:13]))
    assert idx.cached_tokens(T[:13]) == {A: 4, B: 12}
    assert idx.cached_tokens(T[:10] + [7, 7, 7]) == {A: 4, B: 8}  # the shared blocks
    again = idx.note_pending(B, idx.lookup(T[:9]))  # the same first blocks, noted twice
    idx.drop_pending(second)
    assert idx.cached_tokens(T[:13]) == {A: 4, B: 8}
    idx.drop_pending(again)
    idx.drop_pending(first)
    idx.drop_pending(first)  # dropped twice: nothing below zero
    assert idx.cached_tokens(T[:13]) == {A: 4, B: 0} and idx.pending_blocks == 0
    # An instance whose block size is unknown (no event yet) gets nothing noted.
    idx.add("http://c:8000")
    assert idx.note_pending("http://c:8000", idx.lookup(T[:13])).keys == ()
