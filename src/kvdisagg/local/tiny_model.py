"""Generate a tiny, deterministic Llama-architecture model for offline tests.

The model has random weights (seeded) and a byte-level BPE tokenizer trained
on a fixed corpus generated in code, so nothing is downloaded and the result
is identical on every machine for a given seed.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["ensure_tiny_model", "default_cache_dir", "TINY_CONFIG"]

DONE_MARKER = "DONE"
REVISION = 2
"""Bumped when what is generated changes (a new cache directory). 2: messages end with EOS."""

TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_hidden_layers=2,
    intermediate_size=512,
    vocab_size=512,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    dtype="float32",
)

BOS = "<s>"
EOS = "</s>"
UNK = "<unk>"
PAD = "<pad>"

# Each message ends with the EOS token, as Zephyr's template does: like real models' templates
# (ChatML, Llama 3, Gemma), a special token separates the messages.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_WORDS = (
    "the a an of to and in is it that for on with as was at by be this from "
    "or have not are but had they his her she he we you your our their there "
    "what when where which who how why all one two three four five six seven "
    "eight nine ten cache block key value token prefill decode model layer "
    "attention head server client request response transfer memory page "
    "stream batch queue time data fast slow small large tiny simple test "
    "hello world quick brown fox jumps over lazy dog river mountain city "
    "system user assistant question answer number letter word sentence story"
).split()


def default_cache_dir(seed: int = 0) -> Path:
    return Path.home() / ".cache" / "kvdisagg" / f"tiny-llama-r{REVISION}-{seed}"


def _corpus(seed: int, n_lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        words[0] = words[0].capitalize()
        line = " ".join(words) + rng.choice([".", "!", "?", ","])
        if i % 7 == 0:
            line += f" {rng.randint(0, 9999)}"
        lines.append(line)
    # Make sure all printable ASCII characters appear at least once.
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def _build_tokenizer(out: Path, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    vocab = TINY_CONFIG["vocab_size"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=[UNK, BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    assert tok.get_vocab_size() <= vocab, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=TINY_CONFIG["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _build_model(out: Path, seed: int, bos_id: int, eos_id: int, pad_id: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg_kwargs = dict(TINY_CONFIG)
    config = LlamaConfig(
        **cfg_kwargs,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out))


def ensure_tiny_model(cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Return a directory holding the tiny model, generating it if needed.

    Generation is offline and deterministic. If ``cache_dir/DONE`` exists the
    directory is returned without touching it. Otherwise the model is built in
    a temporary sibling directory and renamed into place atomically.
    """
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir(seed)
    target = target.expanduser()
    if (target / DONE_MARKER).exists():
        return target

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _build_tokenizer(tmp, seed)
        from transformers import PreTrainedTokenizerFast

        t = PreTrainedTokenizerFast.from_pretrained(str(tmp))
        _build_model(tmp, seed, t.bos_token_id, t.eos_token_id, t.pad_token_id)
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        (tmp / DONE_MARKER).write_text(f"seed={seed}\n")
        if target.exists():
            # Incomplete previous attempt (no DONE marker): replace it.
            if (target / DONE_MARKER).exists():
                shutil.rmtree(tmp, ignore_errors=True)
                return target
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            # Lost a race with a concurrent generator.
            if (target / DONE_MARKER).exists():
                shutil.rmtree(tmp, ignore_errors=True)
                return target
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


if __name__ == "__main__":  # pragma: no cover
    import sys

    print(ensure_tiny_model(Path(sys.argv[1]) if len(sys.argv) > 1 else None))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    print(ensure_tiny_model(seed=args.seed))
    return 0
