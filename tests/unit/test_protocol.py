"""The wire and handoff structs (kvdisagg/protocol.py): what a prefill hands off converts to what
decode parses, anything malformed is refused, side-channel messages are tagged."""

import msgspec
import pytest

from kvdisagg.protocol import Hello, Read, RemotePrefill, handoff_params


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
    read = Read(handoff_id="a", token="b", block_ids=[1], dst_block_ids=[4])
    assert dec.decode(msgspec.msgpack.encode(read)) == read
