"""What bench asks an endpoint before loading it (kvdisagg/bench/endpoint.py), against
tests.support.fake_vllm on loopback: its model and max_model_len, and where its vocabulary
ends, found by bisection over /detokenize."""

from __future__ import annotations

import pytest

from kvdisagg.bench.endpoint import ModelCard, detokenizes, model_card, vocabulary_end
from kvdisagg.errors import EndpointError
from tests.support.fake_vllm import FakeVllm
from tests.support.fake_vllm import served_in_thread as served


def test_model_card_lists_the_first_model_and_its_length() -> None:
    fake = FakeVllm()
    with served(fake) as url:
        assert model_card(url, None, 2.0) == ModelCard("tiny", None)
        fake.max_model_len = 2048
        assert model_card(url, "sk-1", 2.0) == ModelCard("tiny", 2048)
    assert fake.seen == []  # /v1/models is not a generation request
    with pytest.raises(EndpointError, match=r"cannot list models at http://127.0.0.1:1/v1/models"):
        model_card("http://127.0.0.1:1", None, 1.0)


@pytest.mark.parametrize("vocab", [1, 11, 12, 341, 499, 500])
def test_vocabulary_end_is_found_by_bisection(vocab: int) -> None:
    fake = FakeVllm()
    fake.vocab_size = vocab
    with served(fake) as url:
        end = vocabulary_end(url, "tiny", 10, 500, None, 2.0)
    assert end == (None if vocab >= 500 else max(vocab, 10))
    asked = [s["body"]["tokens"] for s in fake.seen]
    assert all(len(t) == 1 for t in asked) and len(asked) <= 2 + 9  # log2(490) probes


def test_an_endpoint_that_cannot_say_keeps_the_range() -> None:
    fake = FakeVllm()  # /detokenize echoes: no "prompt" in the answer
    with served(fake) as url:
        assert detokenizes(url, "tiny", 5, None, 2.0) is None
        assert vocabulary_end(url, "tiny", 10, 500, None, 2.0) is None
    assert detokenizes("http://127.0.0.1:1", "tiny", 5, None, 1.0) is None


def test_the_api_key_goes_with_every_probe() -> None:
    fake = FakeVllm()
    fake.vocab_size = 100
    with served(fake) as url:
        vocabulary_end(url, "tiny", 10, 500, "sk-probe", 2.0)
    assert {s["headers"].get("Authorization") for s in fake.seen} == {"Bearer sk-probe"}
