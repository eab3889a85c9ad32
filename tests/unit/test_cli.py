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
