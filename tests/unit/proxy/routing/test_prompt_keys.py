"""How a prompt is hashed (proxy/routing/prompt_keys.py): block keys, keyed per process, for the
cache index; the placement key, the same in every process, for prefix_aware."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdisagg.proxy.routing.prompt_keys import (
    ROOT,
    BlockExtra,
    block_keys,
    chain,
    encode_extra,
    prefix_key,
    rendezvous_weight,
    token_bytes,
)

BS = 4
T = list(range(100, 140))
SRC = Path(__file__).resolve().parents[4] / "src"


def in_another_process(code: str) -> str:
    return subprocess.run([sys.executable, "-c", "from kvdisagg.proxy.routing.prompt_keys "
                           f"import *\nprint({code})"], capture_output=True, text=True, timeout=60,
                          check=True, env={**os.environ, "PYTHONPATH": str(SRC)}).stdout.strip()


def test_block_keys_chain_each_block_onto_its_parent() -> None:
    keys = block_keys(T[:10], BS)
    assert len(keys) == 2 and len(set(keys)) == 2 and all(0 <= k < 1 << 64 for k in keys)
    first = chain(ROOT, token_bytes(T[:4]), b"")
    assert keys == [first, chain(first, token_bytes(T[4:8]), b"")]
    assert block_keys(T[:10], BS, limit=1) == keys[:1]
    assert block_keys(T[4:8], BS) != keys[1:]  # a key names the whole prefix
    salted = block_keys(T[:8], BS, BlockExtra(cache_salt="x"))
    assert salted[0] == chain(ROOT, token_bytes(T[:4]), encode_extra(["x"])) != keys[0]
    # the salt is on block 0 only, and the next key chains on it
    assert salted[1] == chain(salted[0], token_bytes(T[4:8]), b"") != keys[1]
    lora = block_keys(T[:8], BS, BlockExtra(lora_name="ad"))
    assert lora[1] == chain(lora[0], token_bytes(T[4:8]), encode_extra(["ad"]))
    assert encode_extra([]) == encode_extra(None) == b""
    with pytest.raises(ValueError):
        block_keys([1.5] * 4, BS)  # type: ignore[list-item]
    with pytest.raises(ValueError):
        block_keys([1 << 32] * 4, BS)


def test_block_keys_are_keyed_per_process_the_placement_key_is_not() -> None:
    """A block key is secret per process (no crafted collisions); a placement key is the same
    on every proxy replica and across restarts, so they all send a prefix to one home."""
    here = block_keys(T[:4], BS)[0]
    assert int(in_another_process("block_keys(list(range(100, 104)), 4)[0]")) != here
    weight = rendezvous_weight(prefix_key("system prompt", 256), "http://p0:8000")
    assert in_another_process("rendezvous_weight(b'system prompt', 'http://p0:8000')") == str(
        weight)
    # the weight prefix_aware has always used: homes do not move on upgrade
    assert weight == int.from_bytes(hashlib.blake2b(b"system prompthttp://p0:8000",
                                                    digest_size=8).digest(), "big")


def test_the_placement_key_is_the_texts_first_characters() -> None:
    assert prefix_key("abcdef", 3) == b"abc"
    assert prefix_key("é" * 5, 2) == "éé".encode()  # characters, not bytes
    assert prefix_key("a\ud800b", 8) == b"a\xed\xa0\x80b"  # a lone surrogate JSON may carry
