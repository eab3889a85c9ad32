"""The memo of text between special tokens (proxy/routing/token_memo.py): the ids it gives equal the
whole text's, it tokenizes only what is new, it stays within its bound, and it stays off for
tokenizers whose pieces depend on each other."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from kvdisagg.local.tiny_model import _WORDS, ensure_tiny_model
from kvdisagg.proxy.config import TokenizerConfig
from kvdisagg.proxy.routing.token_memo import SegmentMemo
from kvdisagg.proxy.routing.tokens import RequestTokenizer

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tok() -> RequestTokenizer:
    t = RequestTokenizer(TokenizerConfig(model=str(ensure_tiny_model())))
    asyncio.run(t.start())
    return t


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def test_a_conversation_tokenizes_only_its_new_messages(tok: RequestTokenizer) -> None:
    local: Any = tok._local
    memo: SegmentMemo = local.memo
    assert memo is not None  # the tiny model's template ends each message with </s>
    hf = local.tok
    rng = random.Random(7)
    messages = [{"role": "system", "content": words(rng, 300)}]
    for turn in range(4):
        messages.append({"role": "user", "content": words(rng, 40) + " \n ümlaut, 42! "})
        body = {"messages": list(messages)}
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        new_chars = memo.missing_chars(text)
        misses = memo.misses
        assert tok.local(body, True) == [hf(text, add_special_tokens=False)["input_ids"]]
        if turn:  # the system prompt and earlier turns came from the memo
            assert new_chars < len(text) / 3
            assert memo.misses - misses == 2  # the last answer and the new user message
        messages.append({"role": "assistant", "content": words(rng, 20)})
    assert memo.hits > 0


def test_the_memo_keeps_to_its_bound(tok: RequestTokenizer) -> None:
    local: Any = tok._local
    memo = SegmentMemo.build(local._rust, max_tokens=50)
    assert memo is not None
    rng = random.Random(3)
    texts = [f"<s>{words(rng, 12)}</s>{words(rng, 12)}" for _ in range(20)]
    for text in texts + texts:
        assert memo.encode(text) == local.tok(text, add_special_tokens=False)["input_ids"]
        assert memo._held <= 50
    big = words(rng, 200)  # more ids than the bound: encoded, not kept
    assert memo.encode(big) == local.tok(big, add_special_tokens=False)["input_ids"]
    assert big not in memo._pieces
    assert SegmentMemo.build(local._rust, max_tokens=0) is None


def _tokenizer(pre_tokenizer: Any, added: Any) -> Any:
    models, trainers = tokenizers.models, tokenizers.trainers
    t = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizer
    t.train_from_iterator([words(random.Random(1), 400)],
                          trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"],
                                              show_progress=False))
    t.add_special_tokens([added])
    return t


def test_off_where_pieces_depend_on_each_other() -> None:
    pre, added_token = tokenizers.pre_tokenizers, tokenizers.AddedToken
    plain = _tokenizer(pre.Metaspace(prepend_scheme="always"), added_token("<sep>"))
    assert SegmentMemo.build(plain, 1000) is not None
    # the first piece of a text alone gets the prefix space
    first = _tokenizer(pre.Metaspace(prepend_scheme="first"), added_token("<sep>"))
    assert SegmentMemo.build(first, 1000) is None
    # a token that swallows the whitespace beside it
    strip = _tokenizer(pre.Metaspace(prepend_scheme="always"),
                       added_token("<sep>", lstrip=True, rstrip=True))
    assert SegmentMemo.build(strip, 1000) is None
    plain.encode_special_tokens = True  # special tokens encoded as text: nothing to cut at
    assert SegmentMemo.build(plain, 1000) is None
