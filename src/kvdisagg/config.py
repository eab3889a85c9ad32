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
    mooncake_device: str = ""
    """RDMA device names for Mooncake (comma-separated, e.g. ``mlx5_0,mlx5_1``); '' = all."""
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
    version this code speaks (protocol.py ``Versions``), so a test can run an instance that
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


def parse_config(extra: dict[str, Any] | None) -> ConnectorConfig:
    """Validate ``kv_connector_extra_config``; raise ConfigError naming the offending key."""
    try:
        return msgspec.convert(extra or {}, ConnectorConfig)
    except (msgspec.ValidationError, ValueError) as exc:
        known = ", ".join(ConnectorConfig.__struct_fields__)
        raise ConfigError(
            f"DisaggConnector: invalid kv_connector_extra_config: {exc} (known keys: {known})"
        ) from None
