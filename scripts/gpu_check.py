"""Check the CUDA data paths of a pull between differently sharded instances, on one GPU.

CI runs on CPU; this exercises what only a GPU runs: a prefill TP1 worker's KV (2 heads per
block) on CUDA, read by a decode TP2 worker (1 head each) on CUDA, through

- tcp: a real pull over loopback between two transports in this process (CUDA KV staged
  through pinned host memory), for both decode ranks, a window of each block;
- nccl: the gather and scatter of a head window on CUDA (``index_select``/``index_copy_`` on a
  narrowed page view, and the in-place path for whole pages), with an in-process group (NCCL
  itself refuses two ranks on one GPU), from paged blocks and from a pinned staging arena;
- nccl: the synchronization (nccl.py's docstring): the in-process group behaves as NCCL does
  (each op on a stream of its own, late; ``wait()`` only orders streams), and once ``recv``
  returns, with no synchronize by the caller, the pages hold the bytes as another stream reads
  them; an op that never completes raises TransferTimeout within the deadline.

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
from kvdisagg.errors import TransferTimeout
from kvdisagg.layout import KvGeometry, copy_runs, layer_regions, pull_slices, with_arena
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
    """Sends and receives of two 'ranks' in one process, matched by tag, as NCCL runs them on
    CUDA: each op on a side stream (after the current stream's work, as NCCL's stream waits for
    it), ``is_completed()`` true once that stream got there, ``wait()`` only making the current
    stream wait for it. ``delay``: GPU cycles a receive sleeps first (its bytes land late). On CPU
    each op is done at once."""

    def __init__(self, delay: int = 0) -> None:
        self.sent: dict[int, torch.Tensor] = {}
        self.delay = delay
        self.side = torch.cuda.Stream() if DEVICE == "cuda" else None

    class Work:
        def __init__(self, event: Any) -> None:
            self.event = event

        def is_completed(self) -> bool:
            return self.event is None or bool(self.event.query())

        def wait(self, timeout: Any = None) -> bool:
            if self.event is not None:
                torch.cuda.current_stream().wait_event(self.event)
            return True

    def _on_side(self, op: Any, tensor: torch.Tensor) -> Any:
        """Run ``op`` on the group's stream after the current stream's work; its event."""
        if self.side is None:
            op()
            return None
        self.side.wait_stream(torch.cuda.current_stream())
        tensor.record_stream(self.side)  # freed by the caller: not reused before op ran
        with torch.cuda.stream(self.side):
            op()
            event = torch.cuda.Event()
            event.record(self.side)
        return event

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        source = tensors[0]

        def op() -> None:
            self.sent[tag] = source.clone()
        return self.Work(self._on_side(op, source))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        sent, target = self.sent.pop(tag), tensors[0]  # sent on the same stream, before

        def op() -> None:
            if self.delay:
                torch.cuda._sleep(self.delay)
            target.view(-1).view(torch.uint8).copy_(sent.view(-1).view(torch.uint8))
        return self.Work(self._on_side(op, target))


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
        sender, receiver = transport(src_regions), transport(dst_regions)
        sender.send(group, _Sock(), PullPlan(runs, pull_slices(src_regions, layers, first, 1),
                                             layers, (first, 1)), Deadline(10, "check"), b"")
        receiver.recv(group, _Sock(), PullPlan(runs, pull_slices(dst_regions, layers, first, 1),
                                               layers, (first, 1)), Deadline(10, "check"))
    for r_src, r_dst in zip(src_regions, dst_regions):
        for s, d in zip(src_ids, dst_ids):
            ok &= bool(torch.equal(r_dst.rows(d, 1).cpu(), r_src.rows(s, 1).cpu()))
    return check(f"nccl: head windows gathered and scattered on CUDA "
                 f"({'from the pinned arena' if staged else 'paged'})", ok)


def transport(regions: list[Any]) -> NcclTransport:
    """A side as the worker attaches it: NCCL and CudaSync on CUDA, gloo and HostSync on CPU."""
    side = NcclTransport(ConnectorConfig())
    side.regions = regions
    side.attach(regions, is_producer=False)
    return side


def nccl_landed() -> bool:
    """After ``recv`` returns, with no synchronize here, the pages hold the bytes: the receives
    land late (a GPU sleep first, on the group's stream), each scatter is queued on the current
    stream behind another sleep, and the pages are read on another stream, as vLLM's forward
    would; the current stream has nothing left to run. (Without nccl.py's fence, recv returns
    with the scatters queued and the pages read zeros.) Then a receive that lands after the
    deadline: a TransferTimeout within it, not a hang."""
    src_regions = layer_regions(caches([0, 1], seed=3))
    dst_regions = layer_regions(caches([0, 1], seed=None))
    src_ids, dst_ids = [5, 9, 6, 30], [7, 2, 11, 4]  # scattered: through buffers
    layers = tuple(range(LAYERS))
    runs = copy_runs(LAYERS, src_ids, dst_ids)
    delay = 200_000_000 if DEVICE == "cuda" else 0  # GPU cycles: ~0.1 s
    group = InProcessGroup(delay)
    sender, receiver = transport(src_regions), transport(dst_regions)
    scatter = receiver._scatter

    def late_scatter(*args: Any) -> None:  # queued behind other work on a busy stream
        if delay:
            torch.cuda._sleep(delay)
        scatter(*args)
    receiver._scatter = late_scatter  # type: ignore[method-assign]
    sender.send(group, _Sock(), PullPlan(runs, pull_slices(src_regions, layers, 0, 2), layers,
                                         (0, 2)), Deadline(10, "check"), b"")
    receiver.recv(group, _Sock(), PullPlan(runs, pull_slices(dst_regions, layers, 0, 2), layers,
                                           (0, 2)), Deadline(10, "check"))
    ok = True
    if DEVICE == "cuda":
        ok &= bool(torch.cuda.current_stream().query())  # no copy still queued
        reader = torch.cuda.Stream()  # does not wait for the current stream
        with torch.cuda.stream(reader):
            got = [r.pages.to("cpu") for r in dst_regions]
    else:
        got = [r.pages.clone() for r in dst_regions]
    for r_src, pages in zip(src_regions, got):
        for s, d in zip(src_ids, dst_ids):
            ok &= bool(torch.equal(pages[d], r_src.rows(s, 1)[0].cpu()))
    ok = check("nccl: the pages hold the bytes when recv returns (read on another stream)", ok)
    if DEVICE != "cuda":
        return ok
    receiver._scatter = scatter  # type: ignore[method-assign]
    late = InProcessGroup(delay=2_000_000_000)  # ~1 s, past the deadline
    sender.send(late, _Sock(), PullPlan(runs, pull_slices(src_regions, layers, 0, 2), layers,
                                        (0, 2)), Deadline(10, "check"), b"")
    started = time.monotonic()
    try:
        receiver.recv(late, _Sock(), PullPlan(runs, pull_slices(dst_regions, layers, 0, 2),
                                              layers, (0, 2)), Deadline(0.2, "check"))
        timed_out = False
    except TransferTimeout:
        timed_out = True
    elapsed = time.monotonic() - started
    torch.cuda.synchronize()  # let the late receive finish before the next check
    return check(f"nccl: a receive landing after the deadline raised TransferTimeout in "
                 f"{elapsed:.2f}s (deadline 0.2s)", timed_out and elapsed < 0.6) and ok


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    start = time.monotonic()
    results = [tcp_split(), nccl_gather(False), nccl_gather(True), nccl_landed()]
    print(f"{sum(results)}/{len(results)} passed in {time.monotonic() - start:.1f}s")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
