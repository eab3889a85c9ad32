"""Request bodies -> token ids (proxy/routing/tokens.py, proxy/routing/chat_template.py) on the tiny
model.

That the ids equal vLLM's own (/tokenize and a real request's prompt_token_ids) is checked on a
real instance in tests/e2e/test_kv_index.py; here: the shapes the local way takes and refuses,
and the port of vLLM's template analysis against vLLM's own functions.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvdisagg.errors import ConfigError
from kvdisagg.local.tiny_model import ensure_tiny_model
from kvdisagg.proxy.config import TokenizerConfig, TokenizerMode
from kvdisagg.proxy.routing.chat_template import accepted_kwargs, detect_content_format
from kvdisagg.proxy.routing.tokens import RequestTokenizer

vllm_hf = pytest.importorskip("vllm.renderers.hf")

# Templates covering what the content-format detection walks: loops over message content, the
# messages list reassigned, a macro taking the content, a bare ``content`` loop.
TEMPLATES = [
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
    ("{% set msgs = messages[1:] %}{% for m in msgs %}{% for p in m['content'] | list %}"
     "{{ p }}{% endfor %}{% endfor %}"),
    ("{% macro render(c) %}{% for p in c %}{{ p['text'] }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ render(m['content']) }}{% endfor %}"),
    ("{% for m in messages %}{% set content = m['content'] %}{% for x in content %}{{ x }}"
     "{% endfor %}{% endfor %}"),
    ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
     "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}{% endfor %}"),
    ("{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}"
     "{% if add_generation_prompt %}A:{% endif %}{{ enable_thinking }}"),
    "{% for %}broken",
]


def vllm_templates() -> list[str]:
    folder = Path(vllm_hf.__file__).parents[1] / "transformers_utils" / "chat_templates"
    return [p.read_text() for p in sorted(folder.glob("*.jinja"))]


@pytest.fixture(scope="module")
def tok() -> RequestTokenizer:
    t = RequestTokenizer(TokenizerConfig(model=str(ensure_tiny_model())))
    asyncio.run(t.start())
    return t


def test_content_format_port_agrees_with_vllm() -> None:
    templates = TEMPLATES + vllm_templates()
    assert len(templates) > len(TEMPLATES) + 3
    got = [detect_content_format(t) for t in templates]
    assert got == [vllm_hf._detect_content_format(t, default="string") for t in templates]
    assert set(got) == {"string", "openai"}  # the cases above exercise both answers


def test_accepted_kwargs_port_agrees_with_vllm(tok: RequestTokenizer) -> None:
    hf = tok._local.tok  # type: ignore[union-attr]
    kwargs = {"add_generation_prompt": True, "continue_final_message": False,
              "enable_thinking": True, "made_up": 1, "return_dict": False, "documents": None,
              "tools": None, "custom": "x"}
    for template in TEMPLATES[:-1] + [hf.chat_template]:
        assert accepted_kwargs(hf, template, kwargs) == vllm_hf.resolve_chat_template_kwargs(
            hf, template, kwargs)


def test_completions(tok: RequestTokenizer) -> None:
    hf = tok._local.tok  # type: ignore[union-attr]
    text = "hello world, the quick brown fox"
    ids = hf(text)["input_ids"]
    assert tok.local({"prompt": text}, False) == [ids]
    assert tok.local({"prompt": [text, "b"]}, False) == [ids, hf("b")["input_ids"]]
    assert tok.local({"prompt": [5, 6, 7]}, False) == [[5, 6, 7]]
    assert tok.local({"prompt": [[5, 6], [7]]}, False) == [[5, 6], [7]]
    assert tok.local({"prompt": text, "add_special_tokens": False}, False) == [
        hf(text, add_special_tokens=False)["input_ids"]]
    for body in ({"prompt": [-1, 2]}, {"prompt": []}, {"prompt": [[1], "x"]}, {"prompt": 5},
                 {"prompt": [True, 2]}, {"prompt": text, "prompt_embeds": "AAAA"},
                 {"prompt": text, "truncate_prompt_tokens": 10},
                 {"prompt": text, "add_special_tokens": "yes"}, {}):
        assert tok.local(body, False) is None, body


def chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"messages": list(messages), **fields}


def test_chat(tok: RequestTokenizer) -> None:
    hf = tok._local.tok  # type: ignore[union-attr]
    sys_ = {"role": "system", "content": "be brief"}
    user = {"role": "user", "content": "hello world"}
    rendered = "<s>system: be brief</s>\nuser: hello world</s>\nassistant: "
    assert tok.local(chat(sys_, user), True) == [hf(rendered, add_special_tokens=False)
                                                 ["input_ids"]]
    no_gen = tok.local(chat(sys_, user, add_generation_prompt=False), True)
    assert no_gen == [hf(rendered[:-len("assistant: ")], add_special_tokens=False)["input_ids"]]
    # text parts are joined with newlines (the tiny template reads content as a string)
    parts = {"role": "user", "content": [{"type": "text", "text": "hello"},
                                         {"type": "text", "text": "world"}]}
    assert tok.local(chat(parts), True) == [
        hf("<s>user: hello\nworld</s>\nassistant: ", add_special_tokens=False)["input_ids"]]
    # what clients echo back from a previous answer is ignored by vLLM, and here too
    echoed = {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": None,
              "annotations": []}
    assert tok.local(chat(user, echoed, user), True) is not None
    refused = [
        chat(user, tools=[{"type": "function", "function": {"name": "f"}}]),
        chat(user, documents=[{"text": "d"}]), chat(user, reasoning_effort="low"),
        chat(user, chat_template="{{ messages }}"),
        chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
        chat({"role": "assistant", "content": None,
              "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}]}),
        chat({"role": "developer", "content": "x"}), chat({"role": "tool", "content": "x"}),
        chat({"role": "system", "content": "x-anthropic-billing-header: cch=1\nrest"}),
        chat(user, add_generation_prompt=True, continue_final_message=True),
        chat(user, chat_template_kwargs={"tokenize": True}), chat(user, chat_template_kwargs=3),
        chat(), {"messages": "hi"}, chat("hi"),  # type: ignore[arg-type]
    ]
    for body in refused:
        assert tok.local(body, True) is None, body


def test_no_prediction_without_a_way(tok: RequestTokenizer) -> None:
    async def go() -> None:
        before = tok.unsupported
        body = chat({"role": "developer", "content": "x"})
        assert await tok.token_ids(body, True) is None  # local refuses, no instance to ask
        assert tok.unsupported == before + 1
        assert await tok.token_ids({"prompt": [1, 2]}, False) == [[1, 2]]
        remote = RequestTokenizer(TokenizerConfig(mode=TokenizerMode.REMOTE))
        await remote.start()
        assert await remote.token_ids({"prompt": "x"}, False) is None

    asyncio.run(go())


def test_bad_model_directory() -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        asyncio.run(RequestTokenizer(TokenizerConfig(model="/nonexistent/model")).start())


def test_a_processor_model_leaves_chat_to_tokenize(tmp_path: Path) -> None:
    import shutil

    model = tmp_path / "m"
    shutil.copytree(ensure_tiny_model(), model)
    (model / "preprocessor_config.json").write_text("{}")
    t = RequestTokenizer(TokenizerConfig(model=str(model)))
    asyncio.run(t.start())
    assert t.local({"messages": [{"role": "user", "content": "x"}]}, True) is None
    assert t.local({"prompt": "x"}, False) is not None
    t2 = RequestTokenizer(
        TokenizerConfig(model=str(model), chat_template="{{ messages[0].content }}")
    )
    asyncio.run(t2.start())
    assert t2.local({"messages": [{"role": "user", "content": "hello"}]}, True) == [
        t2._local.tok("hello", add_special_tokens=False)["input_ids"]]  # type: ignore[union-attr]


def test_the_index_modules_import_no_vllm_torch_or_transformers() -> None:
    """The proxy runs without vLLM; transformers is loaded only for tokenizer.mode local."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import kvdisagg.proxy.routing.cache_index, kvdisagg.proxy.routing.tokens\n"
            "import kvdisagg.proxy.routing.kv_events, kvdisagg.proxy.routing.prefix_index\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('vllm', 'torch', 'transformers', 'jinja2')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == "[]"
