"""The connector's config (kvdisagg/connector/config.py): defaults, and every bad key named."""

import pytest

from kvdisagg.connector.config import ConnectorConfig, parse_config, rank_port
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


@pytest.mark.parametrize("extra, says", [
    ({"nccl_store_port": 70000}, "nccl_store_port"),
    ({"nccl_store_port": -1}, "nccl_store_port"),
    ({"nccl_store_port": "7200"}, "nccl_store_port"),
    ({"mooncake_port": 32767}, "mooncake_port"),  # rank 0 needs two ports, Mooncake <= 32767
    ({"mooncake_port": 40000}, "mooncake_port"),
    ({"mooncake_port": 80}, "mooncake_port=80: Mooncake takes ports 1024-32767"),
    ({"mooncake_device": []}, r"mooncake_device=\[\]: list one entry per rank"),
    ({"mooncake_device": ["mlx5_0", 1]}, "mooncake_device"),
    ({"mooncake_device": "mlx5_0, mlx5_1"}, "'mlx5_0, mlx5_1' is not a comma-separated list"),
    ({"mooncake_device": ["mlx5_0", "mlx5_1;reboot"]}, "'mlx5_1;reboot' is not a comma"),
    ({"transport": "nccl", "side_channel_port": 7100, "nccl_store_port": 7100},
     "nccl_store_port=7100 and side_channel_port=7100 overlap"),
    ({"transport": "mooncake", "side_channel_port": 7301, "mooncake_port": 7300},
     "mooncake_port=7300 and side_channel_port=7301 overlap"),
])
def test_bad_port_or_device_is_named(extra, says):
    with pytest.raises(ConfigError, match=says):
        parse_config(extra)


def test_ports_and_devices_accepted():
    cfg = parse_config({"transport": "mooncake", "side_channel_port": 7100,
                        "nccl_store_port": 7100, "mooncake_port": 7300,
                        "mooncake_device": ["mlx5_0", "mlx5_1,mlx5_2"]})
    assert (cfg.nccl_store_port, cfg.mooncake_port) == (7100, 7300)  # nccl's: unused here
    assert [cfg.mooncake_device_of(r) for r in (0, 1)] == ["mlx5_0", "mlx5_1,mlx5_2"]
    with pytest.raises(ConfigError, match="mooncake_device lists 2 entries but this worker is "
                       "rank 2"):
        cfg.mooncake_device_of(2)
    assert parse_config({"mooncake_device": "mlx5_0"}).mooncake_device_of(7) == "mlx5_0"
    assert parse_config({}).mooncake_device_of(0) == ""


def test_rank_ports():
    assert rank_port("nccl_store_port", 0, 5) == 0  # a free port, whatever the rank
    assert rank_port("nccl_store_port", 7200, 3) == 7203
    assert rank_port("mooncake_port", 7300, 3, 2) == 7306
    with pytest.raises(ConfigError, match="nccl_store_port=65535: rank 1's port 65536 is past"):
        rank_port("nccl_store_port", 65535, 1)
