"""Typed proxy configuration: one msgspec Struct tree, loaded from YAML/TOML and overlaid by flags.

The config file and the command line describe the same tree, so every key documented in
docs/proxy.md is a field here; unknown keys are refused (``forbid_unknown_fields``) so a typo
fails at start-up instead of silently keeping a default.
"""

from __future__ import annotations

import enum
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import yaml

from kvdisagg.errors import ConfigError


class Role(str, enum.Enum):
    """Which side an instance serves; ``kv_both`` may be picked for either."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "kv_both"

    def serves(self, side: "Role") -> bool:
        return self is side or self is Role.BOTH


class Admission(str, enum.Enum):
    """What slo_aware does when no instance is predicted to meet the SLO."""

    QUEUE = "queue"  # take the best instance anyway (the request waits in its queue)
    SHED = "shed"  # answer 429 at once
    COLOCATE = "colocate"  # skip prefill, run the whole request on a decode instance


class _Base(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class InstanceSpec(_Base):
    url: str
    role: Role

    @property
    def key(self) -> str:
        return self.url.rstrip("/")


class HealthConfig(_Base):
    """Active probes plus passive counting; both feed the same hysteresis."""

    interval_s: float = 2.0
    timeout_s: float = 2.0
    failure_threshold: int = 2  # consecutive failures before an instance is unhealthy
    success_threshold: int = 2  # consecutive successes before it is healthy again
    startup_timeout_s: float = 30.0  # start serving after this even if some URLs are down
    scrape_metrics: bool = True  # read vLLM's /metrics queue gauges with each probe


class BreakerConfig(_Base):
    """Circuit breaker per instance, fed by request outcomes (passive)."""

    failure_threshold: int = 3  # consecutive request failures that open the breaker
    open_s: float = 5.0  # how long it stays open before one trial request (half-open)


class RetryConfig(_Base):
    prefill_attempts: int = 2  # total prefill tries, each on a different instance
    decode_attempts: int = 2  # total decode tries before the first byte
    decode_only_fallback: bool = True  # no healthy prefill -> let decode recompute the prompt


class TimeoutConfig(_Base):
    prefill_s: float = 60.0  # whole prefill leg
    decode_connect_s: float = 10.0  # until decode's response headers
    decode_total_s: float = 600.0  # whole decode leg, stream included
    decode_idle_s: float = 60.0  # max silence between two stream chunks


class SloConfig(_Base):
    """Targets for slo_aware and for the goodput metrics; goodput counts requests meeting both."""

    ttft_s: float = 1.0
    tpot_s: float = 0.1
    window_s: float = 60.0  # sliding window of the live goodput gauges
    admission: Admission = Admission.QUEUE


class PolicyConfig(_Base):
    prefill: str = "round_robin"
    decode: str = "round_robin"
    prefix_block_chars: int = 256  # prefix_aware: hash the prompt's first N characters
    prefix_load_slack: int = 4  # prefix_aware: stay sticky while in-flight <= least + slack
    token_weight: float = 1 / 512  # least_loaded: 512 in-flight tokens weigh one request


class ProxyConfig(_Base):
    host: str = "127.0.0.1"
    port: int = 8000
    instances: list[InstanceSpec] = msgspec.field(default_factory=list)
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    breaker: BreakerConfig = msgspec.field(default_factory=BreakerConfig)
    retry: RetryConfig = msgspec.field(default_factory=RetryConfig)
    timeouts: TimeoutConfig = msgspec.field(default_factory=TimeoutConfig)
    slo: SloConfig = msgspec.field(default_factory=SloConfig)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    api_key: str | None = None  # replaces the client's Authorization on upstream legs
    admin_key: str | None = None  # required as Bearer on /admin/* when set
    drain_timeout_s: float = 30.0  # shutdown and admin drain wait at most this long
    max_body_bytes: int = 32 << 20  # larger client bodies get 413

    def validate(self) -> "ProxyConfig":
        """Check what types cannot; the message says which key and what to do."""
        for name, value in (("health.interval_s", self.health.interval_s),
                            ("health.timeout_s", self.health.timeout_s),
                            ("timeouts.prefill_s", self.timeouts.prefill_s),
                            ("timeouts.decode_connect_s", self.timeouts.decode_connect_s),
                            ("timeouts.decode_total_s", self.timeouts.decode_total_s),
                            ("timeouts.decode_idle_s", self.timeouts.decode_idle_s),
                            ("slo.ttft_s", self.slo.ttft_s), ("slo.tpot_s", self.slo.tpot_s),
                            ("slo.window_s", self.slo.window_s)):
            if not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        for name, value in (("health.failure_threshold", self.health.failure_threshold),
                            ("health.success_threshold", self.health.success_threshold),
                            ("breaker.failure_threshold", self.breaker.failure_threshold),
                            ("retry.prefill_attempts", self.retry.prefill_attempts),
                            ("retry.decode_attempts", self.retry.decode_attempts),
                            ("max_body_bytes", self.max_body_bytes)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1 (1 disables retries), got {value}")
        seen: set[str] = set()
        for inst in self.instances:
            if not inst.url.startswith("http://"):
                raise ConfigError(f"instance url {inst.url!r} must start with http:// "
                                  "(upstream legs are plain HTTP inside the cluster)")
            key = inst.url.rstrip("/")
            if key in seen:
                raise ConfigError(f"instance {key} is listed twice")
            seen.add(key)
        from kvdisagg.proxy.policies import POLICIES

        for side, name in (("prefill", self.policy.prefill), ("decode", self.policy.decode)):
            if name not in POLICIES:
                raise ConfigError(f"policy.{side}: unknown policy {name!r}; "
                                  f"choose one of {sorted(POLICIES)}")
        return self


def load_config_file(path: str | Path) -> ProxyConfig:
    """Read a ``.yaml``/``.yml`` or ``.toml`` file into a ProxyConfig (not yet validated)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read proxy config {path}: {exc}") from exc
    try:
        if path.suffix in (".yaml", ".yml"):
            raw: Any = yaml.safe_load(text) or {}
        elif path.suffix == ".toml":
            raw = tomllib.loads(text)
        else:
            raise ConfigError(f"proxy config {path}: use a .yaml, .yml or .toml file")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"proxy config {path} is not valid: {exc}") from exc
    try:
        return msgspec.convert(raw, ProxyConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"proxy config {path}: {exc}") from exc


def instances_from_urls(prefill: list[str] | None, decode: list[str] | None,
                        both: list[str] | None = None) -> list[InstanceSpec]:
    """Command-line URLs as instance specs, in the order given."""
    out = [InstanceSpec(url=u, role=Role.PREFILL) for u in prefill or []]
    out += [InstanceSpec(url=u, role=Role.DECODE) for u in decode or []]
    out += [InstanceSpec(url=u, role=Role.BOTH) for u in both or []]
    return out
