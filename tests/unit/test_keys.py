"""Keys from a file or the environment, never argv (kvdisagg/keys.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdisagg.errors import ConfigError
from kvdisagg.keys import key_from, read_key_file, refused_on_command_line


def test_a_key_file_is_read_stripped_and_must_hold_a_key(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("  sk-123\n")
    assert read_key_file(str(key), "--api-key-file") == "sk-123"
    key.write_text("\n")
    with pytest.raises(ConfigError, match=f"^--api-key-file: {key} is empty$"):
        read_key_file(str(key), "--api-key-file")
    with pytest.raises(ConfigError, match="^api_key_file: cannot read .*No such file"):
        read_key_file(str(tmp_path / "missing"), "api_key_file")


def test_the_file_wins_over_the_environment(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVDISAGG_TEST_KEY", raising=False)
    assert key_from(None, "KVDISAGG_TEST_KEY", "--key-file") is None
    monkeypatch.setenv("KVDISAGG_TEST_KEY", " sk-env ")
    assert key_from(None, "KVDISAGG_TEST_KEY", "--key-file") == "sk-env"
    key = tmp_path / "key"
    key.write_text("sk-file")
    assert key_from(str(key), "KVDISAGG_TEST_KEY", "--key-file") == "sk-file"


def test_the_refusal_says_where_the_key_goes() -> None:
    exc = refused_on_command_line("--api-key", "--api-key-file", "KVDISAGG_API_KEY")
    assert isinstance(exc, ConfigError)
    assert str(exc) == ("--api-key is not accepted: any local user can read a command line. Put "
                        "the key in a file (--api-key-file FILE) or in the environment variable "
                        "KVDISAGG_API_KEY")
