"""How the proxy hashes a prompt, in one place: the keys of its blocks (what a cache holds) and
its placement key (where it should go when nothing says what is cached).

**Block keys** (``block_keys``, ``chain``) name what a prompt's blocks *are*. A block's key is a
keyed 64-bit ``blake2b(parent key, the block's token ids, the block's extra keys)``, so a key
names a whole prefix, as vLLM's block hash does. The cache index (prefix_index.py) names every
block an instance stores with them (from its KV events) and looks a request up by hashing the
request's token ids the same way. Why not reproduce vLLM's hash: it depends on per-instance
settings the proxy cannot see or cannot reproduce (``--prefix-caching-hash-algo``: sha256,
sha256_cbor, xxhash, xxhash_cbor; the seed: fixed for sha256, *random per process* for the
xxhash variants unless ``PYTHONHASHSEED`` is set; ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
truncating to 64 bits), and a fleet may mix them. They need token ids at vLLM's block
boundaries (the tokenizer, tokens.py) and are keyed with a secret drawn per process, so no
client can craft token sequences whose keys collide with another's and steer them.

Extra keys: vLLM mixes the LoRA adapter, ``cache_salt``, multimodal items and prompt embeddings
into its hashes and publishes them per block, untagged (``extra_keys``: LoRA name, then
``(mm identifier, offset)`` pairs, then the salt on the first block only, then embedding
digests). They go into a key as published (``encode_extra``), so a salted or LoRA block never
matches a plain request; a request's own extras (``BlockExtra``: LoRA name, cache salt) are laid
out the same way.

**The placement key** (``prefix_key``, ``rendezvous_weight``) says where a prompt *should go*
when nothing says what is cached: ``prefix_aware`` sends a prompt to the candidate whose
``blake2b(first prefix_block_chars characters of the text, URL)`` is highest (rendezvous
hashing). It is a different hash on purpose, not a second copy of the first:

- it needs no tokenizer and no KV events (the text is all a proxy without a cache index has);
- it is unkeyed and deterministic: every proxy replica (examples/kubernetes runs two), and a
  restarted proxy, sends one prefix to the same home; keyed per process like the block keys,
  each replica would pick its own home and split the prefix's cache hits. A client crafting
  collisions gains nothing here: it only chooses a home, and the load slack bounds that;
- its input is one span of text, not a chain of blocks: its only job is to agree with itself.

Where the cache index is on, what it knows comes first: ``CacheAware`` (policies.py) picks the
instance holding the longest cached prefix and falls back to the side's policy (``prefix_aware``
among them) when no instance holds one within the slack.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple, NewType

import msgspec

__all__ = ["BlockExtra", "BlockKey", "NO_EXTRA", "ROOT", "block_keys", "chain", "encode_extra",
           "prefix_key", "rendezvous_weight", "token_bytes"]

BlockKey = NewType("BlockKey", int)
"""64 bits naming one block and every token before it (a chained hash). Keyed with a secret
drawn per process, so no client can craft token sequences whose keys collide with another's."""

ROOT = BlockKey(0)
"""The parent of a prompt's first block."""

_encode = msgspec.msgpack.Encoder().encode
_HASH = hashlib.blake2b(digest_size=8, key=os.urandom(16))


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as uint32 (4 bytes each: every vocabulary fits); ValueError otherwise."""
    try:
        return array("I", token_ids).tobytes()
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None


def encode_extra(keys: Sequence[Any] | None) -> bytes:
    """A block's extra keys as they go into its key (b"" when it has none)."""
    return _encode(keys) if keys else b""


def chain(parent: int, block: bytes, extra: bytes) -> BlockKey:
    """The key of a block: its parent's key, its tokens (``token_bytes``), its extra keys
    (``encode_extra``)."""
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
        return encode_extra(keys)


NO_EXTRA = BlockExtra()


def block_keys(token_ids: Sequence[int], block_size: int, extra: BlockExtra = NO_EXTRA,
               limit: int | None = None) -> list[BlockKey]:
    """The keys of the full blocks of ``token_ids`` (at most ``limit``), first block first.

    Raises ValueError for a token id outside [0, 2**32).
    """
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    data = token_bytes(token_ids[:n * block_size])
    step = 4 * block_size
    keys: list[BlockKey] = []
    parent = ROOT
    for i in range(n):
        parent = chain(parent, data[i * step:(i + 1) * step], extra.for_block(i))
        keys.append(parent)
    return keys


def prefix_key(text: str, chars: int) -> bytes:
    """The placement key of a prompt: its text's first ``chars`` characters, as bytes (a lone
    surrogate, which JSON may carry, included)."""
    return text[:chars].encode("utf-8", "surrogatepass")


def rendezvous_weight(key: bytes, url: str) -> int:
    """The weight of instance ``url`` for placement key ``key``: unkeyed, so the same on every
    proxy and across restarts; the highest weight among the candidates is the key's home, and
    removing an instance moves only the keys it was home to."""
    return int.from_bytes(hashlib.blake2b(key + url.encode(), digest_size=8).digest(), "big")
