"""The prefill side of a transport in its own process, driven by JSON lines on stdin.

The conformance tests (tests/unit/transport/test_conformance.py) and the transfer benchmark run
the decode side in their own process against this one, so every transport is exercised across
a real process boundary with the same seeded KV on both ends:

    python -m tests.support.transport_peer --transport tcp --config '{}'
        [--layers 2,3 --heads 1 --kv-heads 2 --rank 1 --shape 2:0,2]   (one rank's shard)
    <- {"port": 41234}
    -> {"op": "offer", "handoff_id": "r1", "token": "t", "block_ids": [2, 3], "prompt": [..]}
    <- {"ok": true}
    -> {"op": "offer", ..., "block_ids": [32, 33], "stage_from": [2, 3]}   (staged in the arena)
    -> {"op": "scribble", "block_ids": [2, 3]}    <- {"ok": true}   (overwrite paged blocks)
    -> {"op": "released"}            <- {"released": ["r1"]}
    -> {"op": "step", "running": true}  <- {"ok": true}   (an engine step began; false: ended)
    -> {"op": "reopen"}              <- {"port": 41235}      (close, then a new transport)
"""

from __future__ import annotations

import argparse
import atexit
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from kvdisagg.connector.config import ConnectorConfig
from kvdisagg.connector.layout import KvGeometry, layer_regions, stage_into, with_arena
from kvdisagg.connector.sharding import Shape
from kvdisagg.transport import Offer, Transport, load_transport

KV_LAYOUT = "conformance"
BLOCK_SIZE = 16
HEAD = 64  # floats per head per token (K and V)


def geometry(kv_heads: int = 2, layers: int = 2, block_size: int = BLOCK_SIZE) -> KvGeometry:
    """The geometry both sides of a conformance pair register (``KV_LAYOUT`` is its name)."""
    return KvGeometry(model="conformance", dtype="float32", kv_dtype="torch.float32",
                      block_size=block_size, head_size=HEAD // 2, kv_heads=kv_heads,
                      layers=layers, head_bytes=block_size * HEAD * 4)


def kv_caches(seed: int | None, num_blocks: int = 32, num_layers: int = 2,
              block_shape: tuple[int, ...] = (2, BLOCK_SIZE, HEAD)) -> dict[str, torch.Tensor]:
    """Per-layer KV tensors like vLLM's CPU layout: seeded random, or zeros for a receiver."""
    shape = (num_blocks, *block_shape)
    if seed is None:
        return {f"layer.{i}": torch.zeros(shape) for i in range(num_layers)}
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.rand(shape, generator=g) for i in range(num_layers)}


def model_kv(seed: int, layer: int, kv_heads: int, num_blocks: int = 32) -> torch.Tensor:
    """The whole model's KV of one layer (every head), the same in every process."""
    g = torch.Generator().manual_seed(seed * 1000 + layer)
    return torch.rand((num_blocks, kv_heads, BLOCK_SIZE, HEAD), generator=g)


def shard_caches(seed: int | None, layers: Sequence[int], heads: Sequence[int], kv_heads: int,
                 num_blocks: int = 32) -> dict[str, torch.Tensor]:
    """One rank's shard of ``model_kv``: its layers (named by their model ids) and heads (zeros
    for a receiver), like vLLM's per-layer tensors of a TP/PP rank."""
    if seed is None:
        return {f"layer.{layer}": torch.zeros((num_blocks, len(heads), BLOCK_SIZE, HEAD))
                for layer in layers}
    return {f"layer.{layer}": model_kv(seed, layer, kv_heads, num_blocks)[:, list(heads)]
            .contiguous() for layer in layers}


def open_transport(config: ConnectorConfig, caches: dict[str, torch.Tensor], *,
                   is_producer: bool, stage_blocks: int = 0, geometry: KvGeometry | None = None,
                   rank: int = 0, shape: Shape = Shape(1)) -> tuple[Transport, int]:
    regions = layer_regions(caches)
    if stage_blocks:
        regions = with_arena(regions, stage_blocks)
    transport = load_transport(config)
    port = transport.register(regions, kv_layout=KV_LAYOUT, block_size=BLOCK_SIZE,
                              is_producer=is_producer, geometry=geometry, rank=rank,
                              shape=shape)
    return transport, port


SPARES = 2
"""Peer processes started ahead, idle after their imports (torch: about 2 s of one core) until
a PeerProcess gives one its arguments: a test's peers start while earlier tests run (they
mostly wait), not when the test asks. Each test still gets fresh processes."""
_spares: list[subprocess.Popen[str]] = []


def _start_spare() -> subprocess.Popen[str]:
    return subprocess.Popen(  # cwd: where the package ``tests`` is importable
        [sys.executable, "-m", "tests.support.transport_peer", "--spare"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[2])


def _spare() -> subprocess.Popen[str]:
    """A started peer waiting for its arguments; as many started again in its place."""
    if not _spares:
        atexit.register(_stop_spares)
    live = [p for p in _spares if p.poll() is None]
    proc = live.pop(0) if live else _start_spare()
    _spares[:] = live
    while len(_spares) < SPARES:
        _spares.append(_start_spare())
    return proc


def _stop_spares() -> None:
    for proc in _spares:
        proc.kill()
        proc.wait()


class PeerProcess:
    """Client of this module run as a subprocess: the prefill side, seeded, in its own process."""

    def __init__(self, transport: str, extra: dict[str, Any], *, seed: int = 1,
                 blocks: int = 32, block_shape: Sequence[int] = (2, BLOCK_SIZE, HEAD),
                 stage_blocks: int = 0, shard: tuple[Sequence[int], Sequence[int], int] | None
                 = None, rank: int = 0, shape: Shape = Shape(1), model_layers: int = 2) -> None:
        """``shard``: (layers, heads, the model's KV heads) of rank ``rank`` of an instance of
        ``shape`` (``model_kv`` of a model of ``model_layers``); None: ``kv_caches``. The
        transport registers as ``rank`` either way (its ports are the configured ones + rank)."""
        args = []
        if shard is not None:
            layers, heads, kv_heads = shard
            args = [
                "--layers",
                ",".join(map(str, layers)),
                "--heads",
                ",".join(map(str, heads)),
                "--kv-heads",
                str(kv_heads),
                "--model-layers",
                str(model_layers),
                "--shape",
                f"{shape.tp}:{','.join(map(str, shape.stages))}",
            ]
        self.proc = _spare()
        self.proc.stdin.write(json.dumps([
            "--transport", transport, "--config", json.dumps(extra), "--seed", str(seed),
            "--blocks", str(blocks), "--block-shape", ",".join(map(str, block_shape)),
            "--stage-blocks", str(stage_blocks), "--rank", str(rank), *args]) + "\n")
        self.proc.stdin.flush()
        self.port = self._read()["port"]

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"transport peer exited ({self.proc.wait(timeout=10)})")
        return json.loads(line)

    def ask(self, **cmd: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def offer(self, handoff_id: str, block_ids: Sequence[int], prompt: Sequence[int],
              lease_s: float = 30.0, stage_from: Sequence[int] = (), token: str = "") -> str:
        token = token or secrets.token_hex(8)
        reply = self.ask(op="offer", handoff_id=handoff_id, token=token,
                         block_ids=list(block_ids), prompt=list(prompt), lease_s=lease_s,
                         stage_from=list(stage_from))
        if reply != {"ok": True}:
            raise RuntimeError(f"offer refused: {reply}")
        return token

    def released(self, want: set[str], within_s: float = 5.0) -> set[str]:
        """Poll until every id in ``want`` was released (or the time is up)."""
        got: set[str] = set()
        end = time.monotonic() + within_s
        while not want <= got and time.monotonic() < end:
            got |= set(self.ask(op="released")["released"])
            time.sleep(0.01)
        return got

    def reopen(self) -> int:
        self.port = self.ask(op="reopen")["port"]
        return self.port

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", required=True)
    p.add_argument("--config", default="{}", help="extra ConnectorConfig keys (JSON)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--block-shape", default="2,16,64")
    p.add_argument("--stage-blocks", type=int, default=0, help="staging arena blocks")
    p.add_argument("--layers", help="this rank's layers (model ids); default: kv_caches")
    p.add_argument("--heads", help="this rank's KV heads (model ids)")
    p.add_argument("--kv-heads", type=int, default=2, help="the model's KV heads")
    p.add_argument("--model-layers", type=int, default=2, help="the model's layers")
    p.add_argument("--rank", type=int, default=0, help="this rank (PP-major)")
    p.add_argument("--shape", default="1:0", help="TP:first layer of each PP stage")
    argv = sys.argv[1:]
    if argv == ["--spare"]:  # imported, now told what to be (PeerProcess)
        line = sys.stdin.readline()
        if not line:
            return 0  # not needed after all
        argv = json.loads(line)
    args = p.parse_args(argv)
    config = msgspec.convert({**json.loads(args.config), "transport": args.transport},
                             ConnectorConfig)
    tp, _, stages = args.shape.partition(":")
    shape = Shape(int(tp), tuple(int(x) for x in stages.split(",")))
    if args.layers:
        layers = [int(x) for x in args.layers.split(",")]
        caches = shard_caches(args.seed, layers, [int(x) for x in args.heads.split(",")],
                              args.kv_heads, args.blocks)
        geo = geometry(args.kv_heads, args.model_layers)
    else:
        block_shape = tuple(int(x) for x in args.block_shape.split(","))
        caches = kv_caches(args.seed, args.blocks, block_shape=block_shape)
        geo = None
    transport, port = open_transport(config, caches, is_producer=True,
                                     stage_blocks=args.stage_blocks, geometry=geo,
                                     rank=args.rank, shape=shape)
    _say({"port": port})
    for line in sys.stdin:
        cmd = json.loads(line)
        match cmd.get("op"):
            case "offer":
                if cmd.get("stage_from"):
                    stage_into(transport.regions, cmd["stage_from"], cmd["block_ids"])
                transport.offer(Offer(cmd["handoff_id"], cmd["token"], tuple(cmd["block_ids"]),
                                      cmd.get("lease_s", 30.0), tuple(cmd.get("prompt", ()))))
                _say({"ok": True})
            case "expect":  # an early handoff's request reached the engine
                transport.expect(cmd["handoff_id"], cmd["token"])
                _say({"ok": True})
            case "forget":
                transport.forget(cmd["handoff_id"], cmd["why"])
                _say({"ok": True})
            case "scribble":
                for tensor in caches.values():
                    tensor[cmd["block_ids"]] = -1.0
                _say({"ok": True})
            case "released":
                _say({"released": sorted(transport.take_released())})
            case "step":  # the engine started (running) or ended a step
                transport.step(cmd["running"])
                _say({"ok": True})
            case "reopen":
                transport.close()
                transport, port = open_transport(config, caches, is_producer=True,
                                                 stage_blocks=args.stage_blocks, geometry=geo,
                                                 rank=args.rank, shape=shape)
                _say({"port": port})
            case other:
                _say({"error": f"unknown op {other!r}"})
    transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
