"""The shell lines that start a placement: one per instance, then ``kvdisagg proxy``.

Pasted into a shell on their node, they start it: each instance line ends with ``&`` and the
proxy line runs in the foreground. Accelerators (GPUs, or cores with ``device="cpu"``) are
assigned node by node (``gpus_per_node``), prefill instances first. Each instance gets its
devices (``CUDA_VISIBLE_DEVICES``; on CPU ``VLLM_CPU_OMP_THREADS_BIND``, one core per rank), a
port, its parallel flags and the DisaggConnector role of its side; a prefill instance's side
channel listens on its node's address. Node addresses come from ``hosts``; without them a
one-node plan runs on 127.0.0.1 and a larger one keeps ``<nodeK>`` placeholders to fill in.

Only placements DisaggConnector serves are turned into lines (``unserved``): every instance on
one node, since a handoff names one host for all of prefill's ranks.

The transport in each side's ``kv_connector_extra_config`` and the proxy's ``--policy`` come from
the caller (``kvdisagg plan --transport/--policy``; ``choose_transport`` picks one for
``auto``). ``kustomization`` writes the replica counts as a kustomize overlay of the Kubernetes
example's ``prefill`` and ``decode`` Deployments.

Must not import ``vllm``.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Sequence
from typing import Literal, NamedTuple

import yaml

from kvdisagg.errors import ConfigError
from kvdisagg.planner.placement import Colocated, Disaggregated, Placement

Device = Literal["gpu", "cpu"]
CPU_SERVER = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model"]
"""vllm-cpu's ``vllm`` console script does not start (docs/configuration.md): its module does."""
TRANSPORTS = ("tcp", "nccl", "mooncake", "lmcache")
POLICIES = ("round_robin", "least_loaded", "prefix_aware", "slo_aware")
"""The proxy's policy names (proxy/types.PolicyName; the planner does not import the proxy)."""
SIMULATED_POLICY = "least_loaded"
"""The dispatch the simulator models (least-loaded prefill, then least-loaded decode): the
policy whose goodput the plan predicts."""
PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT = "prefill", "decode"
"""The Deployments of examples/kubernetes that ``kustomization`` scales."""


class Choice(NamedTuple):
    """A setting of the launch lines and why it was chosen."""

    name: str
    why: str


def choose_transport(requested: str, device: Device) -> Choice:
    """``requested`` as is, or for ``auto``: ``nccl`` between GPUs (KV moves device to device;
    ``tcp`` would stage it through host memory), ``tcp`` on CPU (no dependency; its KV is in
    host memory anyway)."""
    if requested != "auto":
        if requested not in TRANSPORTS:
            raise ConfigError(f"--transport {requested!r}: choose auto or one of "
                              f"{', '.join(TRANSPORTS)}")
        return Choice(requested, "--transport")
    if device == "gpu":
        return Choice("nccl", "auto on GPUs: KV moves device to device; tcp would stage it "
                              "through host memory")
    return Choice("tcp", "auto on CPU: KV is in host memory already, and tcp needs nothing")


class Launch(NamedTuple):
    role: str
    node: int
    gpus: tuple[int, ...]
    port: int
    command: str
    """The instance's command line (the printed line adds `` &``)."""


def unserved(placement: Placement, gpus_per_node: int) -> str:
    """'' if DisaggConnector serves ``placement`` on nodes of ``gpus_per_node`` devices, else
    why not. Any TP and PP on either side is served (connector/sharding.py); an instance
    spanning nodes is not: kv_transfer_params name one side-channel host for all of a
    prefill's ranks."""
    if isinstance(placement, Colocated):
        sides = [("colocated", placement.tp * placement.pp)]
    else:
        if placement.pp_cross > 1:
            return (f"instances span {placement.pp_cross} nodes (pp_cross): a handoff names one "
                    "host for all of prefill's ranks")
        sides = [("prefill", placement.prefill_tp * placement.prefill_pp),
                 ("decode", placement.decode_tp * placement.decode_pp)]
    for side, need in sides:
        if need > gpus_per_node:
            return f"a {side} instance needs {need} devices, more than a node's {gpus_per_node}"
    return ""


def launch_commands(placement: Placement, model: str, *, gpus_per_node: int = 8,
                    base_port: int = 8100, proxy_port: int = 8000,
                    ttft_slo_s: float | None = None, tpot_slo_s: float | None = None,
                    device: Device = "gpu", hosts: Sequence[str] = (),
                    serve_args: Sequence[str] = (), transport: str = "tcp",
                    policy: str = SIMULATED_POLICY,
                    lmcache_url: str | None = None) -> list[Launch | str]:
    """Instance launches in order, then (disaggregated) the proxy command as a plain string.
    ``serve_args`` go on every instance line (e.g. ``--dtype float32``); ``transport`` in both
    sides' connector config (``lmcache`` needs ``lmcache_url``, ``lm://host:port``);
    ``policy`` for the proxy's both sides."""
    if why := unserved(placement, gpus_per_node):
        raise ConfigError(f"DisaggConnector does not serve {placement.describe()}: {why}")
    if transport not in TRANSPORTS:
        raise ConfigError(f"transport {transport!r}: choose one of {', '.join(TRANSPORTS)}")
    if policy not in POLICIES:
        raise ConfigError(f"policy {policy!r}: choose one of {', '.join(POLICIES)}")
    if transport == "lmcache" and not (lmcache_url or "").startswith("lm://"):
        raise ConfigError("transport lmcache needs the LMCache server's address: --lmcache-url "
                          "lm://HOST:PORT (started with lmcache_server HOST PORT cpu)")
    sides: list[tuple[str, int, int, int, str | None]]
    if isinstance(placement, Colocated):
        sides = [("colocated", placement.tp, placement.pp, placement.num_instances, None)]
    else:
        sides = [("prefill", placement.prefill_tp, placement.prefill_pp, placement.num_prefill,
                  "kv_producer"),
                 ("decode", placement.decode_tp, placement.decode_pp, placement.num_decode,
                  "kv_consumer")]
    nodes = _nodes_needed(sides, gpus_per_node)
    if hosts and len(hosts) < nodes:
        raise ConfigError(f"the plan uses {nodes} nodes; --hosts names {len(hosts)}")

    def host(node: int) -> str:
        if hosts:
            return hosts[node]
        return "127.0.0.1" if nodes == 1 else f"<node{node}>"

    out: list[Launch | str] = []
    node, next_gpu, port = 0, 0, base_port
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for side, tp, pp, count, role in sides:
        need = tp * pp
        for _ in range(count):
            if next_gpu + need > gpus_per_node:
                node, next_gpu = node + 1, 0
            gpus = tuple(range(next_gpu, next_gpu + need))
            argv = [*(CPU_SERVER if device == "cpu" else ["vllm", "serve"]), model,
                    "--host", host(node), "--port", str(port)]
            if tp > 1:
                argv += ["--tensor-parallel-size", str(tp)]
            if pp > 1:
                argv += ["--pipeline-parallel-size", str(pp)]
            if device == "cpu" and need > 1:
                argv += ["--distributed-executor-backend", "mp"]
            argv += list(serve_args)
            if role is not None:
                argv += ["--kv-transfer-config",
                         _kv_config(role, host(node), transport, lmcache_url)]
            env = (f"VLLM_CPU_OMP_THREADS_BIND={shlex.quote('|'.join(map(str, gpus)))}"
                   if device == "cpu" else f"CUDA_VISIBLE_DEVICES={','.join(map(str, gpus))}")
            out.append(Launch(side, node, gpus, port, f"{env} {shlex.join(argv)}"))
            if side in urls:
                urls[side].append(f"http://{host(node)}:{port}")
            next_gpu += need
            port += 1
    if isinstance(placement, Disaggregated):
        argv = ["kvdisagg", "proxy", "--prefill", *urls["prefill"], "--decode", *urls["decode"],
                "--policy", policy, "--host", host(0), "--port", str(proxy_port)]
        if ttft_slo_s is not None and tpot_slo_s is not None:
            argv += ["--slo-ttft", f"{ttft_slo_s:g}", "--slo-tpot", f"{tpot_slo_s:g}"]
        out.append(shlex.join(argv))
    return out


def printed(commands: Sequence[Launch | str]) -> list[str]:
    """The lines as ``kvdisagg plan`` prints them: a comment per node, instances in the
    background, the proxy last in the foreground."""
    lines, node = [], -1
    for c in commands:
        if isinstance(c, Launch):
            if c.node != node:
                node = c.node
                lines.append(f"# node {node}")
            lines.append(c.command + " &")
        else:
            lines.append(c)
    return lines


def _kv_config(role: str, host: str, transport: str, lmcache_url: str | None) -> str:
    """One side's ``--kv-transfer-config``. Prefill's side channel listens on, and advertises,
    its node's address; with mooncake decode's engine listens on its own node's address too;
    with lmcache a chunk missing from the store is recomputed, not an error."""
    cfg: dict[str, object] = {"kv_connector": "DisaggConnector", "kv_role": role}
    extra: dict[str, object] = {"transport": transport}
    if transport == "lmcache":
        cfg["kv_load_failure_policy"] = "recompute"
        extra["lmcache_url"] = lmcache_url
    if role == "kv_producer" or transport == "mooncake":
        extra["side_channel_host"] = host
    if extra != {"transport": "tcp"}:  # decode over tcp: every default holds
        cfg["kv_connector_extra_config"] = extra
    return json.dumps(cfg, separators=(",", ":"))


def kustomization(placement: Placement, base: str, overlay_dir: str, *,
                  describe: str = "") -> str:
    """A kustomize overlay (``kustomization.yaml``'s text) of ``base`` (a directory holding a
    kustomization, written relative to ``overlay_dir``, or a remote reference as is) setting the
    replicas of the ``prefill`` and ``decode`` Deployments to ``placement``'s counts.

    Replicas only: each pod keeps the base's model, transport and GPUs (one per pod in
    examples/kubernetes); a header comment says when the plan's TP or PP differs from that.
    """
    if not isinstance(placement, Disaggregated):
        raise ConfigError(f"a kustomize overlay scales prefill and decode Deployments; the plan "
                          f"is {placement.describe()}")
    remote = "://" in base or base.startswith(("github.com/", "git@"))
    if not remote and not any(os.path.isfile(os.path.join(base, name)) for name in
                              ("kustomization.yaml", "kustomization.yml", "Kustomization")):
        raise ConfigError(f"--kustomize-base {base}: no kustomization.yaml there; give the "
                          "directory of your base (examples/kubernetes in a kvdisagg checkout)")
    resource = base if remote else os.path.relpath(base, overlay_dir)
    header = [f"# kvdisagg plan: {describe or placement.describe()}",
              "# Replicas only: model, transport and GPUs per pod are the base's. Apply with",
              f"#   kubectl apply -k {overlay_dir}"]
    sides = (("prefill", placement.prefill_tp, placement.prefill_pp * placement.pp_cross),
             ("decode", placement.decode_tp, placement.decode_pp * placement.pp_cross))
    for side, tp, pp in sides:
        if tp * pp > 1:
            flags = " ".join([*([f"--tensor-parallel-size {tp}"] if tp > 1 else []),
                              *([f"--pipeline-parallel-size {pp}"] if pp > 1 else [])])
            header.append(f"# NOTE: the plan's {side} runs TP{tp}PP{pp} on {tp * pp} GPUs: add "
                          f"{flags} and set nvidia.com/gpu: {tp * pp} in the base's {side} "
                          "Deployment")
    body = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [resource],
            "replicas": [{"name": PREFILL_DEPLOYMENT, "count": placement.num_prefill},
                         {"name": DECODE_DEPLOYMENT, "count": placement.num_decode}]}
    return "\n".join(header) + "\n" + str(yaml.safe_dump(body, sort_keys=False))


def _nodes_needed(sides: list[tuple[str, int, int, int, str | None]], per_node: int) -> int:
    node, used = 0, 0
    for _, tp, pp, count, _ in sides:
        for _ in range(count):
            if used + tp * pp > per_node:
                node, used = node + 1, 0
            used += tp * pp
    return node + 1
