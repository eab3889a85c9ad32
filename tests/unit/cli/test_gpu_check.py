"""``kvdisagg gpu-check``: the same checks a GPU runs, on CPU (``--cpu``, a few seconds), and
a clear answer where there is no CUDA device."""

from __future__ import annotations

import pytest

from kvdisagg.cli import main

torch = pytest.importorskip("torch")


def test_cpu_smoke_run_passes_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpu-check", "--cpu"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert [line[:4] for line in lines[:-1]] == ["ok  "] * 4, out
    assert "tcp: prefill TP1 -> decode TP2" in lines[0]
    assert lines[-1].startswith("4/4 passed on cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the real run")
def test_without_cuda_it_says_so_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpu-check"]) == 2
    assert "no CUDA device" in capsys.readouterr().out


def test_a_failed_check_fails_the_command(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from kvdisagg.cli import gpu_check

    monkeypatch.setattr(gpu_check._Checks, "nccl_landed",
                        lambda self: gpu_check._check("nccl: broken on purpose", False))
    assert main(["gpu-check", "--cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL nccl: broken on purpose" in out and "3/4 passed" in out
