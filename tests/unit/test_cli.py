"""The ``kvdisagg`` command line: every subcommand reachable, and only the one run imported."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from kvdisagg.cli import COMMANDS, main


def imported_after(argv: list[str]) -> set[str]:
    code = ("import sys\nfrom kvdisagg.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit:\n    pass\nprint(' '.join(m for m in sys.modules "
            "if m.startswith('kvdisagg')))\n")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return set(out)


def test_help_imports_no_command():
    loaded = imported_after(["--help"])
    assert not loaded & {c.module for c in COMMANDS.values()}, loaded


def test_a_command_imports_only_its_own_module():
    loaded = imported_after(["plan", "--help"])
    others = {c.module for name, c in COMMANDS.items() if name != "plan"}
    assert COMMANDS["plan"].module in loaded
    assert not loaded & others, loaded & others


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_module_has_the_interface(name):
    module = importlib.import_module(COMMANDS[name].module)
    assert callable(module.add_arguments) and callable(module.run)
    assert not hasattr(module, "HELP")  # one home for the help line: COMMANDS


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2
    assert "invalid choice: 'no-such-command'" in capsys.readouterr().err


# A command of this module's own (registered by the tests below): it fails as --fail says.
FAILURES = {
    "config": lambda: _raise_config(),
    "transport": lambda: _raise_transport(),
    "os": lambda: open("/nonexistent/kvdisagg/file"),
    "bug": lambda: {}["no-such-key"],
    "interrupt": lambda: _raise(KeyboardInterrupt()),
    "exit": lambda: _raise(SystemExit("kvdisagg boom: a message of its own")),
}


def _raise(exc: BaseException) -> None:
    raise exc


def _raise_config() -> None:
    from kvdisagg.errors import ConfigError

    raise ConfigError("--gpus must be >= 1, got 0")


def _raise_transport() -> None:
    from kvdisagg.errors import PeerUnreachable

    raise PeerUnreachable("cannot connect to 10.1.2.3:5600 within 30s")


def add_arguments(p):
    p.add_argument("--fail", choices=sorted(FAILURES), required=True)


def run(args):
    FAILURES[args.fail]()
    return 0


@pytest.fixture
def boom(monkeypatch):
    from kvdisagg.cli import Command

    monkeypatch.setitem(COMMANDS, "boom", Command(__name__, "fails on purpose"))
    monkeypatch.delenv("KVDISAGG_DEBUG", raising=False)


@pytest.mark.parametrize("kind,status,line", [
    ("config", 2, "kvdisagg boom: --gpus must be >= 1, got 0"),
    ("transport", 1, "kvdisagg boom: cannot connect to 10.1.2.3:5600 within 30s"),
    ("os", 1, "kvdisagg boom: [Errno 2] No such file or directory: '/nonexistent/kvdisagg/file'"),
    ("bug", 1, "kvdisagg boom: unexpected error, a bug (KeyError: 'no-such-key'); "
               "`kvdisagg --debug boom ...` shows its traceback"),
    ("interrupt", 130, "kvdisagg boom: interrupted"),
])
def test_every_failure_is_one_line_and_a_nonzero_exit(boom, capsys, kind, status, line):
    assert main(["boom", "--fail", kind]) == status
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [line] and captured.out == ""


def test_a_commands_own_exit_message_stands(boom):
    with pytest.raises(SystemExit, match="kvdisagg boom: a message of its own"):
        main(["boom", "--fail", "exit"])


def test_debug_flag_or_environment_shows_the_traceback(boom, monkeypatch):
    with pytest.raises(KeyError):
        main(["--debug", "boom", "--fail", "bug"])
    from kvdisagg.errors import ConfigError

    monkeypatch.setenv("KVDISAGG_DEBUG", "1")
    with pytest.raises(ConfigError):
        main(["boom", "--fail", "config"])
    monkeypatch.setenv("KVDISAGG_DEBUG", "0")
    assert main(["boom", "--fail", "config"]) == 2


@pytest.mark.parametrize("argv", [
    ["plan", "--profile", "/nonexistent.json", "--ttft-slo", "1", "--tpot-slo", "1", "--gpus",
     "2"],
    ["bench", "--url", "http://127.0.0.1:1", "--rate", "1", "--connect-timeout", "1"],
    ["bench", "--url", "http://127.0.0.1:1", "--rate", "1", "--model", "m", "--out",
     "/proc/kvdisagg-bench"],
    ["proxy", "--config", "/nonexistent.yaml"],
    ["admin", "list", "--proxy", "http://127.0.0.1:1", "--timeout", "1"],
])
def test_real_failures_print_no_traceback(argv):
    res = subprocess.run([sys.executable, "-m", "kvdisagg.cli", *argv], capture_output=True,
                         text=True, timeout=120, env=_no_debug_env())
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr
    first = res.stderr.strip().splitlines()[0]
    assert first.startswith(f"kvdisagg {argv[0]}"), res.stderr


def _no_debug_env():
    import os

    return {k: v for k, v in os.environ.items() if k != "KVDISAGG_DEBUG"}


# The packages of the extras (kvdisagg.cli.EXTRAS) made unimportable, as on a host installed
# without them (the proxy's image): a meta path finder that refuses them.
BLOCKER = """
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {names!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Blocked())
"""


def without_extras(code: str, *argv: str) -> subprocess.CompletedProcess[str]:
    from kvdisagg.cli import EXTRAS

    return subprocess.run([sys.executable, "-c", BLOCKER.format(names=set(EXTRAS)) + code,
                           *argv], capture_output=True, text=True, timeout=120)


def test_the_proxy_needs_no_extra():
    """The proxy's application, `kvdisagg proxy --help` and `kvdisagg admin` without numpy,
    rich or matplotlib: the base install (the proxy's image) carries none of them."""
    code = ("import kvdisagg.proxy.app, kvdisagg.proxy.cli, kvdisagg.proxy.admin_cli\n"
            "from kvdisagg.cli import main\n"
            "for argv in (['proxy', '--help'], ['admin', 'list', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n"
            "        assert e.code == 0, (argv, e.code)\n"
            "print('loaded:', sorted(m for m in sys.modules if m.partition('.')[0] in "
            "('numpy', 'rich', 'matplotlib')))\n")
    res = without_extras(code)
    assert res.returncode == 0, res.stderr
    assert "--prefill-dns NAME:PORT" in res.stdout and "--each-address" in res.stdout
    assert res.stdout.rstrip().endswith("loaded: []")


def test_the_blocker_blocks():
    res = without_extras("import numpy\n")
    assert res.returncode == 1 and "No module named 'numpy'" in res.stderr


def test_a_command_needing_an_extra_names_it():
    """`kvdisagg simulate` without numpy: one line naming the extra, exit 1, no traceback."""
    code = "from kvdisagg.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    res = without_extras(code, "simulate", "--profile", "vllm-a100", "--ttft-slo", "1",
                         "--tpot-slo", "0.1")
    assert res.returncode == 1
    assert res.stderr.splitlines() == [
        "kvdisagg simulate: numpy is not installed: pip install 'kvdisagg[planner]'"]

