"""Check the CUDA data paths of a pull between differently sharded instances, on one GPU.

CI runs on CPU; this exercises what only a GPU runs: a prefill TP1 worker's KV (2 heads per
block) on CUDA, read by a decode TP2 worker (1 head each) on CUDA, through

- tcp: a real pull over loopback between two transports in this process (CUDA KV staged
  through pinned host memory), for both decode ranks, a window of each block;
- nccl: the gather and scatter of a head window on CUDA (``index_select``/``index_copy_`` on a
  narrowed page view, and the in-place path for whole pages), with an in-process group (NCCL
  itself refuses two ranks on one GPU), from paged blocks and from a pinned staging arena.

    python scripts/gpu_check.py            # exit 0: every check passed
    python scripts/gpu_check.py --cpu      # the same code on CPU (a smoke run of the script)

About a minute; needs torch with CUDA and kvdisagg importable (PYTHONPATH=src).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import msgspec
import torch

from kvdisagg.config import ConnectorConfig
from kvdisagg.layout import KvGeometry, layer_regions, pull_slices, copy_runs, with_arena
from kvdisagg.sharding import Shape, plan
from kvdisagg.transport import Fetch, Offer, load_transport
from kvdisagg.transport.nccl import NcclTransport
from kvdisagg.transport.pull import Deadline, PullPlan

BLOCKS, BLOCK, HEAD, LAYERS, KV_HEADS = 64, 16, 128, 2, 2
DEVICE = "cpu" if "--cpu" in sys.argv else "cuda"
GEOMETRY = KvGeometry(model="gpu-check", dtype="float16", kv_dtype="torch.float16",
                      block_size=BLOCK, head_size=HEAD // 2, kv_heads=KV_HEADS, layers=LAYERS,
                      head_bytes=BLOCK * HEAD * 2)


def caches(heads: list[int], seed: int | None) -> dict[str, torch.Tensor]:
    out = {}
    for layer in range(LAYERS):
        if seed is None:
            out[f"layers.{layer}"] = torch.zeros((BLOCKS, len(heads), BLOCK, HEAD),
                                                 dtype=torch.float16, device=DEVICE)
        else:
            g = torch.Generator().manual_seed(seed * 100 + layer)
            full = torch.rand((BLOCKS, KV_HEADS, BLOCK, HEAD), generator=g).half()
            out[f"layers.{layer}"] = full[:, heads].contiguous().to(DEVICE)
    return out


def check(name: str, ok: bool) -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return ok


def tcp_split() -> bool:
    config = msgspec.convert({"transport": "tcp", "transfer_timeout_seconds": 10.0},
                             ConnectorConfig)
    prefill_kv = caches([0, 1], seed=1)
    prefill = load_transport(config)
    port = prefill.register(layer_regions(prefill_kv), kv_layout=GEOMETRY.fingerprint(),
                            block_size=BLOCK, is_producer=True, geometry=GEOMETRY, rank=0)
    src, dst = [3, 4, 9], [10, 11, 2]
    prefill.offer(Offer("h", "tok", tuple(src), 30.0))
    shape_p, shape_d = Shape(1), Shape(2)
    ok = True
    for rank, parts in enumerate(plan(shape_p, shape_d, KV_HEADS, LAYERS)):
        decode_kv = caches([rank], seed=None)
        decode = load_transport(config)
        decode.register(layer_regions(decode_kv), kv_layout=GEOMETRY.fingerprint(),
                        block_size=BLOCK, is_producer=False, geometry=GEOMETRY, rank=rank)
        for part in parts:
            decode.fetch(Fetch("h", "tok", "127.0.0.1", port, GEOMETRY.fingerprint(),
                               tuple(src), tuple(dst), part=part, prefill=shape_p), 10.0)
        for name, tensor in decode_kv.items():
            ok &= bool(torch.equal(tensor[dst], prefill_kv[name][src][:, [rank]]))
        decode.close()
    prefill.close()
    return check("tcp: prefill TP1 -> decode TP2, each rank its head, CUDA KV via host", ok)


class InProcessGroup:
    """Sends and receives of two 'ranks' in one process, matched by tag (CUDA tensors)."""

    def __init__(self) -> None:
        self.sent: dict[int, torch.Tensor] = {}

    class Work:
        def __init__(self, done: Any = None) -> None:
            self.done = done

        def wait(self, timeout: Any = None) -> bool:
            if self.done:
                self.done()
            return True

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        self.sent[tag] = tensors[0].clone()
        return self.Work()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        return self.Work(lambda: tensors[0].view(-1).view(torch.uint8).copy_(
            self.sent.pop(tag).view(-1).view(torch.uint8)))


class _Sock:
    def sendall(self, data: bytes) -> None:
        pass


def nccl_gather(staged: bool) -> bool:
    src_regions = layer_regions(caches([0, 1], seed=2))
    src_ids = [5, 6, 7, 20]
    if staged:  # a handoff copied into the pinned host arena (ids from BLOCKS on)
        src_regions = with_arena(src_regions, 8)
        for r in src_regions:
            r.stage[:4].copy_(r.pages[src_ids].cpu())
        src_ids = [BLOCKS, BLOCKS + 1, BLOCKS + 2, BLOCKS + 3]
    dst_kv = caches([0, 1], seed=None)
    dst_regions = layer_regions(dst_kv)
    dst_ids = [0, 1, 2, 3]  # consecutive: whole pages go in place
    group, ok = InProcessGroup(), True
    layers = tuple(range(LAYERS))
    for first in (0, 1):  # each head of the two, window by window
        runs = copy_runs(LAYERS, src_ids, dst_ids)
        sender, receiver = NcclTransport(ConnectorConfig()), NcclTransport(ConnectorConfig())
        sender.regions, sender.backend = src_regions, "nccl"
        receiver.regions, receiver.backend = dst_regions, "nccl"
        if DEVICE == "cpu":
            sender.backend = receiver.backend = "gloo"
        sender.send(group, _Sock(), PullPlan(runs, pull_slices(src_regions, layers, first, 1),
                                             layers, (first, 1)), Deadline(10, "check"), b"")
        receiver.recv(group, _Sock(), PullPlan(runs, pull_slices(dst_regions, layers, first, 1),
                                               layers, (first, 1)), Deadline(10, "check"))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    for r_src, r_dst in zip(src_regions, dst_regions):
        for s, d in zip(src_ids, dst_ids):
            ok &= bool(torch.equal(r_dst.rows(d, 1).cpu(), r_src.rows(s, 1).cpu()))
    return check(f"nccl: head windows gathered and scattered on CUDA "
                 f"({'from the pinned arena' if staged else 'paged'})", ok)


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    start = time.monotonic()
    results = [tcp_split(), nccl_gather(False), nccl_gather(True)]
    print(f"{sum(results)}/{len(results)} passed in {time.monotonic() - start:.1f}s")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
