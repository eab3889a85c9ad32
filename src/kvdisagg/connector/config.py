"""Typed connector settings, parsed once from ``kv_connector_extra_config``.

Every bad value stops start-up with a message that names the key; an unknown key is refused,
so a typo never silently falls back to a default.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from kvdisagg.errors import ConfigError
from kvdisagg.tracing import OtlpEndpoint

LMCACHE_URL = re.compile(r"lm://(?P<host>[\w.\-]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})")
DEVICES = re.compile(r"(?:[\w.\-]+(?:,[\w.\-]+)*)?")
"""``mooncake_device``: '' or RDMA device names (``mlx5_0``, ``rocep1s0f0``), comma-separated."""
MOONCAKE_PORTS_PER_RANK = 2
"""Ports a Mooncake engine listens on: its RPC/handshake port, and over TCP its data port."""
MOONCAKE_MIN_PORT, MOONCAKE_MAX_PORT = 1024, 32767
"""The port bounds Mooncake (0.3.13) accepts: it ignores ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``
outside them (a warning, then its default 15000-17000); its TCP listener takes a C ``short``."""
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]


class ConnectorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of DisaggConnector (the ``kv_connector_extra_config`` dict)."""

    transport: str = "tcp"
    """``tcp``, ``nccl``, ``mooncake``, ``lmcache``, or ``module:Class`` of a custom Transport."""
    side_channel_host: str = "127.0.0.1"
    """Address the prefill worker listens on and advertises in kv_transfer_params."""
    side_channel_port: Port = 0
    """Port of TP rank 0 (rank r listens on port + r); 0 picks free ports and advertises them."""
    nccl_store_port: Port = 0
    """``transport: nccl``, prefill: the TCPStore that each decode worker's process group
    meets at, on ``side_channel_host``: port of rank 0 (rank r listens on port + r); 0 picks
    a free port (it travels in the Hello reply)."""
    lease_seconds: PositiveSeconds = 30.0
    """Prefill frees an unread handoff this long after it finished or after the last renewal
    from the decode that holds it (decode renews every third of it while the request waits in
    its queue, however long): the lease only runs out when that decode died or dropped it."""
    transfer_timeout_seconds: PositiveSeconds = 30.0
    """Bound on connecting to prefill and on one pull once started; past it the load fails."""
    staging_blocks: Annotated[int, msgspec.Meta(ge=-1, le=1 << 24)] = -1
    """Prefill: blocks of a host arena that a finished handoff's KV is copied into, so vLLM
    frees its paged blocks at once and the engine idles while decode has not pulled yet.
    -1 (auto): half the KV cache's blocks when the KV cache is in host memory (CPU), 0 on
    GPUs; 0: never stage (handoffs hold their paged blocks until pulled)."""
    kv_checksum: bool = True
    """Verify every KV transfer with a checksum before vLLM uses the blocks (integrity.py): a
    mismatch fails the load (``kv_load_failure_policy`` applies) and counts in
    ``vllm:kvdisagg_checksum_failures_total``. Pull transports: decode's setting decides (it
    asks prefill for the checksum in each Read). lmcache: the writer's setting decides whether a
    chunk carries one, the reader's whether it is checked."""
    mooncake_protocol: Literal["auto", "tcp", "rdma"] = "auto"
    """Mooncake's protocol; ``auto`` is ``rdma`` when RDMA devices exist, else ``tcp``."""
    mooncake_device: str | tuple[str, ...] = ""
    """RDMA devices (HCAs) Mooncake may use, comma-separated (``mlx5_0,mlx5_1``); '' = every
    device, Mooncake picking the nearest to each buffer. A list: one entry per worker of the
    instance, indexed by its rank (PP-major, as ``side_channel_port``), e.g. the HCA next to
    each rank's GPU. With ``rdma``, a named device missing from /sys/class/infiniband stops
    start-up (Mooncake would fall back to TCP silently)."""
    mooncake_port: Annotated[int, msgspec.Meta(ge=0, le=MOONCAKE_MAX_PORT - 1)] = 0
    """Both sides' Mooncake engines: the first of rank 0's MOONCAKE_PORTS_PER_RANK (2) ports;
    rank r's engine listens within port + 2r .. port + 2r + 1 (its RPC/handshake port, and
    its data port over TCP). 0: Mooncake's choice, random within ``MC_MIN_RPC_PORT`` ..
    ``MC_MAX_RPC_PORT`` (15000-17000 unless set in the environment). Mooncake takes ports
    1024-32767 only (outside, it ignores the bounds)."""
    mooncake_metadata_server: str = "P2PHANDSHAKE"
    """Mooncake metadata service; ``P2PHANDSHAKE`` needs none (peers exchange it directly)."""
    lmcache_url: str = ""
    """LMCache server for ``transport: lmcache``, ``lm://host:port``."""
    lmcache_chunk_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 256
    """Tokens per stored chunk (a multiple of vLLM's block size); keys hash the token prefix."""
    lmcache_store_decoded: bool = True
    """``transport: lmcache`` on a decode instance: store each finished request's KV (prompt
    and answer, whole chunks) too, so the next turn's prefill, on any instance, loads it from
    the store instead of computing it."""
    otlp_traces_endpoint: OtlpEndpoint = ""
    """OTLP/HTTP collector (``http://host:4318``) for the handoff's spans (tracing.py); ''
    (default): no spans. Needs ``kvdisagg[tracing]``."""

    protocol_version_override: Annotated[int, msgspec.Meta(ge=1, le=1000)] | None = None
    """TEST ONLY: speak (and announce) this one side-channel protocol version instead of every
    version this code speaks (protocol/versions.py ``Versions``), so a test can run an instance that
    looks like another release: prefill's kv_transfer_params, the Hello decode sends, the
    versions prefill accepts and the ``vllm:kvdisagg_protocol_version*`` gauges all say it.
    The bytes stay this release's; never set it in production."""

    scheduler: dict[str, Any] = msgspec.field(default_factory=dict)
    """Settings of the scheduler plugin ``kvdisagg.slo_scheduler.SloScheduler`` when vLLM runs it
    (``--scheduler-cls``); validated there (docs/scheduler.md)."""

    def __post_init__(self) -> None:
        if self.transport == "lmcache" and not LMCACHE_URL.fullmatch(self.lmcache_url):
            raise ValueError(f"lmcache_url={self.lmcache_url!r}: transport lmcache needs "
                             "'lm://host:port'")
        devices = self.mooncake_device
        if isinstance(devices, tuple) and not devices:
            raise ValueError("mooncake_device=[]: list one entry per rank, or give a string")
        for entry in devices if isinstance(devices, tuple) else [devices]:
            if not DEVICES.fullmatch(entry):
                raise ValueError(f"mooncake_device={_json(devices)}: {entry!r} is not a "
                                 "comma-separated list of RDMA device names (e.g. 'mlx5_0')")
        if 0 < self.mooncake_port < MOONCAKE_MIN_PORT:
            raise ValueError(f"mooncake_port={self.mooncake_port}: Mooncake takes ports "
                             f"{MOONCAKE_MIN_PORT}-{MOONCAKE_MAX_PORT} (or 0: its own choice)")
        ports = {"nccl": ("nccl_store_port", self.nccl_store_port, 1),
                 "mooncake": ("mooncake_port", self.mooncake_port, MOONCAKE_PORTS_PER_RANK)}
        if self.transport in ports and self.side_channel_port:
            key, base, count = ports[self.transport]
            if base <= self.side_channel_port < base + count:
                raise ValueError(f"{key}={base} and side_channel_port={self.side_channel_port}"
                                 " overlap: rank 0 would listen twice on one port")

    def mooncake_device_of(self, rank: int) -> str:
        """The RDMA devices of the worker of ``rank`` (its entry when ``mooncake_device`` is a
        list; ConfigError when the list has none for it)."""
        devices = self.mooncake_device
        if isinstance(devices, str):
            return devices
        if rank >= len(devices):
            raise ConfigError(f"mooncake_device lists {len(devices)} entries but this worker "
                              f"is rank {rank}: list one per rank of the instance (TP x PP)")
        return devices[rank]


def _json(value: object) -> str:
    return msgspec.json.encode(value).decode()


def rank_port(key: str, base: int, rank: int, per_rank: int = 1, last: int = 65535) -> int:
    """The first port of ``rank`` when rank 0's is ``base`` (``key``'s value) and each rank
    has ``per_rank`` of them; 0 stays 0 (a free port). ConfigError past port ``last``.

    >>> rank_port("nccl_store_port", 7200, 3), rank_port("mooncake_port", 7300, 3, 2)
    (7203, 7306)
    """
    if not base:
        return 0
    first = base + per_rank * rank
    if first + per_rank - 1 > last:
        raise ConfigError(f"{key}={base}: rank {rank}'s port {first + per_rank - 1} is past "
                          f"{last}; choose a lower base")
    return first


def parse_config(extra: dict[str, Any] | None) -> ConnectorConfig:
    """Validate ``kv_connector_extra_config``; raise ConfigError naming the offending key."""
    try:
        return msgspec.convert(extra or {}, ConnectorConfig)
    except (msgspec.ValidationError, ValueError) as exc:
        known = ", ".join(ConnectorConfig.__struct_fields__)
        raise ConfigError(
            f"DisaggConnector: invalid kv_connector_extra_config: {exc} (known keys: {known})"
        ) from None
