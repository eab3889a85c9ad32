"""The side channel and tcp transport between real sockets on loopback, with CPU KV tensors."""

import time

import pytest
import torch

from kvdisagg.connector.layout import layer_regions
from kvdisagg.connector.side_channel import HandoffTable, SideChannelServer, pull
from kvdisagg.errors import IncompatiblePeerError, PeerUnreachable, TransferFailed
from kvdisagg.transport.tcp import TcpTransport

SHAPE = (16, 2, 32, 128)  # [num_blocks, kv_heads, block_size, 2*head_dim]


def kv(seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    make = (lambda: torch.rand(SHAPE, generator=g)) if g else (lambda: torch.zeros(SHAPE))
    return {"layer.0": make(), "layer.1": make()}


@pytest.fixture
def prefill():
    caches = kv(seed=1)
    table = HandoffTable()
    server = SideChannelServer("127.0.0.1", 0, kv_layout="L", regions=layer_regions(caches),
                               transport=TcpTransport(), table=table, timeout_s=5)
    yield caches, table, server
    server.close()


def do_pull(server, dst, remote, local, token="tok", layout="L", timeout=5.0):
    return pull(host="127.0.0.1", port=server.port, handoff_id="r1", token=token,
                kv_layout=layout, remote_block_ids=remote, local_regions=layer_regions(dst),
                local_block_ids=local, transport=TcpTransport(), timeout_s=timeout)


def test_blocks_arrive_intact_and_ack_frees(prefill):
    src, table, server = prefill
    table.add("r1", "tok", [2, 3, 4, 9], lease_s=30)
    dst = kv()
    nbytes = do_pull(server, dst, [2, 3, 4, 9], [7, 8, 0, 1])
    page = SHAPE[1] * SHAPE[2] * SHAPE[3] * 4
    assert nbytes == 4 * page * 2
    for name in src:
        assert torch.equal(dst[name][[7, 8, 0, 1]], src[name][[2, 3, 4, 9]])
        assert torch.count_nonzero(dst[name][[2, 3, 4, 5, 6]]) == 0  # nothing else written
    assert table.take_finished() == {"r1"}


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(token="forged"), TransferFailed, "wrong token"),
    (dict(layout="other"), IncompatiblePeerError, "kv_layout differs"),
    (dict(remote=[2, 5]), TransferFailed, "not part of handoff"),
    (dict(remote=[2, 99]), TransferFailed, "out of range"),
])
def test_refusals(prefill, kwargs, error, match):
    _, table, server = prefill
    table.add("r1", "tok", [2, 3], lease_s=30)
    remote = kwargs.pop("remote", [2, 3])
    with pytest.raises(error, match=match):
        do_pull(server, kv(), remote, [0, 1][:len(remote)], **kwargs)
    assert len(table) == 1  # a refused read releases nothing


def test_lease_expiry_frees_and_refuses(prefill):
    _, table, server = prefill
    table.add("r1", "tok", [2], lease_s=0.05)
    time.sleep(0.1)
    with pytest.raises(TransferFailed, match="expired"):
        do_pull(server, kv(), [2], [0])
    assert table.take_finished() == {"r1"}


def test_dead_peer_is_a_typed_error_fast():
    table = HandoffTable()
    server = SideChannelServer("127.0.0.1", 0, kv_layout="L", regions=layer_regions(kv()),
                               transport=TcpTransport(), table=table, timeout_s=5)
    server.close()
    start = time.monotonic()
    with pytest.raises(PeerUnreachable):
        do_pull(server, kv(), [0], [0], timeout=2)
    assert time.monotonic() - start < 2.5
