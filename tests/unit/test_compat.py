"""The private parts of dependencies kvdisagg relies on (kvdisagg/compat/) are still there, and
behave as the wrappers assume, at the versions pyproject.toml pins; no other module of
src/kvdisagg touches a private attribute of vLLM, torch or aiohttp."""

from __future__ import annotations

import ast
import socket
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "kvdisagg"


def test_vllm_pause_state_toggle() -> None:
    from vllm.v1.core.sched.interface import PauseState

    from kvdisagg.compat._vllm import paused_new

    class FakeScheduler:  # what vLLM's Scheduler does: a property over _pause_state
        def __init__(self) -> None:
            self._pause_state = PauseState.UNPAUSED

        @property
        def pause_state(self) -> PauseState:
            return self._pause_state

    from vllm.v1.core.sched.scheduler import Scheduler

    assert isinstance(Scheduler.pause_state, property)  # reads _pause_state in vLLM 0.32
    s = FakeScheduler()
    with paused_new(s) as paused:
        assert paused and s.pause_state is PauseState.PAUSED_NEW
    assert s.pause_state is PauseState.UNPAUSED
    s._pause_state = PauseState.PAUSED_ALL
    with paused_new(s) as paused:
        assert not paused and s.pause_state is PauseState.PAUSED_ALL
    import inspect

    assert "self._pause_state = pause_state" in inspect.getsource(Scheduler.set_pause_state)


def test_torch_gloo_pair_group_forms_and_sends() -> None:
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from kvdisagg.compat._torch import pair_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store0 = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)
    got = torch.zeros(4)

    def peer() -> None:
        store1 = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10))
        g = pair_group(store1, 1, "gloo", 10.0, "127.0.0.1")
        g.recv([got], 0, 0).wait()

    t = threading.Thread(target=peer)
    t.start()
    g = pair_group(store0, 0, "gloo", 10.0, "127.0.0.1")
    g.send([torch.arange(4, dtype=torch.float32)], 1, 0).wait()
    t.join(10)
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_aiohttp_headers_wait_for_the_first_chunk() -> None:
    from aiohttp import web

    from kvdisagg.compat._aiohttp import HeadersWithFirstChunk

    assert web.StreamResponse._send_headers_immediately is True  # the default we change
    assert HeadersWithFirstChunk._send_headers_immediately is False


PRIVATE_OF = ("vllm", "torch", "aiohttp")


def test_no_private_attribute_of_a_dependency_outside_compat() -> None:
    """An attribute access ``x._name`` where ``x`` is a name imported from vLLM, torch or
    aiohttp (or a module of theirs), outside kvdisagg/compat/."""
    found = []
    for path in SRC.rglob("*.py"):
        if "compat" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PRIVATE_OF:
                deps.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update((a.asname or a.name).split(".")[0] for a in node.names
                            if a.name.split(".")[0] in PRIVATE_OF)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                    and node.value.id in deps):
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.value.id}.{node.attr}")
    assert not found, found


@pytest.mark.parametrize("code,caught", [("from vllm.x import Y\nY._z\n", True),
                                         ("import torch\ntorch._C\n", True),
                                         ("from foo import Y\nY._z\n", False)])
def test_the_private_access_check_can_fail(tmp_path: Path, code: str, caught: bool) -> None:
    tree = ast.parse(code)
    deps = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            and (n.module or "").split(".")[0] in PRIVATE_OF for a in n.names}
    deps |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
             if a.name in PRIVATE_OF}
    hits = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and n.attr.startswith("_") and isinstance(n.value, ast.Name) and n.value.id in deps]
    assert bool(hits) is caught


def test_vllm_cpu_runner_rewinds_dropped_samples_by_offset() -> None:
    """What compat/_vllm_cpu.py wraps: CPUModelRunner's ``_sample`` and ``_bookkeeping_sync``,
    the latter rewinding dropped samples' generators with set_offset (vLLM 0.32)."""
    import inspect

    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert callable(CPUModelRunner._sample)
    source = inspect.getsource(GPUModelRunner._bookkeeping_sync)
    assert "discard_request_mask" in source and "set_offset" in source


def test_a_continuation_is_detokenized_as_the_plain_instance_did() -> None:
    """(issue 26) a continuation's prompt ends inside a multi-byte character (the client got
    its first byte): primed with the whole prompt, vLLM's detokenizer then returns the whole
    prompt's text with the character; primed where the original prompt ended and stepped
    through the delivered tokens, it returns what the plain instance returned."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    from kvdisagg.compat._vllm_detokenizer import prime_continuations, resume_point
    from kvdisagg.connector.protocol.params import RESUME_PARAMS_KEY
    from kvdisagg.local.tiny_model import ensure_tiny_model

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    prompt, out = [400, 7], [131, 106, 70, 71]  # "river$", then "é" in two bytes, "cd"

    def texts(prompt_ids: list[int], tokens: list[int], kv: dict | None = None) -> list[str]:
        params = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": kv} if kv
                                else None)
        req = SimpleNamespace(request_id="r", prompt_token_ids=prompt_ids,
                              sampling_params=params)
        d = FastIncrementalDetokenizer(tok, req)
        return [d.decode_next(t) for t in tokens]

    plain = texts(prompt, out)
    assert plain == ["", "é", "c", "d"]
    cut = [*prompt, out[0]]  # the client has the first byte
    assert texts(cut, out[1:])[0] != "é"  # vLLM's own priming: the bug this works around
    prime_continuations()
    prime_continuations()  # idempotent
    assert texts(cut, out[1:], {RESUME_PARAMS_KEY: len(prompt)}) == plain[1:]
    assert texts(prompt, out) == plain  # requests without the mark are untouched
    bad = SimpleNamespace(prompt_token_ids=cut, sampling_params=SamplingParams(
        extra_args={"kv_transfer_params": {RESUME_PARAMS_KEY: 9}}))
    assert resume_point(bad) is None  # past the prompt: ignored
