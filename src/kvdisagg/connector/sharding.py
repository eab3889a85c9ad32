"""Which KV heads and layers each decode rank pulls from which prefill rank.

vLLM shards a model's KV over tensor-parallel (TP) ranks by head and over pipeline-parallel
(PP) stages by layer; prefill and decode may shard it differently. With ``K`` KV heads:

- TP size ``t <= K``: rank ``r`` holds heads ``r*K/t .. (r+1)*K/t - 1`` (``t`` divides ``K``).
- TP size ``t > K`` (GQA/MQA, more ranks than heads; MLA counts as one head): rank ``r`` holds
  the one head ``r*K//t``, each head replicated on ``t/K`` ranks (``K`` divides ``t``).
- PP: stage ``s`` holds layers ``stages[s] .. stages[s+1]-1``, the last stage up to the model's
  layer count. Ranks are numbered PP-major, as vLLM does: ``rank = pp_rank * tp + tp_rank``.

Each decode rank reads, for the layers it holds, the heads it holds, from the prefill rank(s)
holding them: one ``Part`` per prefill rank it reads (a head range and a layer list). Heads
split (decode TP > prefill TP), gather (prefill TP > decode TP) or pass 1:1; of a replicated
head, decode TP rank ``r`` reads replica ``r mod t/K`` (1:1 when both TPs are equal)::

    K=4: prefill TP2 -> decode TP4 (split)      K=2: prefill TP4 -> decode TP1 (gather)
    P0 [h0 h1] --h0--> D0 [h0]                  P0 [h0] --h0--> D0 [h0 h1]
               --h1--> D1 [h1]                  P1 [h0]  (replica: released unread)
    P1 [h2 h3] --h2--> D2 [h2]                  P2 [h1] --h1--> D0
               --h3--> D3 [h3]                  P3 [h1]  (replica: released unread)

    4 layers: prefill PP1 -> decode PP2          prefill PP2 -> decode PP1
    P0 [L0..L3] --L0 L1--> D0 (stage 0)         P0 [L0 L1] --L0 L1--> D0 [L0..L3]
                --L2 L3--> D1 (stage 1)         P1 [L2 L3] --L2 L3--> D0

A head range of a block is one contiguous byte range (vLLM's LBHNC layout: per layer
``[blocks, heads, block_size, ...]``), so a Part moves, per block of each of its layers, the
bytes of heads ``src_head..src_head+heads`` into decode's heads ``dst_head..``.

A prefill rank frees a handoff after ``readers`` Done messages: one from each decode rank that
reads it, or, for a rank no decode rank reads (a replica), a release-only Part (no layers)
from the first decode rank reading its stage. Every prefill rank is thus released exactly once.

Pure: no torch, no vLLM, no I/O.
"""

from __future__ import annotations

import functools
from typing import NamedTuple


class Shape(NamedTuple):
    """One instance's parallelism: its TP size and the first layer of each PP stage."""

    tp: int
    stages: tuple[int, ...] = (0,)

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp + tp_rank

    def layers(self, pp_rank: int, num_layers: int) -> range:
        """Global ids of the layers stage ``pp_rank`` holds."""
        end = self.stages[pp_rank + 1] if pp_rank + 1 < self.pp else num_layers
        return range(self.stages[pp_rank], end)

    def heads(self, tp_rank: int, kv_heads: int) -> range:
        """Global ids of the KV heads TP rank ``tp_rank`` holds (vLLM's QKVParallelLinear)."""
        if self.tp <= kv_heads:
            per = kv_heads // self.tp
            return range(tp_rank * per, (tp_rank + 1) * per)
        head = tp_rank * kv_heads // self.tp
        return range(head, head + 1)

    def key(self) -> str:
        """A short stable name of the shape (store keys: lmcache)."""
        return f"tp{self.tp}-pp{'.'.join(map(str, self.stages))}"

    def describe(self) -> str:
        return f"TP{self.tp}" + (f" PP{self.pp} (stages from layers {list(self.stages)})"
                                 if self.pp > 1 else "")


def even_stages(num_layers: int, pp: int) -> tuple[int, ...]:
    """vLLM's default PP split (``get_pp_indices`` without ``VLLM_PP_LAYER_PARTITION``): even
    parts, the remainder on the stages before the last one. For tests and the planner.

    >>> even_stages(4, 2), even_stages(5, 3), even_stages(7, 4)
    ((0, 2), (0, 2, 4), (0, 2, 4, 6))
    """
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return tuple(sum(parts[:s]) for s in range(pp))


class Part(NamedTuple):
    """What one decode rank reads from one prefill rank (with no ``layers``: only releases it).

    Heads are counted within each rank's own heads (0-based): the prefill rank's
    ``src_head..src_head+heads-1`` go into the decode rank's ``dst_head..``. ``src_width`` is how
    many heads the prefill rank holds (its page size in heads)."""

    src: int
    layers: tuple[int, ...]
    src_head: int
    dst_head: int
    heads: int
    src_width: int
    readers: int


def check(prefill: Shape, decode: Shape, *, kv_heads: int, num_layers: int) -> str:
    """'' if decode (``decode``) can pull from prefill (``prefill``), else why not."""
    for side, shape in (("prefill", prefill), ("decode", decode)):
        if shape.tp < 1:
            return f"{side} TP {shape.tp} < 1"
        if not (kv_heads % shape.tp == 0 or shape.tp % kv_heads == 0):
            return (f"{side} TP {shape.tp} cannot shard the model's {kv_heads} KV heads (a TP "
                    "size must divide the KV heads or be a multiple of them)")
        stages = list(shape.stages)
        if not stages or stages[0] != 0 or stages != sorted(set(stages)) \
                or stages[-1] >= num_layers:
            return (f"{side} PP stages start at layers {stages}: not a split of the model's "
                    f"{num_layers} layers (ascending, from 0, each stage at least one layer)")
    return ""


def parts(prefill: Shape, decode: Shape, *, kv_heads: int, num_layers: int,
          rank: int) -> tuple[Part, ...]:
    """The Parts decode rank ``rank`` pulls (``check`` must have passed), by prefill rank."""
    return plan(prefill, decode, kv_heads, num_layers)[rank]


@functools.lru_cache(maxsize=64)
def plan(prefill: Shape, decode: Shape, kv_heads: int,
         num_layers: int) -> tuple[tuple[Part, ...], ...]:
    """Every decode rank's Parts (index: decode rank). Cached: a fleet has few shape pairs."""
    reads: dict[int, dict[int, tuple[tuple[int, ...], int, int, int]]] = {}
    for pp_d in range(decode.pp):
        wanted = decode.layers(pp_d, num_layers)
        for tp_d in range(decode.tp):
            d = decode.rank(pp_d, tp_d)
            mine = reads[d] = {}
            for tp_p, src_head, dst_head, count in _head_groups(prefill, decode, tp_d, kv_heads):
                for pp_p in range(prefill.pp):
                    held = prefill.layers(pp_p, num_layers)
                    layers = tuple(layer for layer in wanted if layer in held)
                    if layers:
                        mine[prefill.rank(pp_p, tp_p)] = (layers, src_head, dst_head, count)
    readers = [0] * prefill.world
    for mine in reads.values():
        for p in mine:
            readers[p] += 1
    releases: dict[int, list[int]] = {}
    for p in range(prefill.world):
        if not readers[p]:  # a replica nobody reads: the first reader of its stage frees it
            stage = range(prefill.rank(p // prefill.tp, 0), prefill.rank(p // prefill.tp + 1, 0))
            d = min(d for d, mine in reads.items() if any(q in stage for q in mine))
            releases.setdefault(d, []).append(p)
    width = len(prefill.heads(0, kv_heads))
    out = []
    for d in range(decode.world):
        parts = [Part(p, layers, src_head, dst_head, count, width, readers[p])
                 for p, (layers, src_head, dst_head, count) in sorted(reads[d].items())]
        parts += [Part(p, (), 0, 0, 0, width, 1) for p in releases.get(d, ())]
        out.append(tuple(parts))
    return tuple(out)


def _head_groups(prefill: Shape, decode: Shape, tp_d: int,
                 kv_heads: int) -> list[tuple[int, int, int, int]]:
    """Decode TP rank ``tp_d``'s heads by the prefill TP rank it reads them from:
    ``(prefill tp rank, first head there, first head here, count)``."""
    groups: list[tuple[int, int, int, int]] = []
    for dst, head in enumerate(decode.heads(tp_d, kv_heads)):
        if prefill.tp <= kv_heads:
            src_tp = head // (kv_heads // prefill.tp)
        else:
            replicas = prefill.tp // kv_heads
            src_tp = head * replicas + tp_d % replicas
        src = head - prefill.heads(src_tp, kv_heads)[0]
        if groups and groups[-1][0] == src_tp:
            tp, first_src, first_dst, count = groups[-1]
            groups[-1] = (tp, first_src, first_dst, count + 1)
        else:
            groups.append((src_tp, src, dst, 1))
    return groups
