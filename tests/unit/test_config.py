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
