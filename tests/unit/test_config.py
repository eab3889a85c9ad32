"""The connector's config (kvdisagg/config.py): defaults, and every bad key named."""

import pytest

from kvdisagg.config import ConnectorConfig, parse_config
from kvdisagg.errors import ConfigError


def test_defaults():
    assert parse_config(None) == ConnectorConfig()
    assert parse_config({}).transport == "tcp"


@pytest.mark.parametrize("extra, key", [
    ({"transprot": "tcp"}, "transprot"),
    ({"side_channel_port": 70000}, "side_channel_port"),
    ({"lease_seconds": 0}, "lease_seconds"),
    ({"transfer_timeout_seconds": "soon"}, "transfer_timeout_seconds"),
])
def test_bad_key_is_named(extra, key):
    with pytest.raises(ConfigError, match=key):
        parse_config(extra)


def test_protocol_version_override_is_a_test_setting_checked_like_any_key():
    assert parse_config({}).protocol_version_override is None
    assert parse_config({"protocol_version_override": 6}).protocol_version_override == 6
    for bad in (0, -1, 1001, "5", 4.5):
        with pytest.raises(ConfigError, match="protocol_version_override"):
            parse_config({"protocol_version_override": bad})
