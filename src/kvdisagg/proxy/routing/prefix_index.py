"""What each instance's prefix cache holds: one index of block key -> instances, fed by vLLM's
KV cache events (kv_events.py), queried per request with the prompt's token ids.

Pure data structure: no I/O, no asyncio; the proxy's event loop is the only caller.

**Keys: our own chained hash of each block's token ids, not vLLM's block hash**
(prompt_keys.py, which says why): the index keeps, per instance, a map vLLM hash -> our key,
chaining through the vLLM hash of each stored block's parent, so our keys agree across instances
whatever their hash settings, and nothing is guessed. A block's extra keys (LoRA, cache salt,
multimodal items, embeddings) go into its key as published, so a salted or LoRA block never
matches a plain request. Multimodal and embedding blocks are indexed but a text request never
matches them.

What an instance holds: vLLM may cache the same content twice (two requests computing one
prefix at once: ``BlockHashToBlockMap`` keeps both copies) and emits one BlockStored per copy
and one BlockRemoved per evicted copy, so entries count copies. A block stored under a parent
the index does not know (events lost before it, a prefix cache reset) is skipped: a lookup
walks from block 0, so vLLM could not reach it either. Every loss of events is handled by
dropping the instance's entries (kv_events.py), so the only wrong answers left are too-short
ones: a wrong hint costs latency, never a request.

Prompts being computed: vLLM publishes a block once the step that computed it is over, but a
burst of prompts sharing a prefix (conversations starting from one system prompt) arrives
before that. The proxy notes each prompt it sends as *pending* on the instance that computes it
(``note_pending``) until shortly after that instance has computed it (``drop_pending``); a
lookup counts a pending block as held, so the rest of the burst follows the first prompt
instead of computing the prefix a second time elsewhere.

Scope the index refuses rather than guesses (``IndexedInstance.disabled`` says why): several KV
cache groups (hybrid models: each group has its own hit rule), block sizes changing mid-stream
(partial blocks of a hash block size smaller than the block size). Events of other tiers
(``medium`` CPU or STORAGE: offloading connectors) are ignored: only the device pool's blocks
are a prefix-cache hit without a load.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvdisagg.proxy.routing.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    Hash,
    IndexCounters,
)
from kvdisagg.proxy.routing.prompt_keys import (
    NO_EXTRA,
    ROOT,
    BlockExtra,
    BlockKey,
    block_keys,
    chain,
    encode_extra,
    token_bytes,
)

__all__ = ["IndexedInstance", "Lookup", "Pending", "PrefixIndex", "vllm_hit_tokens"]

log = logging.getLogger("kvdisagg.proxy.routing.prefix_index")

DEVICE_MEDIA = (None, "GPU")
"""``medium`` of vLLM's own block pool (MEDIUM_GPU, also on the CPU platform)."""


def vllm_hit_tokens(held_blocks: int, prompt_len: int, block_size: int) -> int:
    """Tokens vLLM reuses from its prefix cache when ``held_blocks`` leading blocks are cached:
    the last prompt token is always computed (``max_cache_hit_length = num_tokens - 1`` in
    ``KVCacheManager.get_computed_blocks``), in whole blocks."""
    if prompt_len <= 0:
        return 0
    return min(held_blocks, (prompt_len - 1) // block_size) * block_size


class Lookup(NamedTuple):
    hits: dict[str, int]
    """Prompt tokens each instance would reuse (absent: the index cannot tell)."""
    keys: dict[int, tuple[BlockKey, ...]]
    """Per block size, the keys of the prompt's blocks that can be a hit."""


class Pending(NamedTuple):
    """A prompt noted as being computed on ``instance`` (its full blocks' keys)."""

    instance: str
    keys: tuple[BlockKey, ...]


class _Block:
    __slots__ = ("copies", "key")

    def __init__(self, key: BlockKey) -> None:
        self.key = key
        self.copies = 1


@dataclass
class IndexedInstance:
    """One instance's view."""

    id: str
    block_size: int | None = None
    """From the first BlockStored; every later one must agree."""
    disabled: str | None = None
    """Why the index does not answer for this instance (None: it does)."""
    entries: dict[Hash, _Block] = field(default_factory=dict)
    keys: dict[BlockKey, int] = field(default_factory=dict)
    copies: int = 0
    """Cached block copies (sum of entries' copies); bounded by ``max_blocks``."""
    counters: IndexCounters = field(default_factory=IndexCounters)
    """Its ``stored`` .. ``overflows`` grow here (shared with its event stream's)."""

    @property
    def blocks(self) -> int:
        """Distinct blocks indexed (a block cached twice counts once)."""
        return len(self.entries)


class PrefixIndex:
    """Block key -> instances, fed by each instance's events in order (``apply``).

    Bounded: an instance holds at most ``max_blocks`` block copies (vLLM's own pool is finite,
    so more means the view went wrong, e.g. reuse reports counted as copies: its entries are
    dropped and the count starts over).
    """

    def __init__(self, max_blocks: int = 262_144) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self._instances: dict[str, IndexedInstance] = {}
        self._holders: dict[BlockKey, set[str]] = {}
        self._pending: dict[BlockKey, dict[str, int]] = {}  # key -> instance -> prompts

    # -- membership -------------------------------------------------------------------------

    def add(self, instance: str, counters: IndexCounters | None = None) -> IndexedInstance:
        """Start an (empty) view of ``instance``, counting into ``counters`` (the caller's, to
        share them with the instance's event stream; default: its own); idempotent."""
        inst = self._instances.get(instance)
        if inst is None:
            inst = self._instances[instance] = IndexedInstance(
                instance, counters=IndexCounters() if counters is None else counters)
        return inst

    def remove(self, instance: str) -> None:
        """Forget ``instance`` and every entry it had."""
        if instance in self._instances:
            self.clear(instance)
            del self._instances[instance]

    def clear(self, instance: str) -> int:
        """Drop the instance's entries (its view starts over); returns how many blocks."""
        inst = self._instances.get(instance)
        if inst is None:
            return 0
        n = len(inst.entries)
        for key in inst.keys:
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(instance)
                if not holders:
                    del self._holders[key]
        inst.entries.clear()
        inst.keys.clear()
        inst.copies = 0
        return n

    def disable(self, instance: str, reason: str) -> None:
        """Stop answering for ``instance`` (and drop its entries); ``reason`` is logged once."""
        inst = self.add(instance)
        self.clear(instance)
        if inst.disabled is None:
            log.warning("prefix index: no cache index for %s: %s", instance, reason)
        inst.disabled = reason

    def get(self, instance: str) -> IndexedInstance | None:
        return self._instances.get(instance)

    def instances(self) -> list[IndexedInstance]:
        return list(self._instances.values())

    # -- events -----------------------------------------------------------------------------

    def apply(self, instance: str, events: Iterable[Event]) -> None:
        """Apply one batch of ``instance``'s events, in the order vLLM emitted them."""
        inst = self.add(instance)
        if inst.disabled is not None:
            return
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(inst, ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(inst, ev)
            elif isinstance(ev, AllBlocksCleared):
                inst.counters.cleared += 1
                self.clear(instance)
            if inst.disabled is not None:
                return
        if inst.copies > self.max_blocks:
            inst.counters.overflows += 1
            log.warning("prefix index: %s claims %d cached blocks, more than the bound %d; "
                        "dropping its entries", instance, inst.copies, self.max_blocks)
            self.clear(instance)

    def _check_group(self, inst: IndexedInstance, group_idx: int | None) -> bool:
        if group_idx not in (None, 0):
            self.disable(inst.id, f"its KV cache has several groups (an event of group "
                                  f"{group_idx}: a hybrid model), each with its own hit rule")
            return False
        return True

    def _stored(self, inst: IndexedInstance, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        if not self._check_group(inst, ev.group_idx):
            return
        if ev.medium not in DEVICE_MEDIA:
            inst.counters.ignored += n
            return
        if inst.block_size is None:
            inst.block_size = ev.block_size
        if ev.block_size != inst.block_size or len(ev.token_ids) != n * ev.block_size or (
                ev.extra_keys is not None and len(ev.extra_keys) != n):
            inst.counters.ignored += n
            return
        if ev.parent_block_hash is None:
            parent = ROOT
        else:
            p = inst.entries.get(ev.parent_block_hash)
            if p is None:
                inst.counters.orphans += n
                return
            parent = p.key
        fallback: bytes = b""
        if ev.extra_keys is None and ev.lora_name is not None:
            # Producers that predate per-block extra keys: the adapter alone, as in extra_keys.
            fallback = encode_extra([ev.lora_name])
        data = token_bytes(ev.token_ids)  # validated < 2**32 when decoded
        step = 4 * ev.block_size
        for i, h in enumerate(ev.block_hashes):
            if ev.extra_keys is not None:
                extra_i = ev.extra_keys[i]
                extra = encode_extra(extra_i)
            else:
                extra = fallback
            key = chain(parent, data[i * step:(i + 1) * step], extra)
            entry = inst.entries.get(h)
            if entry is None:
                inst.entries[h] = _Block(key)
                self._hold(inst, key)
            elif entry.key == key:
                entry.copies += 1
            else:
                # One vLLM hash, two contents (a 64-bit collision of int hashes): keep the first.
                inst.counters.ignored += 1
                parent = key
                continue
            inst.copies += 1
            inst.counters.stored += 1
            parent = key

    def _removed(self, inst: IndexedInstance, ev: BlockRemoved) -> None:
        if not self._check_group(inst, ev.group_idx):
            return
        if ev.medium not in DEVICE_MEDIA:
            inst.counters.ignored += len(ev.block_hashes)
            return
        for h in ev.block_hashes:
            entry = inst.entries.get(h)
            if entry is None:
                continue  # never seen (stored before we listened): nothing to undo
            inst.counters.removed += 1
            inst.copies -= 1
            entry.copies -= 1
            if entry.copies == 0:
                del inst.entries[h]
                self._release(inst, entry.key)

    def _hold(self, inst: IndexedInstance, key: BlockKey) -> None:
        n = inst.keys.get(key, 0)
        inst.keys[key] = n + 1
        if n == 0:
            self._holders.setdefault(key, set()).add(inst.id)

    def _release(self, inst: IndexedInstance, key: BlockKey) -> None:
        n = inst.keys[key] - 1
        if n:
            inst.keys[key] = n
            return
        del inst.keys[key]
        holders = self._holders[key]
        holders.discard(inst.id)
        if not holders:
            del self._holders[key]

    # -- prompts being computed -------------------------------------------------------------

    def note_pending(self, instance: str, found: Lookup) -> Pending:
        """``instance`` is computing the prompt of ``found`` (a ``lookup``, whose keys are
        reused, not hashed again): until ``drop_pending``, lookups count its full blocks as
        held there. Nothing is noted for an instance the index does not answer for."""
        inst = self._instances.get(instance)
        if inst is None or inst.disabled is not None or inst.block_size is None:
            return Pending(instance, ())
        keys = found.keys.get(inst.block_size, ())
        for key in keys:
            by = self._pending.setdefault(key, {})
            by[instance] = by.get(instance, 0) + 1
        return Pending(instance, keys)

    def drop_pending(self, pending: Pending) -> None:
        for key in pending.keys:
            by = self._pending.get(key)
            if by is None or pending.instance not in by:
                continue
            by[pending.instance] -= 1
            if not by[pending.instance]:
                del by[pending.instance]
                if not by:
                    del self._pending[key]

    @property
    def pending_blocks(self) -> int:
        return len(self._pending)

    # -- queries ----------------------------------------------------------------------------

    def cached_tokens(self, token_ids: Sequence[int], extra: BlockExtra = NO_EXTRA,
                      instances: Iterable[str] | None = None) -> dict[str, int]:
        """``lookup(...).hits``."""
        return self.lookup(token_ids, extra, instances).hits

    def lookup(self, token_ids: Sequence[int], extra: BlockExtra = NO_EXTRA,
               instances: Iterable[str] | None = None) -> Lookup:
        """Prompt tokens each instance would take from its prefix cache for ``token_ids``, and
        the keys of the prompt's blocks (for ``note_pending``).

        Whole leading blocks it holds (or is computing: pending), capped as vLLM caps a hit
        (the last prompt token is always computed: ``vllm_hit_tokens``). Only instances the
        index answers for appear (a missing instance: unknown, not zero). Every block that can
        be a hit is hashed once per block size, hit or not. Does not modify the index. Raises
        ValueError for token ids outside [0, 2**32).
        """
        chosen = (self._instances.values() if instances is None
                  else [i for i in map(self._instances.get, instances) if i is not None])
        out: dict[str, int] = {}
        by_size: dict[int, list[str]] = {}
        for inst in chosen:
            if inst.disabled is not None:
                continue
            out[inst.id] = 0
            if inst.block_size is not None:
                by_size.setdefault(inst.block_size, []).append(inst.id)
        n = len(token_ids)
        keys = {bs: tuple(block_keys(token_ids, bs, extra, limit=(n - 1) // bs))
                for bs in by_size} if n else {}
        for bs, ids in by_size.items():
            alive = set(ids)
            for i, key in enumerate(keys.get(bs, ())):
                holders = self._holders.get(key, set())
                if (pending := self._pending.get(key)) is not None:
                    holders = holders | pending.keys()
                alive &= holders
                if not alive:
                    break
                for inst_id in alive:
                    out[inst_id] = (i + 1) * bs
        return Lookup(out, keys)
