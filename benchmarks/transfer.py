"""Transfer benchmark: the tcp transport vs a plain socket copy of the same bytes, one run.

Two processes on loopback. The prefill process holds KV-shaped blocks (2 layers of
[num_blocks, 1, 64, 128] float32 pages = 32 KiB per layer-block, 64 KiB per block) behind the real side channel;
the decode process pulls block sets with ``pull()`` into its own blocks. The baseline sends the
same number of bytes over a plain TCP socket, ``sendall`` to ``recv_into`` a preallocated buffer.

    .venv/bin/python benchmarks/transfer.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
PAGE = 1 * 64 * 128 * 4  # one layer-block: kv_heads 1, block 64, 2*head_dim 128, float32
LAYERS = 2
NUM_BLOCKS = (256 << 20) // (PAGE * LAYERS) + 8


def kv_caches():
    import torch

    return {f"layer.{i}": torch.zeros(NUM_BLOCKS, 1, 64, 128) for i in range(LAYERS)}


def prefill_proc(port_q: mp.Queue, raw_port_q: mp.Queue) -> None:
    from kvdisagg.connector.layout import layer_regions
    from kvdisagg.connector.side_channel import HandoffTable, SideChannelServer
    from kvdisagg.transport.tcp import TcpTransport

    caches = kv_caches()
    for t in caches.values():
        t.uniform_()
    table = HandoffTable()
    # A pull releases its handoff (Done), so each pull gets its own: bench-0, bench-1, ...
    for k in range(1000):
        table.add(f"bench-{k}", "tok", range(NUM_BLOCKS), lease_s=3600)
    server = SideChannelServer("127.0.0.1", 0, kv_layout="bench", regions=layer_regions(caches),
                               transport=TcpTransport(), table=table, timeout_s=60)
    port_q.put(server.port)
    # Raw baseline: for each connection, read an 8-byte size, then send that many bytes.
    payload = memoryview(caches["layer.0"].view(-1).view(dtype=__import__("torch").uint8).numpy())
    raw = socket.create_server(("127.0.0.1", 0))
    raw_port_q.put(raw.getsockname()[1])
    while True:
        conn, _ = raw.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                head = conn.recv(8)
                if len(head) < 8:
                    break
                n = int.from_bytes(head, "big")
                conn.sendall(payload[:n])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    port_q, raw_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=prefill_proc, args=(port_q, raw_q), daemon=True)
    proc.start()
    port, raw_port = port_q.get(timeout=60), raw_q.get(timeout=60)

    from kvdisagg.connector.layout import layer_regions
    from kvdisagg.connector.side_channel import pull
    from kvdisagg.protocol import recv_into_exact
    from kvdisagg.transport.tcp import TcpTransport

    dst = kv_caches()
    regions = layer_regions(dst)
    raw = socket.create_connection(("127.0.0.1", raw_port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sink = bytearray(max(SIZES))
    handoff = -1
    print(f"{'size':>9} {'blocks':>6} {'tcp GB/s':>9} {'raw GB/s':>9} {'ratio':>6}")
    for size in SIZES:
        nblocks = max(1, size // (PAGE * LAYERS))
        nbytes = nblocks * PAGE * LAYERS
        # Scattered remote blocks (every other one) into contiguous local ones: real handoffs
        # are fragmented on prefill and get fresh blocks on decode.
        remote = [2 * i % NUM_BLOCKS for i in range(nblocks)]
        local = list(range(nblocks))
        ours, base = [], []
        for _ in range(args.repeats + 1):  # first round warms up both paths
            handoff += 1
            t = time.perf_counter()
            pull(host="127.0.0.1", port=port, handoff_id=f"bench-{handoff}", token="tok",
                 kv_layout="bench", remote_block_ids=remote, local_regions=regions,
                 local_block_ids=local, transport=TcpTransport(), timeout_s=60)
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            raw.sendall(nbytes.to_bytes(8, "big"))
            recv_into_exact(raw, memoryview(sink)[:nbytes])
            base.append(time.perf_counter() - t)
        o, b = statistics.median(ours[1:]), statistics.median(base[1:])
        print(f"{_fmt(nbytes):>9} {nblocks:>6} {nbytes / o / 1e9:>9.2f} {nbytes / b / 1e9:>9.2f} "
              f"{b / o:>6.2f}")
    proc.terminate()


def _fmt(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


if __name__ == "__main__":
    main()
