"""The side channel's protocol versions (transport/pull.py): a prefill in its own process
(tests.support.transport_peer) accepts a Hello of any version it speaks and refuses others naming
its range; decode speaks the version its scheduler chose (``Fetch.version``) and keeps pooled
connections per version; a decode of release 4, its frames written as that release wrote them,
pulls from this release (release 4's frames: tests/support/protocol_v4.py)."""

from __future__ import annotations

import socket

import msgspec
import pytest
import torch

from kvdisagg.connector.config import ConnectorConfig
from kvdisagg.connector.protocol.sockets import recv_exact
from kvdisagg.connector.protocol.versions import PROTOCOL_VERSION, SPOKEN
from kvdisagg.errors import IncompatiblePeerError
from kvdisagg.transport import Fetch
from tests.support.protocol_v4 import V4Done, V4Hello, V4Message, V4Read, V4Reply
from tests.support.transport_peer import KV_LAYOUT, PeerProcess, kv_caches, open_transport

TIMEOUT_S = 3.0
SEED = 11
EXTRA = {"transfer_timeout_seconds": TIMEOUT_S, "side_channel_host": "127.0.0.1"}


def prefill(**extra: object) -> PeerProcess:
    return PeerProcess("tcp", EXTRA | extra, seed=SEED)


@pytest.fixture
def decode():
    dst = kv_caches(None)
    transport, _ = open_transport(ConnectorConfig(transport="tcp", **EXTRA), dst,
                                  is_producer=False)
    yield transport, dst
    transport.close()


def pull(peer: PeerProcess, transport, handoff: str, version: int) -> int:
    token = peer.offer(handoff, [2, 3], list(range(20)))
    return transport.fetch(Fetch(handoff_id=handoff, token=token, host="127.0.0.1",
                                 port=peer.port, kv_layout=KV_LAYOUT, remote_block_ids=(2, 3),
                                 local_block_ids=(5, 6), version=version), TIMEOUT_S)


def moved(dst: dict[str, torch.Tensor]) -> bool:
    src = kv_caches(SEED)
    return all(torch.equal(dst[layer][[5, 6]], src[layer][[2, 3]]) for layer in src)


def test_prefill_serves_every_version_it_speaks_and_refuses_others_naming_its_range(decode):
    transport, dst = decode
    peer = prefill()
    try:
        for version in range(SPOKEN.lo, SPOKEN.hi + 1):
            dst["layer.0"].zero_()
            assert pull(peer, transport, f"v{version}", version) > 0
            assert moved(dst), version
        for version in (SPOKEN.lo - 1, SPOKEN.hi + 1):
            with pytest.raises(IncompatiblePeerError,
                               match=f"protocol version {version}: prefill speaks {SPOKEN}"):
                pull(peer, transport, f"v{version}", version)
        # The refused pulls left their handoffs to their lease; the served ones are freed.
        served = {f"v{v}" for v in range(SPOKEN.lo, SPOKEN.hi + 1)}
        assert served <= peer.released(served)
    finally:
        peer.close()


def test_an_instance_announcing_another_version_speaks_only_that_one(decode):
    """``protocol_version_override`` (a test setting): the prefill accepts that version alone,
    so a decode of this release (which would say 5) is refused, and one that speaks it is
    served; connections of each version are pooled apart."""
    transport, dst = decode
    peer = prefill(protocol_version_override=PROTOCOL_VERSION + 1)
    try:
        with pytest.raises(IncompatiblePeerError, match=f"prefill speaks {PROTOCOL_VERSION + 1}"):
            pull(peer, transport, "now", PROTOCOL_VERSION)
        assert pull(peer, transport, "next", PROTOCOL_VERSION + 1) > 0 and moved(dst)
        assert pull(peer, transport, "again", PROTOCOL_VERSION + 1) > 0  # pooled, same version
        assert [key[2] for key in transport._idle] == [PROTOCOL_VERSION + 1]
    finally:
        peer.close()


def test_a_decode_of_release_4_pulls_from_this_release():
    """Frames as release 4 wrote and read them (tests/unit/connector/protocol/test_frames.py),
    over a real socket: Hello of version 4, a Read without an early position, the bytes, Done."""
    peer = prefill()
    try:
        token = peer.offer("old", [2, 3], list(range(20)))
        v4 = msgspec.msgpack.Decoder(V4Message)

        def send(msg: object) -> None:
            body = msgspec.msgpack.encode(msg)
            sock.sendall(len(body).to_bytes(4, "big") + body)

        def recv() -> object:
            return v4.decode(recv_exact(sock, int.from_bytes(recv_exact(sock, 4), "big")))

        with socket.create_connection(("127.0.0.1", peer.port), timeout=TIMEOUT_S) as sock:
            send(V4Hello(version=4, kv_layout=KV_LAYOUT, transport="tcp"))
            hello = recv()
            assert isinstance(hello, V4Reply) and hello.ok, hello
            send(V4Read(handoff_id="old", token=token, block_ids=[2, 3], dst_block_ids=[0, 1]))
            reply = recv()
            assert isinstance(reply, V4Reply) and reply.ok, reply
            got = recv_exact(sock, reply.nbytes)
            send(V4Done(handoff_id="old", token=token))
        src = kv_caches(SEED)
        # tcp sends each layer's runs in order: layer 0's two blocks, then layer 1's.
        want = b"".join(src[layer][[2, 3]].numpy().tobytes() for layer in sorted(src))
        assert got == want
        assert "old" in peer.released({"old"})
    finally:
        peer.close()

