"""Exact token ids of a long prompt for the price of its new part: a memo of the text between
special tokens.

A HuggingFace fast tokenizer first cuts the text at its added tokens (``<|im_start|>``,
``</s>``, ...), then normalizes, pre-tokenizes and encodes each piece between them on its own.
So the ids of a text are the concatenation of each piece's ids and the added tokens' ids, and a
piece tokenized once (a chat's system prompt, its earlier turns) need not be tokenized again.
Chat templates put special tokens between messages (ChatML, Llama 3, Mistral, Gemma, Zephyr, the
tiny model), so for turn N of a conversation only the new messages are tokenized.

Exact or not used: ``SegmentMemo.build`` returns None for a tokenizer where pieces are not
independent (a ``Metaspace`` that prepends only to the first piece, added tokens that strip their
neighbours' whitespace or match only whole words, special tokens not split out), and checks
itself against the whole-text encoding on a sample before it is trusted.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

log = logging.getLogger("kvdisagg.proxy.routing.tokens")

# Texts the memo is checked on at start-up: pieces touching the special tokens with spaces,
# newlines, punctuation and non-ASCII text on either side.
_PROBES = (
    " hello world ", "\n\nA line.\n", "x", "  two  spaces  ", "ümlaut, 東京 and é!",
    "ends with a space ", "\tTabbed\t", "42 is 6*7", "'s 're don't",
)


class SegmentMemo:
    """Token ids of texts, each piece between added tokens encoded once and remembered (LRU,
    up to ``max_tokens`` ids in all). Thread-safe: the proxy's loop encodes short texts, worker
    threads long ones."""

    def __init__(self, rust: Any, splitter: re.Pattern[str], special_ids: dict[str, int],
                 max_tokens: int) -> None:
        self._rust = rust
        self._encode_batch = getattr(rust, "encode_batch_fast", rust.encode_batch)
        self._split = splitter.split
        self._special = special_ids
        self._max_tokens = max_tokens
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._held = 0
        self.hits = 0
        self.misses = 0

    @classmethod
    def build(cls, rust: Any, max_tokens: int) -> SegmentMemo | None:
        """A memo for this Rust tokenizer, or None (logged) where pieces are not independent."""
        if max_tokens <= 0:
            return None
        why = _not_independent(rust)
        if why:
            log.info("tokens: every prompt is tokenized whole (%s)", why)
            return None
        added = [t for t in rust.get_added_tokens_decoder().values()
                 if not t.normalized and t.content]
        if not added:
            log.info("tokens: every prompt is tokenized whole (the tokenizer has no added "
                     "tokens to cut at)")
            return None
        # Longest first: an added token that starts another must not cut it (HF matches the
        # longest too).
        contents = sorted({t.content for t in added}, key=len, reverse=True)
        splitter = re.compile("(" + "|".join(map(re.escape, contents)) + ")")
        ids = {c: rust.token_to_id(c) for c in contents}
        memo = cls(rust, splitter, ids, max_tokens)
        if not memo.agrees_on_probes(contents):
            log.warning("tokens: cutting at added tokens changed the ids on a probe; every "
                        "prompt is tokenized whole")
            return None
        memo._pieces.clear()
        memo._held = memo.hits = memo.misses = 0
        return memo

    def agrees_on_probes(self, specials: list[str]) -> bool:
        """Whether the pieces' ids equal the whole text's on texts built around ``specials``."""
        for probe in _PROBES:
            for special in specials[:8]:
                for text in (special + probe + special + probe, probe + special + special
                             + probe, probe + special + probe + special):
                    whole = self._rust.encode(text, add_special_tokens=False).ids
                    if self.encode(text) != list(whole):
                        return False
        return True

    def missing_chars(self, text: str) -> int:
        """How much of ``text`` is not remembered (what encoding it would cost)."""
        with self._lock:
            return sum(len(p) for p in self._split(text)[::2] if p and p not in self._pieces)

    def encode(self, text: str) -> list[int]:
        """``tokenizer(text, add_special_tokens=False)["input_ids"]``, from the memo where it
        can."""
        parts = self._split(text)  # plain text at even positions, added tokens at odd ones
        texts = parts[::2]
        with self._lock:
            got = [self._pieces.get(p) if p else [] for p in texts]
        new = list(dict.fromkeys(p for p, ids in zip(texts, got, strict=True) if ids is None))
        fresh: dict[str, list[int]] = {}
        if new:  # encoded outside the lock: the Rust tokenizer releases the GIL
            fresh = dict(zip(new, (list(e.ids) for e in self._encode_batch(
                new, add_special_tokens=False)), strict=True))
        pieces = [fresh[p] if ids is None else ids for p, ids in zip(texts, got, strict=True)]
        with self._lock:
            self.misses += len(new)
            self.hits += sum(1 for p in texts if p) - len(new)
            for p in texts:
                if p in self._pieces:
                    self._pieces.move_to_end(p)
            for p in new:
                self._remember(p, fresh[p])
        out: list[int] = []
        for i, ids in enumerate(pieces):
            out.extend(ids)
            if 2 * i + 1 < len(parts):
                out.append(self._special[parts[2 * i + 1]])
        return out

    def _remember(self, piece: str, ids: list[int]) -> None:
        if len(ids) > self._max_tokens or piece in self._pieces:
            return
        self._pieces[piece] = ids
        self._held += len(ids)
        while self._held > self._max_tokens:
            self._held -= len(self._pieces.popitem(last=False)[1])


def _not_independent(rust: Any) -> str:
    """Why the pieces between added tokens are not encoded independently, or ''."""
    if getattr(rust, "encode_special_tokens", False):
        return "the tokenizer does not split out its special tokens (split_special_tokens)"
    for t in rust.get_added_tokens_decoder().values():
        if not t.normalized and (t.lstrip or t.rstrip or t.single_word):
            return (f"added token {t.content!r} strips whitespace or matches whole words "
                    "only, so its neighbours depend on it")
    config = json.loads(rust.to_str())
    if '"first"' in json.dumps(config.get("pre_tokenizer")) + json.dumps(
            config.get("normalizer")):
        return "its Metaspace prepends to the first piece of a text only"
    return ""
