"""``kvdisagg bench``'s command line (kvdisagg/bench/cli.py) against tests.support.fake_vllm: the
token-id range kept inside the endpoint's vocabulary (the demo's tiny model knows fewer ids than
the default range), a workload past max_model_len refused, the API key from a file or the
environment only, and every failure one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvdisagg.cli import main
from tests.support.fake_vllm import FakeVllm, served_in_thread


def fake(**attrs: Any) -> FakeVllm:
    f = FakeVllm("f", tokens=3)
    f.use_max_tokens = True
    for k, v in attrs.items():
        setattr(f, k, v)
    return f


def bench(url: str, out: Path, *more: str) -> int:
    return main(["bench", "--url", url, "--rate", "50", "--num-requests", "6", "--warmup", "1",
                 "--output-len", "3", "--quiet", "--no-plots", "--out", str(out), *more])


def prompt_ids(f: FakeVllm) -> list[int]:
    return [t for s in f.seen if s["path"] == "/v1/completions" for t in s["body"]["prompt"]]


@pytest.fixture(autouse=True)
def _no_key_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVDISAGG_API_KEY", raising=False)


def test_default_range_ends_where_the_vocabulary_does(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A tokenizer of 341 ids (as the issue's tiny model): the default 10:500 becomes 10:341,
    said in one line, and every request succeeds."""
    f = fake(vocab_size=341)
    with served_in_thread(f) as url:
        assert bench(url, tmp_path / "out", "--json") == 0
    ids = prompt_ids(f)
    assert ids and min(ids) >= 10 and max(ids) < 341
    err = capsys.readouterr().err
    assert "token ids 10:341: the vocabulary of ep0's model tiny ends at 341" in err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [r["ok"] for r in summary["runs"]] == [6]


def test_a_given_range_past_the_vocabulary_is_refused_in_one_line(tmp_path: Path) -> None:
    f = fake(vocab_size=341)
    with served_in_thread(f) as url, pytest.raises(SystemExit) as exc:
        bench(url, tmp_path / "out", "--token-id-range", "10:500")
    assert str(exc.value) == (
        "kvdisagg bench: --token-id-range 10:500 goes past the vocabulary of ep0's model tiny "
        "(token ids below 341, by its /detokenize): use --token-id-range 10:341 or "
        "--text-prompts")
    assert prompt_ids(f) == []  # refused before any load
    with served_in_thread(f) as url:  # inside it: as given
        assert bench(url, tmp_path / "out", "--token-id-range", "20:30") == 0
    assert set(prompt_ids(f)) <= set(range(20, 30))
    tiny = fake(vocab_size=8)
    with served_in_thread(tiny) as url, pytest.raises(SystemExit, match="knows no token id "
                                                                         "from 10 on"):
        bench(url, tmp_path / "out")


def test_an_endpoint_that_cannot_say_keeps_the_default_range(tmp_path: Path) -> None:
    f = fake()  # no vocab_size: /detokenize echoes, as a server without the route would fail
    with served_in_thread(f) as url:
        assert bench(url, tmp_path / "out") == 0
    assert max(prompt_ids(f)) < 500


def test_text_prompts_ask_no_vocabulary(tmp_path: Path) -> None:
    f = fake(vocab_size=5)
    with served_in_thread(f) as url:
        assert bench(url, tmp_path / "out", "--text-prompts") == 0
    assert not [s for s in f.seen if s["path"] == "/detokenize"]


def test_a_workload_past_max_model_len_is_refused(tmp_path: Path) -> None:
    f = fake(vocab_size=512, max_model_len=200)
    with served_in_thread(f) as url:
        with pytest.raises(SystemExit, match=r"requests of up to 256 prompt \+ 3 output tokens "
                                             r"do not fit ep0's max_model_len 200"):
            bench(url, tmp_path / "out")
        assert bench(url, tmp_path / "out", "--max-prompt-len", "190") == 0


def test_api_key_from_a_file_or_the_environment_never_the_command_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = fake(vocab_size=512)
    with served_in_thread(f) as url:
        with pytest.raises(SystemExit, match="--api-key is not accepted: any local user can "
                                             "read a command line.*--api-key-file FILE"):
            bench(url, tmp_path / "out", "--api-key", "sk-in-ps")
        key = tmp_path / "key"
        key.write_text("sk-file\n")
        assert bench(url, tmp_path / "out", "--api-key-file", str(key)) == 0
        sent = {s["headers"].get("Authorization") for s in f.seen}
        assert sent == {"Bearer sk-file"}, sent
        f.seen.clear()
        monkeypatch.setenv("KVDISAGG_API_KEY", "sk-env")
        assert bench(url, tmp_path / "out") == 0
        assert {s["headers"].get("Authorization") for s in f.seen} == {"Bearer sk-env"}
        with pytest.raises(SystemExit, match="--api-key-file: .* is empty"):
            key.write_text("")
            bench(url, tmp_path / "out", "--api-key-file", str(key))


def test_a_failed_warm_up_is_one_line_not_a_traceback(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    f = fake(vocab_size=512, status=400)
    with served_in_thread(f) as url:
        assert bench(url, tmp_path / "out") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"kvdisagg bench: warm-up request to ep0 ({url}) failed: HTTP 400"), err


def test_without_matplotlib_the_plots_are_skipped_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """matplotlib is the ``bench`` extra: without it the run still writes its records and
    summary, and says how to get the plots."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    f = fake(vocab_size=512)
    with served_in_thread(f) as url:
        assert main(["bench", "--url", url, "--rate", "50", "--num-requests", "3", "--warmup",
                     "1", "--output-len", "3", "--quiet", "--out", str(tmp_path)]) == 0
    assert "plots skipped: matplotlib is not installed (pip install 'kvdisagg[bench]'" in \
        capsys.readouterr().err
    assert (tmp_path / "summary.json").is_file() and not list(tmp_path.glob("*.png"))
