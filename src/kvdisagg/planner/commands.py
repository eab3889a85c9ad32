"""The ``vllm serve`` and ``kvdisagg proxy`` command lines that realize a placement.

GPUs are assigned node by node (``gpus_per_node``), prefill instances first; each instance gets
``CUDA_VISIBLE_DEVICES`` on its node, a port, and the DisaggConnector role of its side (see
docs/gpu-quickstart.md). Hosts are placeholders (``<node0>``...) for the user to fill in.
Must not import ``vllm``.
"""

from __future__ import annotations

import json
import shlex
from typing import NamedTuple

from kvdisagg.planner.placement import Colocated, Disaggregated, Placement


class Launch(NamedTuple):
    role: str
    node: int
    gpus: tuple[int, ...]
    port: int
    command: str


def _kv_config(role: str) -> str:
    cfg: dict[str, object] = {"kv_connector": "DisaggConnector", "kv_role": role}
    if role == "kv_producer":
        cfg["kv_connector_extra_config"] = {"transport": "tcp", "side_channel_host": "PREFILL_HOST_ADDR"}
    return json.dumps(cfg, separators=(",", ":"))


def launch_commands(placement: Placement, model: str, *, gpus_per_node: int = 8, base_port: int = 8100,
                    proxy_port: int = 8000, ttft_slo_s: float | None = None,
                    tpot_slo_s: float | None = None) -> list[Launch | str]:
    """Instance launches in order, then (disaggregated) the proxy command as a plain string.

    A ``pp_cross`` > 1 instance spans nodes: it is launched with ``--pipeline-parallel-size``
    covering all its stages and vLLM's multi-node (Ray) setup, noted in the command.
    """
    if isinstance(placement, Colocated):
        sides = [("colocated", placement.tp, placement.pp, placement.num_instances, None)]
    else:
        pc = placement.pp_cross
        sides = [("prefill", placement.prefill_tp, placement.prefill_pp * pc, placement.num_prefill, "kv_producer"),
                 ("decode", placement.decode_tp, placement.decode_pp * pc, placement.num_decode, "kv_consumer")]
    out: list[Launch | str] = []
    node, next_gpu, port = 0, 0, base_port
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for side, tp, pp, count, role in sides:
        need = tp * pp
        for _ in range(count):
            if need <= gpus_per_node and next_gpu + need > gpus_per_node:
                node, next_gpu = node + 1, 0
            gpus = tuple(range(next_gpu, next_gpu + min(need, gpus_per_node)))
            argv = ["vllm", "serve", model, "--host", "0.0.0.0", "--port", str(port)]
            if tp > 1:
                argv += ["--tensor-parallel-size", str(tp)]
            if pp > 1:
                argv += ["--pipeline-parallel-size", str(pp)]
            if role is not None:
                argv += ["--kv-transfer-config", _kv_config(role)]
            env = f"CUDA_VISIBLE_DEVICES={','.join(map(str, gpus))} "
            note = "" if need <= gpus_per_node else f"  # spans {-(-need // gpus_per_node)} nodes: start a Ray cluster first"
            out.append(Launch(side, node, gpus, port, env + shlex.join(argv) + note))
            if side in urls:
                urls[side].append(f"http://<node{node}>:{port}")
            if need <= gpus_per_node:
                next_gpu += need
            else:
                node, next_gpu = node + -(-need // gpus_per_node), 0
            port += 1
    if isinstance(placement, Disaggregated):
        argv = ["kvdisagg", "proxy", "--prefill", *urls["prefill"], "--decode", *urls["decode"],
                "--policy", "least_loaded", "--host", "0.0.0.0", "--port", str(proxy_port)]
        if ttft_slo_s is not None and tpot_slo_s is not None:
            argv += ["--slo-ttft", f"{ttft_slo_s:g}", "--slo-tpot", f"{tpot_slo_s:g}"]
        out.append(" ".join(argv))
    return out
