"""``kvdisagg gpu-check``: the CUDA data paths of a pull between differently sharded instances,
checked on one GPU.

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

    kvdisagg gpu-check          # exit 0: every check passed; 1: one failed; 2: no CUDA device
    kvdisagg gpu-check --cpu    # the same code on CPU (a smoke run of the command)

About a minute on a GPU; needs torch (with CUDA, but for ``--cpu``). torch and the transports
are imported inside the checks, so ``kvdisagg --help`` stays fast. Must not import ``vllm``.
"""

from __future__ import annotations

import argparse
import socket
import time
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from kvdisagg.transport.nccl import NcclTransport

BLOCKS, BLOCK, HEAD, LAYERS, KV_HEADS = 64, 16, 128, 2, 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu", action="store_true",
                   help="run the same checks on CPU (a smoke run: no CUDA needed)")


def run(args: argparse.Namespace) -> int:
    """Every check on ``cuda`` (or ``cpu`` with ``--cpu``); 0 if all passed, 1 if one failed,
    2 if there is no CUDA device to check."""
    try:
        import torch
    except ImportError:
        raise SystemExit("kvdisagg gpu-check: torch is not installed: pip install '.[gpu]' "
                         "(from a kvdisagg checkout) installs vLLM and its torch") from None
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("kvdisagg gpu-check: no CUDA device: nothing to check (--cpu runs the same code "
              "on CPU)")
        return 2
    checks = _Checks(device)
    start = time.monotonic()
    results = [checks.tcp_split(), checks.nccl_gather(staged=False),
               checks.nccl_gather(staged=True), checks.nccl_landed()]
    print(f"{sum(results)}/{len(results)} passed on {device} in "
          f"{time.monotonic() - start:.1f}s")
    return 0 if all(results) else 1


def _check(name: str, ok: bool) -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    return ok


class _NoSocket:
    """The side channel a check does without: Done and the like go nowhere."""

    def sendall(self, data: bytes) -> None:
        pass


def _sock() -> socket.socket:
    return cast(socket.socket, _NoSocket())


class _Checks:
    """The checks on one device (``cuda``, or ``cpu`` for the smoke run)."""

    def __init__(self, device: str) -> None:
        from kvdisagg.connector.layout import KvGeometry

        self.device = device
        self.geometry = KvGeometry(model="gpu-check", dtype="float16", kv_dtype="torch.float16",
                                   block_size=BLOCK, head_size=HEAD // 2, kv_heads=KV_HEADS,
                                   layers=LAYERS, head_bytes=BLOCK * HEAD * 2)

    def caches(self, heads: list[int], seed: int | None) -> dict[str, Any]:
        """Per layer, a paged KV tensor holding ``heads``: zeros, or seeded random values."""
        import torch

        out = {}
        for layer in range(LAYERS):
            if seed is None:
                out[f"layers.{layer}"] = torch.zeros((BLOCKS, len(heads), BLOCK, HEAD),
                                                     dtype=torch.float16, device=self.device)
            else:
                g = torch.Generator().manual_seed(seed * 100 + layer)
                full = torch.rand((BLOCKS, KV_HEADS, BLOCK, HEAD), generator=g).half()
                out[f"layers.{layer}"] = full[:, heads].contiguous().to(self.device)
        return out

    def tcp_split(self) -> bool:
        import msgspec
        import torch

        from kvdisagg.connector.config import ConnectorConfig
        from kvdisagg.connector.layout import layer_regions
        from kvdisagg.connector.sharding import Shape, plan
        from kvdisagg.transport import Fetch, Offer, load_transport

        config = msgspec.convert({"transport": "tcp", "transfer_timeout_seconds": 10.0},
                                 ConnectorConfig)
        geometry = self.geometry
        prefill_kv = self.caches([0, 1], seed=1)
        prefill = load_transport(config)
        port = prefill.register(layer_regions(prefill_kv), kv_layout=geometry.fingerprint(),
                                block_size=BLOCK, is_producer=True, geometry=geometry, rank=0)
        src, dst = [3, 4, 9], [10, 11, 2]
        prefill.offer(Offer("h", "tok", tuple(src), 30.0))
        shape_p, shape_d = Shape(1), Shape(2)
        ok = True
        for rank, parts in enumerate(plan(shape_p, shape_d, KV_HEADS, LAYERS)):
            decode_kv = self.caches([rank], seed=None)
            decode = load_transport(config)
            decode.register(layer_regions(decode_kv), kv_layout=geometry.fingerprint(),
                            block_size=BLOCK, is_producer=False, geometry=geometry, rank=rank)
            for part in parts:
                decode.fetch(Fetch("h", "tok", "127.0.0.1", port, geometry.fingerprint(),
                                   tuple(src), tuple(dst), part=part, prefill=shape_p), 10.0)
            for name, tensor in decode_kv.items():
                ok &= bool(torch.equal(tensor[dst], prefill_kv[name][src][:, [rank]]))
            decode.close()
        prefill.close()
        via = "CUDA KV via host" if self.device == "cuda" else "KV in host memory"
        return _check(f"tcp: prefill TP1 -> decode TP2, each rank its head, {via}", ok)

    def transport(self, regions: list[Any]) -> NcclTransport:
        """A side as the worker attaches it: NCCL and CudaSync on CUDA, gloo and HostSync on
        CPU."""
        from kvdisagg.connector.config import ConnectorConfig
        from kvdisagg.transport.nccl import NcclTransport

        side = NcclTransport(ConnectorConfig())
        side.regions = regions
        side.attach(regions, is_producer=False)
        return side

    def nccl_gather(self, staged: bool) -> bool:
        import torch

        from kvdisagg.connector.layout import copy_runs, layer_regions, pull_slices, with_arena
        from kvdisagg.transport.pull import Deadline, PullPlan

        src_regions = layer_regions(self.caches([0, 1], seed=2))
        src_ids = [5, 6, 7, 20]
        if staged:  # a handoff copied into the pinned host arena (ids from BLOCKS on)
            src_regions = with_arena(src_regions, 8)
            for r in src_regions:
                r.stage[:4].copy_(r.pages[src_ids].cpu())
            src_ids = [BLOCKS, BLOCKS + 1, BLOCKS + 2, BLOCKS + 3]
        dst_regions = layer_regions(self.caches([0, 1], seed=None))
        dst_ids = [0, 1, 2, 3]  # consecutive: whole pages go in place
        group, ok = _InProcessGroup(self.device), True
        layers = tuple(range(LAYERS))
        for first in (0, 1):  # each head of the two, window by window
            runs = copy_runs(LAYERS, src_ids, dst_ids)
            sender, receiver = self.transport(src_regions), self.transport(dst_regions)
            sender.send(group, _sock(), PullPlan(runs, pull_slices(src_regions, layers, first,
                                                                   1), layers, (first, 1)),
                        Deadline(10, "check"), b"")
            receiver.recv(group, _sock(), PullPlan(runs, pull_slices(dst_regions, layers,
                                                                     first, 1),
                                                   layers, (first, 1)), Deadline(10, "check"))
        for r_src, r_dst in zip(src_regions, dst_regions):
            for s, d in zip(src_ids, dst_ids):
                ok &= bool(torch.equal(r_dst.rows(d, 1).cpu(), r_src.rows(s, 1).cpu()))
        return _check(f"nccl: head windows gathered and scattered on {self.device} "
                      f"({'from the pinned arena' if staged else 'paged'})", ok)

    def nccl_landed(self) -> bool:
        """After ``recv`` returns, with no synchronize here, the pages hold the bytes: the
        receives land late (a GPU sleep first, on the group's stream), each scatter is queued on
        the current stream behind another sleep, and the pages are read on another stream, as
        vLLM's forward would; the current stream has nothing left to run. (Without nccl.py's
        fence, recv returns with the scatters queued and the pages read zeros.) Then a receive
        that lands after the deadline: a TransferTimeout within it, not a hang."""
        import torch

        from kvdisagg.connector.layout import copy_runs, layer_regions, pull_slices
        from kvdisagg.errors import TransferTimeout
        from kvdisagg.transport.pull import Deadline, PullPlan

        cuda = self.device == "cuda"
        src_regions = layer_regions(self.caches([0, 1], seed=3))
        dst_regions = layer_regions(self.caches([0, 1], seed=None))
        src_ids, dst_ids = [5, 9, 6, 30], [7, 2, 11, 4]  # scattered: through buffers
        layers = tuple(range(LAYERS))
        runs = copy_runs(LAYERS, src_ids, dst_ids)
        delay = 200_000_000 if cuda else 0  # GPU cycles: ~0.1 s
        group = _InProcessGroup(self.device, delay)
        sender, receiver = self.transport(src_regions), self.transport(dst_regions)
        scatter = receiver._scatter

        def late_scatter(*args: Any) -> None:  # queued behind other work on a busy stream
            if delay:
                torch.cuda._sleep(delay)
            scatter(*args)
        receiver._scatter = late_scatter  # type: ignore[method-assign,assignment]
        sender.send(group, _sock(), PullPlan(runs, pull_slices(src_regions, layers, 0, 2),
                                             layers, (0, 2)), Deadline(10, "check"), b"")
        receiver.recv(group, _sock(), PullPlan(runs, pull_slices(dst_regions, layers, 0, 2),
                                               layers, (0, 2)), Deadline(10, "check"))
        ok = True
        if cuda:
            ok &= bool(torch.cuda.current_stream().query())  # no copy still queued
            reader = torch.cuda.Stream()  # does not wait for the current stream
            with torch.cuda.stream(reader):
                got = [r.pages.to("cpu") for r in dst_regions]
        else:
            got = [r.pages.clone() for r in dst_regions]
        for r_src, pages in zip(src_regions, got):
            for s, d in zip(src_ids, dst_ids):
                ok &= bool(torch.equal(pages[d], r_src.rows(s, 1)[0].cpu()))
        ok = _check("nccl: the pages hold the bytes when recv returns (read on another stream)",
                    ok)
        if not cuda:
            return ok
        receiver._scatter = scatter  # type: ignore[method-assign]
        late = _InProcessGroup(self.device, delay=2_000_000_000)  # ~1 s, past the deadline
        sender.send(late, _sock(), PullPlan(runs, pull_slices(src_regions, layers, 0, 2),
                                            layers, (0, 2)), Deadline(10, "check"), b"")
        started = time.monotonic()
        try:
            receiver.recv(late, _sock(), PullPlan(runs, pull_slices(dst_regions, layers, 0, 2),
                                                  layers, (0, 2)), Deadline(0.2, "check"))
            timed_out = False
        except TransferTimeout:
            timed_out = True
        elapsed = time.monotonic() - started
        torch.cuda.synchronize()  # let the late receive finish before the next check
        return _check(f"nccl: a receive landing after the deadline raised TransferTimeout in "
                      f"{elapsed:.2f}s (deadline 0.2s)", timed_out and elapsed < 0.6) and ok


class _InProcessGroup:
    """Sends and receives of two 'ranks' in one process, matched by tag, as NCCL runs them on
    CUDA: each op on a side stream (after the current stream's work, as NCCL's stream waits for
    it), ``is_completed()`` true once that stream got there, ``wait()`` only making the current
    stream wait for it. ``delay``: GPU cycles a receive sleeps first (its bytes land late). On CPU
    each op is done at once."""

    def __init__(self, device: str, delay: int = 0) -> None:
        import torch

        self.sent: dict[int, Any] = {}
        self.delay = delay
        self.side = torch.cuda.Stream() if device == "cuda" else None

    class Work:
        def __init__(self, event: Any) -> None:
            self.event = event

        def is_completed(self) -> bool:
            return self.event is None or bool(self.event.query())

        def wait(self, timeout: Any = None) -> bool:
            if self.event is not None:
                import torch

                torch.cuda.current_stream().wait_event(self.event)
            return True

    def _on_side(self, op: Any, tensor: Any) -> Any:
        """Run ``op`` on the group's stream after the current stream's work; its event."""
        import torch

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

    def send(self, tensors: list[Any], dst: int, tag: int) -> Work:
        source = tensors[0]

        def op() -> None:
            self.sent[tag] = source.clone()
        return self.Work(self._on_side(op, source))

    def recv(self, tensors: list[Any], src: int, tag: int) -> Work:
        import torch

        sent, target = self.sent.pop(tag), tensors[0]  # sent on the same stream, before

        def op() -> None:
            if self.delay:
                torch.cuda._sleep(self.delay)
            target.view(-1).view(torch.uint8).copy_(sent.view(-1).view(torch.uint8))
        return self.Work(self._on_side(op, target))
