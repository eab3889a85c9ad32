"""Config validation, protocol structs and layout math: pure logic, no vLLM processes."""

import msgspec
import pytest

from kvdisagg.config import ConnectorConfig, parse_config
from kvdisagg.layout import copy_runs
from kvdisagg.errors import ConfigError
from kvdisagg.protocol import Hello, Read, RemotePrefill, handoff_params


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


def test_handoff_params_round_trip():
    params = handoff_params(engine_id="e", request_id="r", block_ids=[3, 4], host="127.0.0.1",
                            ports=[5600, 5601], num_tokens=200, transport="tcp", kv_layout="ab",
                            token="t", lease_s=1.5)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_port"] == 5600 and params["tp_size"] == 2
    # Fields a proxy or vLLM adds are ignored; ours stay under one namespace.
    params["remote_prefill_cached_tokens"] = 0
    p = msgspec.convert(params, RemotePrefill)
    assert p.kvdisagg.ports == [5600, 5601] and p.remote_block_ids == [3, 4]


@pytest.mark.parametrize("mutate", [
    lambda p: p.pop("remote_block_ids"),
    lambda p: p.__setitem__("remote_block_ids", [-1]),
    lambda p: p.__setitem__("remote_port", "x"),
    lambda p: p.pop("kvdisagg"),
])
def test_bad_handoff_params_refused(mutate):
    params = handoff_params(engine_id="e", request_id="r", block_ids=[1], host="h", ports=[1],
                            num_tokens=1, transport="tcp", kv_layout="x", token="t",
                            lease_s=1)
    mutate(params)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(params, RemotePrefill)


def test_side_channel_messages_are_tagged():
    dec = msgspec.msgpack.Decoder(Hello | Read)
    assert dec.decode(msgspec.msgpack.encode(Read(handoff_id="a", token="b", block_ids=[1], dst_block_ids=[4]))) \
        == Read(handoff_id="a", token="b", block_ids=[1], dst_block_ids=[4])


@pytest.mark.parametrize("src, dst, expected", [
    ([], [], []),
    ([7], [2], [(7, 2, 1)]),
    ([3, 4, 5, 9, 10, 2], [0, 1, 2, 3, 4, 5], [(3, 0, 3), (9, 3, 2), (2, 5, 1)]),
    ([3, 4, 5], [0, 1, 7], [(3, 0, 2), (5, 7, 1)]),  # broken on the destination side only
    ([5, 4, 3], [0, 1, 2], [(5, 0, 1), (4, 1, 1), (3, 2, 1)]),
])
def test_copy_runs_coalesce_where_both_sides_are_consecutive(src, dst, expected):
    got = copy_runs(2, src, dst)
    assert [(r.src, r.dst, r.count) for r in got if r.layer == 0] == expected
    assert [(r.src, r.dst, r.count) for r in got if r.layer == 1] == expected
    assert [r.layer for r in got] == sorted(r.layer for r in got)


def test_copy_runs_refuses_mismatched_lists():
    with pytest.raises(ValueError, match="2 source blocks for 1"):
        copy_runs(1, [1, 2], [3])


# ---- the plugin's OpenMP setting on shared cores ----------------------------------------------

PD_ARGV = ["vllm", "serve", "m", "--kv-transfer-config", '{"kv_connector":"DisaggConnector"}']


@pytest.mark.parametrize("environ, argv, applied", [
    ({}, PD_ARGV, True),                                        # vLLM's defaults: shared cores
    ({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, PD_ARGV, True),
    ({"VLLM_CPU_OMP_THREADS_BIND": "0"}, PD_ARGV, False),       # own cores: left alone
    ({"OMP_WAIT_POLICY": "ACTIVE"}, PD_ARGV, False),            # the user's choice wins
    ({}, ["vllm", "serve", "m"], False),                        # not a kvdisagg instance
])
def test_plugin_makes_openmp_wait_passively_only_on_shared_cores(environ, argv, applied):
    from kvdisagg.plugin import PASSIVE_OMP_ENV, _passive_omp_on_shared_cores

    before = dict(environ)
    assert _passive_omp_on_shared_cores(environ, argv) is applied
    assert environ == ({**before, **PASSIVE_OMP_ENV} if applied else before)
