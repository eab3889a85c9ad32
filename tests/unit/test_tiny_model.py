"""Fast checks of the offline tiny model generator (no vLLM server)."""

import time

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from kvdisagg.local.tiny_model import ensure_tiny_model  # noqa: E402


def _files(d):
    return {
        p.name: p.read_bytes()
        for p in sorted(d.iterdir())
        if p.suffix == ".safetensors"
    }


def test_deterministic_and_cached(tmp_path):
    a = ensure_tiny_model(tmp_path / "a", seed=0)
    b = ensure_tiny_model(tmp_path / "b", seed=0)
    assert (a / "DONE").exists() and (b / "DONE").exists()
    wa, wb = _files(a), _files(b)
    assert wa and wa == wb
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()

    # No leftover temporary directories next to the targets.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]

    # Second call with the marker present returns quickly, without rewriting.
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    t0 = time.monotonic()
    again = ensure_tiny_model(tmp_path / "a", seed=0)
    assert time.monotonic() - t0 < 0.5
    assert again == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime

    # Config shape matches what the tests and the connector expect.
    import json

    cfg = json.loads((a / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["hidden_size"] == 256
    assert cfg["num_attention_heads"] == 4
    assert cfg["num_key_value_heads"] == 2
    assert cfg["head_dim"] == 64
    assert cfg["num_hidden_layers"] == 2
    assert cfg["vocab_size"] == 512


def test_tokenizer_round_trip(tmp_path):
    from transformers import AutoTokenizer

    d = ensure_tiny_model(tmp_path / "m", seed=0)
    tok = AutoTokenizer.from_pretrained(str(d))
    text = "Hello world, the quick brown fox jumps over 42 lazy dogs! ~{}"
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < 512 for i in ids)
    assert tok.decode(ids) == text
    assert tok.bos_token and tok.eos_token
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "user: hi" in prompt and prompt.endswith("assistant: ")


def test_different_seed_differs(tmp_path):
    a = ensure_tiny_model(tmp_path / "s0", seed=0)
    b = ensure_tiny_model(tmp_path / "s1", seed=1)
    assert _files(a) != _files(b)
