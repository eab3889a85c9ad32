"""The side channel's frames (kvdisagg/connector/protocol/frames.py): messages are tagged, and a
peer of version 4 and this release read each other's frames."""

import msgspec

from kvdisagg.connector.protocol.frames import (
    Checksum,
    Done,
    HandoffRef,
    Hello,
    Message,
    Read,
    Renew,
    Reply,
    Wait,
    encode_frame,
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


def test_side_channel_messages_are_tagged():
    dec = msgspec.msgpack.Decoder(Hello | Read)
    read = Read(handoff_id="a", token="b", block_ids=[1], dst_block_ids=[4])
    assert dec.decode(msgspec.msgpack.encode(read)) == read


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
