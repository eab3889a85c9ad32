"""The wire and handoff structs (kvdisagg/protocol.py): what a prefill hands off converts to what
decode parses, anything malformed is refused, side-channel messages are tagged."""

import msgspec
import pytest

from kvdisagg.protocol import (
    EARLY_HANDOFF_VERSION,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    SPOKEN,
    Checksum,
    Done,
    HandoffRef,
    Hello,
    Message,
    Read,
    RemotePrefill,
    Renew,
    Reply,
    Versions,
    Wait,
    encode_frame,
    handoff_params,
    spoken,
)
from tests.support.protocol_v4 import (
    V4Checksum,
    V4Done,
    V4HandoffRef,
    V4Hello,
    V4Message,
    V4Read,
    V4Renew,
    V4Reply,
    V4Wait,
)


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


# ---- versions --------------------------------------------------------------------------------


@pytest.mark.parametrize("a, b, common", [
    ((4, 5), (4, 5), 5),
    ((4, 5), (5, 5), 5),
    ((4, 5), (4, 4), 4),
    ((4, 4), (5, 6), None),
    ((5, 6), (4, 5), 5),
    ((6, 6), (4, 5), None),
])
def test_two_instances_speak_the_highest_version_both_speak(a, b, common):
    assert Versions(*a).common(Versions(*b)) == common
    assert Versions(*b).common(Versions(*a)) == common


def test_this_release_speaks_its_range_and_an_override_narrows_it_to_one():
    assert spoken() == SPOKEN == Versions(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)
    assert MIN_PROTOCOL_VERSION <= EARLY_HANDOFF_VERSION <= PROTOCOL_VERSION
    assert spoken(7) == Versions(7, 7) and str(spoken(7)) == "7" and str(SPOKEN) == "4..5"


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


def test_a_version_4_peer_and_this_release_read_each_others_frames():
    """5 speaks 4 when every frame of 5 that a peer of 4 may get decodes there (fields it does
    not know are ignored) and every frame of 4 decodes here (release 4's structs:
    tests/support/protocol_v4.py)."""
    v4 = msgspec.msgpack.Decoder(V4Message)
    here = msgspec.msgpack.Decoder(Message)
    # What a decode of this release sends a prefill speaking 4 (never an early Read there).
    for msg, want in [
        (Hello(version=4, kv_layout="x", transport="tcp"),
         V4Hello(version=4, kv_layout="x", transport="tcp")),
        (Read(handoff_id="h", token="t", block_ids=[1, 2], dst_block_ids=[3, 4],
              checksum="xxh3_64", layers=[0], heads=[0, 1]),
         V4Read(handoff_id="h", token="t", block_ids=[1, 2], dst_block_ids=[3, 4],
                checksum="xxh3_64", layers=[0], heads=[0, 1])),
        (Done(handoff_id="h", token="t", readers=2), V4Done(handoff_id="h", token="t",
                                                            readers=2)),
        (Renew(handoffs=[HandoffRef("h", "t")]), V4Renew(handoffs=[V4HandoffRef("h", "t")])),
        (Reply(ok=True, nbytes=9), V4Reply(ok=True, nbytes=9)),
        (Checksum(algorithm="xxh3_64", digest=b"12345678"),
         V4Checksum(algorithm="xxh3_64", digest=b"12345678")),
        (Wait(), V4Wait()),
    ]:
        assert v4.decode(encode_frame(msg)[4:]) == want
        # ... and what a peer of 4 sends this release.
        assert here.decode(msgspec.msgpack.encode(want)) == msg
