"""The prefill side of a transport in its own process, driven by JSON lines on stdin.

The conformance tests (tests/unit/test_transport_conformance.py) and the transfer benchmark run
the decode side in their own process against this one, so every transport is exercised across
a real process boundary with the same seeded KV on both ends:

    python -m kvdisagg.testing.transport_peer --transport tcp --config '{}'
    <- {"port": 41234}
    -> {"op": "offer", "handoff_id": "r1", "token": "t", "block_ids": [2, 3], "prompt": [..]}
    <- {"ok": true}
    -> {"op": "released"}            <- {"released": ["r1"]}
    -> {"op": "reopen"}              <- {"port": 41235}      (close, then a new transport)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec
import torch

from kvdisagg.config import ConnectorConfig
from kvdisagg.layout import layer_regions
from kvdisagg.transport import Offer, Transport, load_transport

KV_LAYOUT = "conformance"
BLOCK_SIZE = 16


def kv_caches(seed: int | None, num_blocks: int = 32, num_layers: int = 2,
              block_shape: tuple[int, ...] = (2, BLOCK_SIZE, 64)) -> dict[str, torch.Tensor]:
    """Per-layer KV tensors like vLLM's CPU layout: seeded random, or zeros for a receiver."""
    shape = (num_blocks, *block_shape)
    if seed is None:
        return {f"layer.{i}": torch.zeros(shape) for i in range(num_layers)}
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.rand(shape, generator=g) for i in range(num_layers)}


def open_transport(config: ConnectorConfig, caches: dict[str, torch.Tensor], *,
                   is_producer: bool) -> tuple[Transport, int]:
    transport = load_transport(config)
    port = transport.register(layer_regions(caches), kv_layout=KV_LAYOUT, block_size=BLOCK_SIZE,
                              is_producer=is_producer)
    return transport, port


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
    args = p.parse_args()
    config = msgspec.convert({**json.loads(args.config), "transport": args.transport},
                             ConnectorConfig)
    shape = tuple(int(x) for x in args.block_shape.split(","))
    caches = kv_caches(args.seed, args.blocks, block_shape=shape)
    transport, port = open_transport(config, caches, is_producer=True)
    _say({"port": port})
    for line in sys.stdin:
        cmd = json.loads(line)
        match cmd.get("op"):
            case "offer":
                transport.offer(Offer(cmd["handoff_id"], cmd["token"], tuple(cmd["block_ids"]),
                                      cmd.get("lease_s", 30.0), tuple(cmd.get("prompt", ()))))
                _say({"ok": True})
            case "released":
                _say({"released": sorted(transport.take_released())})
            case "reopen":
                transport.close()
                transport, port = open_transport(config, caches, is_producer=True)
                _say({"port": port})
            case other:
                _say({"error": f"unknown op {other!r}"})
    transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
