"""ProxyConfig: frozen, bounded, and every bad value reported with its key, whether it comes
from code, a YAML/TOML file or a command-line flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from kvdisagg.errors import ConfigError
from kvdisagg.proxy.cli import add_arguments, config_from_args
from kvdisagg.proxy.config import (
    BreakerConfig,
    HealthConfig,
    PolicyConfig,
    ProxyConfig,
    RetryConfig,
    TimeoutConfig,
    load_config_file,
)
from kvdisagg.proxy.types import Admission

BAD = [
    ({"port": 70000}, "port", "70000"),
    ({"port": 0}, "port", "0"),
    ({"breaker": BreakerConfig(open_s=-1)}, "breaker.open_s", "-1"),
    ({"breaker": BreakerConfig(failure_threshold=0)}, "breaker.failure_threshold", "0"),
    ({"drain_timeout_s": -1.0}, "drain_timeout_s", "-1.0"),
    ({"policy": PolicyConfig(prefix_block_chars=-1)}, "policy.prefix_block_chars", "-1"),
    ({"policy": PolicyConfig(prefix_load_slack=-1)}, "policy.prefix_load_slack", "-1"),
    ({"timeouts": TimeoutConfig(decode_total_s=0)}, "timeouts.decode_total_s", "0"),
    ({"timeouts": TimeoutConfig(prefill_s=-5)}, "timeouts.prefill_s", "-5"),
    ({"health": HealthConfig(success_threshold=0)}, "health.success_threshold", "0"),
    ({"retry": RetryConfig(decode_attempts=0)}, "retry.decode_attempts", "0"),
    ({"max_in_flight": -1}, "max_in_flight", "-1"),
    ({"max_body_bytes": 0}, "max_body_bytes", "0"),
]


@pytest.mark.parametrize(("kw", "key", "value"), BAD, ids=[b[1] for b in BAD])
def test_bad_values_name_their_key(kw: dict, key: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        ProxyConfig(**kw).validate()
    assert str(err.value).startswith(f"{key}: ") and f"got {value}" in str(err.value)


def test_config_is_frozen_and_validate_converts() -> None:
    cfg = ProxyConfig(slo=msgspec.structs.replace(ProxyConfig().slo, admission="shed"))
    with pytest.raises(AttributeError):
        cfg.port = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.breaker.open_s = 1.0  # type: ignore[misc]
    assert cfg.validate().slo.admission is Admission.SHED
    assert ProxyConfig().validate() == ProxyConfig()


def test_files_report_the_key_and_the_file(tmp_path: Path) -> None:
    y = tmp_path / "p.yaml"
    y.write_text("port: 70000\n")
    with pytest.raises(ConfigError, match=r"p\.yaml: port: Expected `int` <= 65535, got 70000"):
        load_config_file(y)
    y.write_text("instances:\n  - {url: 'http://a:1', role: decode}\nbreaker: {open_s: -2}\n")
    with pytest.raises(ConfigError, match=r"breaker\.open_s: .*, got -2"):
        load_config_file(y)
    y.write_text("instances:\n  - {url: 'http://a:1', role: decoder}\n")
    with pytest.raises(ConfigError, match=r"instances\[0\]\.role"):
        load_config_file(y)
    t = tmp_path / "p.toml"
    t.write_text('max_in_flight = 64\n[timeouts]\nprefill_s = 900\ndecode_total_s = 1800\n'
                 '[[instances]]\nurl = "http://a:1"\nrole = "decode"\n')
    cfg = load_config_file(t).validate()
    assert cfg.max_in_flight == 64 and cfg.timeouts.decode_total_s == 1800
    assert cfg.timeouts.decode_connect_s == TimeoutConfig().decode_connect_s


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--decode", "http://d:1", *argv])


def test_flags_are_checked_like_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="^port: "):
        config_from_args(parse("--port", "70000"))
    with pytest.raises(ConfigError, match="^health.interval_s: "):
        config_from_args(parse("--health-interval", "0"))
    with pytest.raises(ConfigError, match="^timeouts.prefill_s: "):
        config_from_args(parse("--timeout", "-1"))
    y = tmp_path / "p.yaml"
    y.write_text("port: 9000\nslo: {ttft_s: 0.2}\n")
    cfg = config_from_args(parse("--config", str(y), "--admission", "shed", "--port", "9001"))
    assert cfg.port == 9001 and cfg.slo.ttft_s == 0.2 and cfg.slo.admission is Admission.SHED
    assert [i.url for i in cfg.instances] == ["http://d:1"]


def test_api_key_only_from_a_file_or_the_environment(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The key sent upstream (``Authorization: Bearer``) never comes from argv: ``--api-key``
    is refused as ``--admin-key`` is; ``--api-key-file`` or ``api_key_file`` in the config file
    reads it from a file; else ``KVDISAGG_API_KEY``."""
    monkeypatch.delenv("KVDISAGG_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="--api-key is not accepted.*--api-key-file FILE.*"
                                          "KVDISAGG_API_KEY"):
        config_from_args(parse("--api-key", "sk-visible-in-ps"))
    assert config_from_args(parse()).api_key is None
    key = tmp_path / "api-key"
    key.write_text("sk-from-file\n")
    cfg = config_from_args(parse("--api-key-file", str(key)))
    assert cfg.api_key == "sk-from-file" and cfg.validate() == cfg  # validate() runs again
    y = tmp_path / "p.yaml"
    y.write_text(f"api_key_file: {key}\n")
    assert config_from_args(parse("--config", str(y))).api_key == "sk-from-file"
    monkeypatch.setenv("KVDISAGG_API_KEY", "sk-from-env")
    assert config_from_args(parse()).api_key == "sk-from-env"
    assert config_from_args(parse("--api-key-file", str(key))).api_key == "sk-from-file"
    with pytest.raises(ConfigError, match="api_key_file: cannot read"):
        config_from_args(parse("--api-key-file", str(tmp_path / "missing")))
    key.write_text("\n")
    with pytest.raises(ConfigError, match="api_key_file: .* is empty"):
        config_from_args(parse("--api-key-file", str(key)))
    key.write_text("sk-from-file")
    y.write_text(f"api_key: sk-other\napi_key_file: {key}\n")
    with pytest.raises(ConfigError, match="api_key and api_key_file are both set"):
        config_from_args(parse("--config", str(y)))


def test_every_flag_sets_config_keys_or_says_what_it_does() -> None:
    """``FLAGS`` is the one map from flags to the config: each key a flag names is a field of
    ProxyConfig (a renamed field fails here, not on a user's command line)."""
    from kvdisagg.proxy.cli import FLAGS, _field_type

    for f in FLAGS:
        assert bool(f.keys) != bool(f.apply) or f.name == "--config", f.name
        for key in f.keys:
            _field_type(key)  # KeyError: not a field
    with pytest.raises(KeyError):
        _field_type("policy.no_such_key")
