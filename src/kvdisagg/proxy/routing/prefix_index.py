"""What each instance's prefix cache holds: one index of block key -> instances, fed by vLLM's
KV cache events (kv_events.py), queried per request with the prompt's token ids.

Pure data structure: no I/O, no asyncio; the proxy's event loop is the only caller.

**Keys: our own chained hash of each block's token ids, not vLLM's block hash.** A block's key is
a keyed 64-bit ``blake2b(parent key, the block's token ids, the block's extra keys)``, so a key
names a whole prefix, as vLLM's hash does. Why not reproduce vLLM's hash: it depends on
per-instance settings the proxy cannot see or cannot reproduce
(``--prefix-caching-hash-algo``: sha256, sha256_cbor,
xxhash, xxhash_cbor; the seed: fixed for sha256, *random per process* for the xxhash variants
unless ``PYTHONHASHSEED`` is set; ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` truncating to 64
bits), and a fleet may mix them. Events carry each block's ``token_ids`` and the vLLM hash of
its parent, so the index keeps, per instance, a map vLLM hash -> our key and chains through it;
our keys then agree across instances whatever their hash settings, and nothing is guessed.

Extra keys: vLLM mixes the LoRA adapter, ``cache_salt``, multimodal items and prompt embeddings
into its hashes and publishes them per block, untagged (``extra_keys``: LoRA name, then
``(mm identifier, offset)`` pairs, then the salt on the first block only, then embedding
digests). They go into our key as published, so a salted or LoRA block never matches a plain
request; a request's own extras (``BlockExtra``: LoRA name, cache salt) are laid out the same
way. Multimodal and embedding blocks are indexed but a text request never matches them.

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

import hashlib
import logging
import os
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NewType

import msgspec

from kvdisagg.proxy.routing.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    Hash,
    IndexCounters,
)

__all__ = ["BlockExtra", "BlockKey", "IndexedInstance", "Lookup", "Pending", "PrefixIndex",
           "block_keys", "vllm_hit_tokens"]

log = logging.getLogger("kvdisagg.proxy.routing.prefix_index")

BlockKey = NewType("BlockKey", int)
"""64 bits naming one block and every token before it (a chained hash). Keyed with a secret
drawn per process, so no client can craft token sequences whose keys collide with another's."""

ROOT = BlockKey(0)
DEVICE_MEDIA = (None, "GPU")
"""``medium`` of vLLM's own block pool (MEDIUM_GPU, also on the CPU platform)."""

_encode = msgspec.msgpack.Encoder().encode
_HASH = hashlib.blake2b(digest_size=8, key=os.urandom(16))


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as uint32 (4 bytes each: every vocabulary fits); ValueError otherwise."""
    try:
        return array("I", token_ids).tobytes()
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None


def _chain(parent: int, block: bytes, extra: bytes) -> BlockKey:
    """The key of a block: its parent's key, its tokens (uint32 bytes), its extra keys."""
    h = _HASH.copy()
    h.update(parent.to_bytes(8, "little"))
    h.update(block)
    if extra:
        h.update(len(extra).to_bytes(4, "little"))
        h.update(extra)
    return BlockKey(int.from_bytes(h.digest(), "little"))


class BlockExtra(NamedTuple):
    """A request's own extra keys, as vLLM publishes them for its blocks.

    ``lora_name``: the adapter's name when the request runs on a LoRA (the ``model`` it names
    is a served adapter); ``cache_salt``: the request's ``cache_salt`` field.
    """

    lora_name: str | None = None
    cache_salt: str | None = None

    def for_block(self, index: int) -> bytes:
        """The encoded extra keys of block ``index`` (b"" when it has none)."""
        keys: list[Any] = []
        if self.lora_name is not None:
            keys.append(self.lora_name)
        if index == 0 and self.cache_salt:
            keys.append(self.cache_salt)
        return _encode(keys) if keys else b""


NO_EXTRA = BlockExtra()


def block_keys(token_ids: Sequence[int], block_size: int, extra: BlockExtra = NO_EXTRA,
               limit: int | None = None) -> list[BlockKey]:
    """The keys of the full blocks of ``token_ids`` (at most ``limit``), first block first.

    Raises ValueError for a token id outside [0, 2**32).
    """
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    data = _token_bytes(token_ids[:n * block_size])
    step = 4 * block_size
    keys: list[BlockKey] = []
    parent = ROOT
    for i in range(n):
        parent = _chain(parent, data[i * step:(i + 1) * step], extra.for_block(i))
        keys.append(parent)
    return keys


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
            fallback = _encode([ev.lora_name])
        data = _token_bytes(ev.token_ids)  # validated < 2**32 when decoded
        step = 4 * ev.block_size
        for i, h in enumerate(ev.block_hashes):
            if ev.extra_keys is not None:
                extra_i = ev.extra_keys[i]
                extra = _encode(extra_i) if extra_i else b""
            else:
                extra = fallback
            key = _chain(parent, data[i * step:(i + 1) * step], extra)
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
