"""Transfer benchmark: every transport against the raw loopback copy of the same bytes, and against
the engine it drives where there is one, in one run.

Prefill is a peer process (tests.support.transport_peer) holding KV-shaped blocks: 2 layers
of [num_blocks, 1, 64, 128] float32 pages, 32 KiB per layer-block, 64 KiB per block. Decode, this
process, fetches a scattered block set (every other block) into contiguous blocks through the
real Transport API: a whole handoff (Read, grant, bytes, Done; for lmcache the chunk GETs).

Baselines, same bytes, same run:
- raw: a plain TCP socket on loopback, ``sendall`` into ``recv_into`` of one buffer;
- mooncake-engine: the same ranges read by Mooncake's TransferEngine directly
  (``batch_transfer_sync_read``), without our side channel;
- lmcache-wire: the same chunks fetched with bare LMCache protocol GETs into one buffer
  (what LMCache's own LMCServerConnector does, minus its allocator), without our layer.

With ``--burst N``, instead: N handoffs pulled at once on N threads (what decode's workers do
with a burst of requests from one prefill: a Read each, on pooled connections) against one
handoff of all their blocks. The gap is the most that one Read for several handoffs could save.

And the cost of KV checksums (``kv_checksum``, integrity.py): every pull is timed twice per
round, alternately, by two decode transports on the same prefill, one verifying (the default)
and one not; the ``checksum`` column is the median with over the median without, minus one.
For lmcache it is decode's verification only (prefill hashed the chunks when it stored them).

    .venv/bin/python benchmarks/transfer.py [--transports tcp,nccl,mooncake,lmcache]
        [--repeats 5] [--max-mib 64] [--burst 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import msgspec
import torch

from kvdisagg.connector.config import ConnectorConfig
from kvdisagg.connector.integrity import TRAILER_BYTES
from kvdisagg.connector.protocol.sockets import recv_into_exact
from kvdisagg.local.servers import LMCacheServer
from kvdisagg.transport import Fetch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support, shared scaffolding
from tests.support.transport_peer import (
    BLOCK_SIZE,
    KV_LAYOUT,
    PeerProcess,
    kv_caches,
    open_transport,
)

BLOCK_SHAPE = (1, 64, 128)  # kv_heads, tokens, 2*head_dim: 32 KiB per layer-block in float32
LAYERS = 2
PAGE = 64 * 128 * 4
CHUNK_TOKENS = 16 * BLOCK_SIZE  # lmcache: 16 blocks (1 MiB) per chunk


def raw_server(port_q: mp.Queue, max_bytes: int) -> None:
    payload = memoryview(bytearray(max_bytes))
    server = socket.create_server(("127.0.0.1", 0))
    port_q.put(server.getsockname()[1])
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while len(head := conn.recv(8)) == 8:
        conn.sendall(payload[:int.from_bytes(head, "big")])


def median_s(fn: Callable[[int], None], repeats: int) -> float:
    """Median over ``repeats`` after one warm-up call; ``fn`` gets the round number."""
    times = []
    for k in range(repeats + 1):
        start = time.perf_counter()
        fn(k)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


class Bench:
    def __init__(self, name: str, extra: dict, num_blocks: int) -> None:
        self.name = name
        self.peer = PeerProcess(name, extra, blocks=num_blocks, block_shape=BLOCK_SHAPE)
        config = msgspec.convert({**extra, "transport": name}, ConnectorConfig)
        self.dst = kv_caches(None, num_blocks, LAYERS, BLOCK_SHAPE)
        self.decode, _ = open_transport(config, self.dst, is_producer=False)
        unchecked = msgspec.convert({**extra, "transport": name, "kv_checksum": False},
                                    ConnectorConfig)
        self.unchecked, _ = open_transport(unchecked, kv_caches(None, num_blocks, LAYERS,
                                                                BLOCK_SHAPE), is_producer=False)
        self.n = 0

    def fetch_once(self, remote: list[int], local: list[int], checked: bool = True
                   ) -> tuple[Fetch, Callable]:
        """Offer a fresh handoff; return its Fetch and the timed call."""
        self.n += 1
        hid = f"{self.name}-{self.n}"
        prompt = torch.randint(0, 30000, (len(remote) * BLOCK_SIZE,)).tolist()
        token = self.peer.offer(hid, remote, prompt, lease_s=600)
        if self.name == "lmcache":  # stored before decode asks: time the fetch alone
            self.peer.released({hid}, within_s=120)
        fetch = Fetch(hid, token, "127.0.0.1", self.peer.port, KV_LAYOUT, tuple(remote),
                      tuple(local), tuple(prompt))
        decode = self.decode if checked else self.unchecked
        return fetch, lambda: decode.fetch(fetch, 120)

    def time_ours(self, remote: list[int], local: list[int], repeats: int
                  ) -> tuple[float, float]:
        """Median seconds of a pull with checksums and without, rounds alternating."""
        calls = [self.fetch_once(remote, local, checked)[1]
                 for _ in range(repeats + 1) for checked in (True, False)]
        times = []
        for call in calls:
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return statistics.median(times[2::2]), statistics.median(times[3::2])

    def time_burst(self, n: int, nblocks: int, repeats: int) -> tuple[float, float]:
        """Median seconds of ``n`` handoffs of ``nblocks`` each pulled at once, and of one
        handoff of all their blocks, rounds alternating."""
        remote = [[2 * (i * nblocks + j) for j in range(nblocks)] for i in range(n)]
        local = [[i * nblocks + j for j in range(nblocks)] for i in range(n)]
        apart, joined = [], []
        with ThreadPoolExecutor(n) as pool:
            for _ in range(repeats + 1):
                calls = [self.fetch_once(r, loc)[1] for r, loc in zip(remote, local)]
                start = time.perf_counter()
                for done in [pool.submit(call) for call in calls]:
                    done.result()
                apart.append(time.perf_counter() - start)
                one = self.fetch_once(sum(remote, []), sum(local, []))[1]
                start = time.perf_counter()
                one()
                joined.append(time.perf_counter() - start)
        return statistics.median(apart[1:]), statistics.median(joined[1:])

    def time_engine(self, remote: list[int], local: list[int], repeats: int) -> float | None:
        """The engine we drive, called directly on the same ranges (no side channel)."""
        if self.name == "mooncake":
            fetch, _ = self.fetch_once(remote, local)
            from kvdisagg.transport.pull import Deadline

            key = (fetch.host, fetch.port)
            conn = self.decode._checkout(key, Deadline(30, "bench"))  # a pooled connection
            self.decode._checkin(key, conn)  # only its peer info is used
            info, engine = conn.peer, self.decode.engine
            from kvdisagg.connector.layout import copy_runs

            runs = copy_runs(LAYERS, remote, local)
            regions = self.decode.regions
            dst = [regions[r.layer].rows(r.dst, r.count).data_ptr() for r in runs]
            src = [info.bases[r.layer] + r.src * PAGE for r in runs]
            lengths = [r.count * PAGE for r in runs]

            def read(_k: int) -> None:
                for i in range(0, len(dst), 512):
                    rc = engine.batch_transfer_sync_read(info.endpoint, dst[i:i + 512],
                                                         src[i:i + 512], lengths[i:i + 512])
                    assert rc == 0, rc
            return median_s(read, repeats)
        if self.name == "lmcache":
            fetch, _ = self.fetch_once(remote, local)
            from kvdisagg.transport.lmcache import LMCacheClient
            from kvdisagg.transport.pull import Deadline

            client = LMCacheClient(self.decode.config.lmcache_url)
            chunks = self.decode.chunks(fetch.prompt_token_ids)
            nbytes = [c.num_blocks * PAGE * LAYERS + TRAILER_BYTES for c in chunks]
            sink = memoryview(bytearray(max(nbytes)))

            def get(_k: int) -> None:
                for chunk, size in zip(chunks, nbytes):
                    assert client.get_into(chunk.key, [sink[:size]], Deadline(60, "bench"))
            result = median_s(get, repeats)
            client.close()
            return result
        return None

    def close(self) -> None:
        self.decode.close()
        self.unchecked.close()
        self.peer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transports", default="tcp,nccl,mooncake,lmcache")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--burst", type=int, default=0, metavar="N",
                    help="N handoffs at once vs one handoff of all their blocks, instead")
    args = ap.parse_args()
    if args.burst:
        burst(args)
        return
    sizes = [s for s in (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20)
             if s <= args.max_mib << 20]
    num_blocks = 2 * max(sizes) // (PAGE * LAYERS) + 8
    ctx = mp.get_context("spawn")
    port_q: mp.Queue = ctx.Queue()
    raw_proc = ctx.Process(target=raw_server, args=(port_q, max(sizes)), daemon=True)
    raw_proc.start()
    raw = socket.create_connection(("127.0.0.1", port_q.get(timeout=60)))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sink = memoryview(bytearray(max(sizes)))

    def raw_copy(nbytes: int) -> None:
        raw.sendall(nbytes.to_bytes(8, "big"))
        recv_into_exact(raw, sink[:nbytes])

    print(f"{'transport':>9} {'size':>8} {'GB/s':>6} {'unchecked':>9} {'checksum':>8} "
          f"{'raw GB/s':>8} {'vs raw':>6} {'engine GB/s':>11} {'vs engine':>9}", flush=True)
    with ExitStack() as stack:
        lmcache = stack.enter_context(LMCacheServer())
        for name in args.transports.split(","):
            extra = {"transfer_timeout_seconds": 120.0}
            if name == "mooncake":
                extra["mooncake_protocol"] = "tcp"
            if name == "lmcache":
                extra |= {"lmcache_url": lmcache.url, "lmcache_chunk_tokens": CHUNK_TOKENS}
            bench = Bench(name, extra, num_blocks)
            try:
                for size in sizes:
                    nblocks = max(1, size // (PAGE * LAYERS))
                    nbytes = nblocks * PAGE * LAYERS
                    remote = [2 * i for i in range(nblocks)]  # scattered on prefill
                    local = list(range(nblocks))  # fresh, contiguous on decode
                    ours, unchecked = bench.time_ours(remote, local, args.repeats)
                    base = median_s(lambda _k: raw_copy(nbytes), args.repeats)
                    engine = bench.time_engine(remote, local, args.repeats)
                    line = (f"{name:>9} {_fmt(nbytes):>8} {nbytes / ours / 1e9:>6.2f} "
                            f"{nbytes / unchecked / 1e9:>9.2f} {ours / unchecked - 1:>+8.0%} "
                            f"{nbytes / base / 1e9:>8.2f} {base / ours:>6.2f}")
                    if engine is not None:
                        line += f" {nbytes / engine / 1e9:>11.2f} {engine / ours:>9.2f}"
                    print(line, flush=True)
            finally:
                bench.close()
    raw_proc.terminate()


def burst(args: argparse.Namespace) -> None:
    """N handoffs of each size pulled at once vs one handoff of all their blocks."""
    n = args.burst
    sizes = [s for s in (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
             if n * s <= args.max_mib << 20]
    num_blocks = 2 * n * max(sizes) // (PAGE * LAYERS) + 8
    print(f"{'transport':>9} {'handoffs':>8} {'each':>8} {'apart ms':>8} {'one ms':>7} "
          f"{'saved ms':>8} {'apart/one':>9}", flush=True)
    with ExitStack() as stack:
        lmcache = stack.enter_context(LMCacheServer()) if "lmcache" in args.transports else None
        for name in args.transports.split(","):
            extra: dict = {"transfer_timeout_seconds": 120.0}
            if name == "mooncake":
                extra["mooncake_protocol"] = "tcp"
            if lmcache is not None and name == "lmcache":
                extra |= {"lmcache_url": lmcache.url, "lmcache_chunk_tokens": CHUNK_TOKENS}
            bench = Bench(name, extra, num_blocks)
            try:
                for size in sizes:
                    nblocks = max(1, size // (PAGE * LAYERS))
                    apart, one = bench.time_burst(n, nblocks, args.repeats)
                    print(f"{name:>9} {n:>8} {_fmt(nblocks * PAGE * LAYERS):>8} "
                          f"{apart * 1e3:>8.1f} {one * 1e3:>7.1f} {(apart - one) * 1e3:>8.1f} "
                          f"{apart / one:>9.2f}", flush=True)
            finally:
                bench.close()


def _fmt(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


if __name__ == "__main__":
    main()
