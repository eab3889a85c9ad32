"""The handoff's kv_transfer_params (kvdisagg/connector/protocol/params.py): what a prefill hands
off converts to what decode parses, anything malformed is refused, and they say which protocol
versions prefill speaks."""

import msgspec
import pytest

from kvdisagg.connector.protocol.params import RemotePrefill, handoff_params
from kvdisagg.connector.protocol.versions import SPOKEN, Versions


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


def test_handoff_params_say_which_versions_prefill_speaks():
    params = handoff_params(engine_id="e", request_id="r", block_ids=[1], host="h", ports=[1],
                            num_tokens=1, transport="tcp", kv_layout="x", token="t",
                            lease_s=1, versions=Versions(3, 6))
    assert (params["kvdisagg"]["min_version"], params["kvdisagg"]["version"]) == (3, 6)
    assert msgspec.convert(params, RemotePrefill).kvdisagg.versions() == Versions(3, 6)
    # A prefill from before min_version was sent: its one version.
    del params["kvdisagg"]["min_version"]
    assert msgspec.convert(params, RemotePrefill).kvdisagg.versions() == Versions(6, 6)
    default = handoff_params(engine_id="e", request_id="r", block_ids=[1], host="h", ports=[1],
                             num_tokens=1, transport="tcp", kv_layout="x", token="t", lease_s=1)
    assert msgspec.convert(default, RemotePrefill).kvdisagg.versions() == SPOKEN
