"""Typed proxy configuration: one msgspec Struct tree, loaded from YAML/TOML and overlaid by flags.

The config file and the command line describe the same tree, so every key documented in
docs/proxy.md is a field here; unknown keys are refused (``forbid_unknown_fields``) so a typo
fails at start-up instead of silently keeping a default. Bounds are ``Annotated`` metadata, checked
by ``msgspec.convert`` when a file is loaded and by ``validate()`` for structs built in code;
every error names the key (``breaker.open_s: Expected `float` > 0.0, got -1.0``).

The bottom layer of the proxy: every runtime module imports its settings from here, and this
module imports none of them, nor zmq, aiohttp or httptools; only the standard library, msgspec,
yaml and kvdisagg's pure modules (errors, keys, tracing's types, proxy.types, proxy.targets).
tests/unit/test_layering.py holds it to that.
"""

from __future__ import annotations

import enum
import ipaddress
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
import yaml

from kvdisagg.errors import ConfigError
from kvdisagg.keys import ADMIN_KEY_ENV, API_KEY_ENV, key_from, read_key_file
from kvdisagg.proxy.targets import parse_hostport, parse_target
from kvdisagg.proxy.types import Admission, PolicyName, Role
from kvdisagg.tracing import OtlpEndpoint

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]
Count = Annotated[int, msgspec.Meta(ge=1, le=1000)]


class _Base(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    pass


class InstanceSpec(_Base):
    url: str
    """``http://host:port`` of a vLLM OpenAI server."""
    role: Role

    @property
    def key(self) -> str:
        return self.url.rstrip("/")


class HealthConfig(_Base):
    """Active probes plus passive counting; both feed the same hysteresis."""

    interval_s: Seconds = 2.0
    timeout_s: Seconds = 5.0
    """Bound on one probe. A probe refused or answered with an error shows the instance dead:
    the legs waiting on it fail over. One that only times out (a starved host) takes the
    instance out of routing but leaves its legs running."""
    failure_threshold: Count = 2
    """Consecutive failed probes before an instance is unhealthy (its waiting legs fail at the
    first probe that shows it dead, then or later)."""
    success_threshold: Count = 2
    """Consecutive good probes before it is healthy again."""
    startup_timeout_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] = 30.0
    """Start serving after this even if some URLs are down."""
    scrape_metrics: bool = True
    """Read vLLM's /metrics queue gauges with each probe."""


class BreakerConfig(_Base):
    """Circuit breaker per instance, fed by request outcomes (passive).

    Only connection failures and 5xx count: a timeout is load, not breakage. The last
    instances of a side are never taken out by their breakers (they are routed to anyway).
    """

    failure_threshold: Count = 3
    """Consecutive failed legs that open the breaker."""
    open_s: Seconds = 5.0
    """How long it stays open before one trial request (half-open)."""


class RetryConfig(_Base):
    prefill_attempts: Count = 2
    """Total prefill tries, each on a different instance."""
    decode_attempts: Count = 2
    """Total decode tries before the first byte reaches the client."""
    decode_only_fallback: bool = True
    """No usable prefill: let decode recompute the prompt."""
    migrations: Annotated[int, msgspec.Meta(ge=0, le=100)] = 2
    """Mid-stream decode failures one streamed request survives: each moves it to another
    decode (or the same once healthy) with the tokens already delivered (migrate.py); 0: off
    (the stream ends with an error event)."""


class TimeoutConfig(_Base):
    """Bounds that catch a dead or hung instance, never a slow generation: a request queued
    behind others is progress, and vLLM sends a non-streamed answer's headers only when the
    whole generation is done. Liveness between those bounds comes from health probes."""

    prefill_s: Seconds = 300.0
    """Whole prefill leg, queueing included: a generous bound."""
    decode_connect_s: Seconds = 10.0
    """TCP connect to an instance, either leg."""
    decode_total_s: Seconds = 600.0
    """Whole decode phase (retries included): headers, a non-streamed body, a stream's first
    event and the rest of the stream."""
    decode_idle_s: Seconds = 60.0
    """Max silence between two stream chunks once the stream has started."""


class SloConfig(_Base):
    """Targets for slo_aware and for the goodput metrics; goodput counts requests meeting both."""

    ttft_s: Seconds = 1.0
    tpot_s: Seconds = 0.1
    window_s: Seconds = 60.0
    """Sliding window of the live goodput gauges."""
    admission: Admission = Admission.QUEUE


class PolicyConfig(_Base):
    prefill: PolicyName = PolicyName.ROUND_ROBIN
    decode: PolicyName = PolicyName.ROUND_ROBIN
    prefix_block_chars: Annotated[int, msgspec.Meta(ge=1)] = 256
    """prefix_aware: hash the prompt's first N characters."""
    prefix_load_slack: Annotated[int, msgspec.Meta(ge=0)] = 4
    """prefix_aware: stay sticky while in-flight <= least + slack."""
    token_weight: Annotated[float, msgspec.Meta(ge=0)] = 1 / 512
    """least_loaded: 512 in-flight tokens weigh one request."""


class DecisionConfig(_Base):
    """Per request: disaggregate, or let decode compute the prompt itself (decide.py)."""

    enabled: bool = True
    """false (``--always-disaggregate``): every request goes through prefill, whatever its
    length or decode's cache."""
    local_prefill_tokens: Annotated[int, msgspec.Meta(ge=0)] = 512
    """Decode serves a request alone when it would compute at most this many prompt tokens
    itself (the prompt minus its cached prefix); scaled down as decode's predicted TPOT nears
    ``slo.tpot_s``. Measured default: docs/benchmarks.md."""
    early_decode: bool = False
    """A disaggregated request's decode leg goes out together with its prefill leg when the
    prefill is idle (early.py): decode's intake and admission overlap the prefill. Off by
    default: vLLM's engine loop spins while a request waits for its KV, which on hosts where
    prefill and decode share CPU cores costs prefill more than it saves (benchmarks.md)."""
    first_token_from_prefill: bool = True
    """A disaggregated stream's first token is prefill's, sent to the client as soon as
    prefill answers; decode continues after it (first_token.py). TTFT is then prefill's, not
    prefill's plus the handoff. Only for requests whose answer this cannot change (n 1, no
    logprobs, stop strings, seed, penalties on output, structured output; docs/proxy.md)."""
    idle_decode_tokens: Annotated[int, msgspec.Meta(ge=0)] = 4096
    """A decode with no stream to protect (nothing in flight but prompts it computes itself)
    computes a longer prompt too, when every prefill has a queue at least as long (in prompt
    tokens) as decode's own, up to this many prompt tokens in decode's queue: a burst of
    cold prompts uses both instances instead of queueing on prefill. 0: never."""


class KubernetesDiscovery(_Base):
    """Members from the Kubernetes API: ready pods matching a label selector, read with the
    in-cluster service account (token and CA under ``/var/run/secrets/kubernetes.io/``)."""

    prefill_selector: str | None = None
    """Label selector of prefill pods (``app=vllm-prefill``); none: no prefill from the API."""
    decode_selector: str | None = None
    """Label selector of decode pods."""
    port: Port = 8000
    """Port of vLLM's HTTP server in each pod."""
    namespace: str | None = None
    """Namespace of the pods; none: the proxy's own (from the service account)."""
    api_server: str = "https://kubernetes.default.svc"


class DiscoveryConfig(_Base):
    """Fleet members from DNS (a headless Service) and/or the Kubernetes API, re-read every
    ``interval_s``. New members are added and probed (as ``POST /admin/add``); vanished ones
    are drained, then removed. A failed lookup keeps the last good answer; a successful empty
    one drains that name's members. Static ``instances`` are never touched."""

    prefill_dns: list[str] = msgspec.field(default_factory=list)
    """``host:port`` (A/AAAA records: every address, that port) or ``srv:_http._tcp.name``
    (SRV records: each target's host and port)."""
    decode_dns: list[str] = msgspec.field(default_factory=list)
    """Same forms, for decode members."""
    interval_s: Seconds = 5.0
    """Time between two lookups of every name."""
    timeout_s: Seconds = 2.0
    """Bound on one lookup (all its retries); past it the lookup failed."""
    nameservers: list[str] = msgspec.field(default_factory=list)
    """``host:port`` of the DNS servers to ask; empty: the system's (/etc/resolv.conf)."""
    kubernetes: KubernetesDiscovery | None = None

    @property
    def enabled(self) -> bool:
        k = self.kubernetes
        return bool(self.prefill_dns or self.decode_dns
                    or (k is not None and (k.prefill_selector or k.decode_selector)))


_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
_NAME = re.compile(rf"(\*\.)?{_LABEL}(\.{_LABEL})*")  # a host name, or *.suffix


class AdminConfig(_Base):
    """The admin API (admin.py) on a listener of its own, never on the serving port: a client
    that can reach the OpenAI routes cannot reach membership."""

    host: str = "127.0.0.1"
    """Listen address of the admin API. Beyond loopback a key is required: start-up refuses
    otherwise."""
    port: Port | None = None
    """Listen port; none (default): no admin API at all (discovery still manages members)."""
    key_file: str | None = None
    """File holding the admin key (a mounted Kubernetes Secret); else the environment variable
    ``KVDISAGG_ADMIN_KEY``; never the command line (any local user can read argv). With a key,
    every admin call needs ``Authorization: Bearer <key>``."""
    allowed_targets: list[str] = msgspec.field(default_factory=list)
    """What ``POST /admin/add`` may add: CIDRs for IP literals (``10.0.0.0/8``) and host names,
    exact or ``*.suffix`` (``*.vllm.svc.cluster.local``). Members discovery found are allowed
    too. Empty (default): no run-time adds, so the proxy cannot be turned into a probe of
    internal addresses."""

    def key(self) -> str | None:
        """The admin key from ``key_file`` or ``KVDISAGG_ADMIN_KEY``; ConfigError if the file
        is unreadable or empty."""
        return key_from(self.key_file, ADMIN_KEY_ENV, "admin.key_file")

    def allows(self, url: str) -> bool:
        """Whether ``url``'s host is among ``allowed_targets``."""
        host = (urlsplit(url).hostname or "").lower()
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            addr = None
        for entry in self.allowed_targets:
            if "/" in entry or _is_ip(entry):
                if addr is not None and addr in ipaddress.ip_network(entry, strict=False):
                    return True
            elif addr is None:
                entry = entry.lower()
                if host == entry or (entry.startswith("*.") and host.endswith(entry[1:])):
                    return True
        return False


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -- the cache index (cache_index.py) and its tokenizer (tokens.py) ----------------------------

class TokenizerMode(str, enum.Enum):
    LOCAL = "local"
    """The model's tokenizer and chat template in the proxy process."""
    REMOTE = "remote"
    """vLLM's ``POST /tokenize`` on an instance."""


class TokenizerConfig(_Base):
    """How the proxy learns a request's token ids (for cache-hit predictions)."""

    mode: TokenizerMode = TokenizerMode.LOCAL
    model: str | None = None
    """Directory of the served model's tokenizer (what vLLM loads: its ``--tokenizer`` or
    ``--model``). Required for ``local``; none: every lookup asks /tokenize."""
    trust_remote_code: bool = False
    """As vLLM's ``--trust-remote-code``, for tokenizers with custom code."""
    chat_template: str | None = None
    """The instances' ``--chat-template`` (a file or the template itself), if they set one."""
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    """The instances' ``--chat-template-content-format``."""
    default_chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    """The instances' ``--default-chat-template-kwargs``."""
    remote_fallback: bool = True
    """``local``: ask /tokenize for bodies the local path cannot reproduce exactly."""
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 2.0
    """Bound on one /tokenize call (connect, then the answer)."""
    thread_min_chars: Annotated[int, msgspec.Meta(ge=0)] = 4096
    """``local``: bodies with at least this much text to tokenize (not counting what the memo
    holds) are tokenized in a worker thread (the tokenizer releases the GIL), so a long prompt
    does not hold the proxy's event loop; shorter ones inline (the hop would cost more than it
    frees)."""
    memo_tokens: Annotated[int, msgspec.Meta(ge=0)] = 262144
    """``local``: token ids of the text between special tokens (a chat's system prompt, its
    earlier messages) kept for the next request, so turn N of a conversation tokenizes only
    its new messages (token_memo.py; exact, used only for tokenizers where it is). 0: off."""


class EventSource(_Base):
    """Where the proxy subscribes to one instance's events (``cache_index.sources``, or
    found by asking the instance: kv_events.source_from_publisher)."""

    endpoint: str
    """ZMQ address to connect to, ``tcp://host:port`` (or ``ipc://path``)."""
    replay_endpoint: str | None = None
    """vLLM's replay ROUTER, same forms; none: a gap drops the instance's entries."""
    topic: str = ""
    """vLLM's ``topic`` (the first frame of every message)."""


class CacheIndexConfig(_Base):
    """The cache index (``cache_index:`` in the proxy's config)."""

    enabled: bool = True
    """Follow each instance's KV events (instances without them are left out, said once in
    the log); false (``--no-cache-index``): no index, the decision counts whole prompts."""
    connect_timeout_s: Seconds = 5.0
    """Bound on ``GET /kv_event_sources`` and on the publisher's ZMQ handshake."""
    replay_timeout_s: Seconds = 5.0
    """Longest silence between two frames of a replay; past it the replay failed and the
    instance's entries are dropped (a long replay that keeps coming is fine)."""
    retry_s: Seconds = 10.0
    """Longest wait before asking again an instance that did not answer ``/kv_event_sources``
    (not up yet): the first retry comes after 0.5 s, each next one after twice as long."""
    max_blocks_per_instance: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)] = 262_144
    """Bound on one instance's indexed block copies (about 150 bytes each); more than its cache
    can hold means the view went wrong: its entries are dropped."""
    max_message_bytes: Annotated[int, msgspec.Meta(ge=1 << 10, le=1 << 31)] = 64 << 20
    """Larger ZMQ messages are refused (ZMQ closes the connection; counted as lost)."""
    sources: dict[str, EventSource] = msgspec.field(default_factory=dict)
    """Per instance URL (``http://host:port``): where its events are, instead of asking it
    (e.g. behind a NAT, or an older vLLM without /kv_event_sources)."""
    tokenizer: TokenizerConfig = msgspec.field(default_factory=TokenizerConfig)
    """How request bodies become token ids (tokens.py)."""


class ProxyConfig(_Base):
    host: str = "127.0.0.1"
    port: Port = 8000
    instances: list[InstanceSpec] = msgspec.field(default_factory=list)
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    breaker: BreakerConfig = msgspec.field(default_factory=BreakerConfig)
    retry: RetryConfig = msgspec.field(default_factory=RetryConfig)
    timeouts: TimeoutConfig = msgspec.field(default_factory=TimeoutConfig)
    slo: SloConfig = msgspec.field(default_factory=SloConfig)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    discovery: DiscoveryConfig = msgspec.field(default_factory=DiscoveryConfig)
    decision: DecisionConfig = msgspec.field(default_factory=DecisionConfig)
    cache_index: CacheIndexConfig = msgspec.field(default_factory=CacheIndexConfig)
    """What each instance's prefix cache holds, from vLLM's KV events (cache_index.py)."""
    api_key: str | None = None
    """Replaces the client's Authorization on upstream legs (``Bearer <key>``; vLLM's
    ``--api-key``). Prefer ``api_key_file`` or ``KVDISAGG_API_KEY``: a config file (a ConfigMap)
    is often readable more widely than a secret. Never the command line."""
    api_key_file: str | None = None
    """File holding ``api_key`` (a mounted Kubernetes Secret). With neither this nor
    ``api_key``, the environment variable ``KVDISAGG_API_KEY`` is read. Resolved by
    ``validate()``, which puts the key in ``api_key``."""
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] = 30.0
    """Shutdown and admin drain wait at most this long."""
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1)] = 32 << 20
    """Larger client bodies get 413."""
    max_in_flight: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Client requests served at once; more get 503 with Retry-After. 0: no bound (each vLLM
    instance queues what it cannot run yet, as a single instance would)."""
    otlp_traces_endpoint: OtlpEndpoint = ""
    """OTLP/HTTP collector (``http://host:4318``) for each request's spans, joined by the
    instances' (their connector's ``otlp_traces_endpoint``); '' (default): no spans."""

    def validate(self) -> ProxyConfig:
        """The checked config (bounds, types, URLs, policy names); the message names the key.

        Structs built in code skip msgspec's checks, so they are converted once here.
        """
        cfg = _convert(msgspec.to_builtins(self), "")
        seen: set[str] = set()
        for inst in cfg.instances:
            if not inst.url.startswith("http://"):
                raise ConfigError(f"instance url {inst.url!r} must start with http:// "
                                  "(upstream legs are plain HTTP inside the cluster)")
            if inst.key in seen:
                raise ConfigError(f"instance {inst.key} is listed twice")
            seen.add(inst.key)
        d = cfg.discovery
        for key, items, parse in (("prefill_dns", d.prefill_dns, parse_target),
                                  ("decode_dns", d.decode_dns, parse_target),
                                  ("nameservers", d.nameservers, parse_hostport)):
            for i, item in enumerate(items):
                try:
                    parse(item)
                except ValueError as exc:
                    raise ConfigError(f"discovery.{key}[{i}]: {exc}") from None

        _check_admin(cfg.admin, cfg.port)
        return _with_api_key(cfg)


def _with_api_key(cfg: ProxyConfig) -> ProxyConfig:
    """``cfg`` with ``api_key`` read from ``api_key_file``, else from ``KVDISAGG_API_KEY`` when
    the config gives no key; the same answer when run again on its own result."""
    if cfg.api_key_file:
        key = read_key_file(cfg.api_key_file, "api_key_file")
        if cfg.api_key is not None and cfg.api_key != key:
            raise ConfigError("api_key and api_key_file are both set, to different keys: keep "
                              "api_key_file (a config file is no place for a key)")
        return msgspec.structs.replace(cfg, api_key=key)
    if cfg.api_key is None and (key := os.environ.get(API_KEY_ENV, "").strip()):
        return msgspec.structs.replace(cfg, api_key=key)
    return cfg


def _check_admin(admin: AdminConfig, serving_port: int) -> None:
    for i, entry in enumerate(admin.allowed_targets):
        if "/" in entry or _is_ip(entry):
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError as exc:
                raise ConfigError(f"admin.allowed_targets[{i}]: {exc}") from None
        elif not _NAME.fullmatch(entry):
            raise ConfigError(f"admin.allowed_targets[{i}]: {entry!r} is neither a CIDR nor a "
                              "host name (exact, or *.suffix)")
    if admin.port is None:
        return
    if admin.port == serving_port:
        raise ConfigError(f"admin.port {admin.port} is the serving port: the admin API needs a "
                          "listener of its own")
    if not is_loopback(admin.host) and admin.key() is None:
        raise ConfigError(f"admin.host {admin.host} is beyond loopback and no admin key is set: "
                          f"put one in a file (admin.key_file, --admin-key-file) or in "
                          f"{ADMIN_KEY_ENV}")


_AT = re.compile(r" - at `\$\.?([^`]*)`$")


def _convert(raw: Any, where: str) -> ProxyConfig:
    """msgspec's check, its error rewritten as ``key: what was expected, got value``."""
    try:
        return msgspec.convert(raw, ProxyConfig)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        m = _AT.search(msg)
        if m is None:
            raise ConfigError(f"{where}{msg}") from None
        key, value = m.group(1), raw
        for part in re.findall(r"\w+|\[\d+\]", key):
            try:
                value = value[int(part[1:-1])] if part.startswith("[") else value[part]
            except (KeyError, IndexError, TypeError, ValueError):
                value = None
                break
        shown = isinstance(value, (int, float)) or (isinstance(value, str)
                                                      and repr(value) not in msg)
        got = f", got {value!r}" if shown else ""
        choices = _enum_choices(key)
        raise ConfigError(f"{where}{key or '(top level)'}: {msg[:m.start()]}{got}"
                          f"{choices}") from None


def _enum_choices(key: str) -> str:
    """'; choose one of [...]' when ``key`` (``policy.prefill``) names an enum field."""
    typ: Any = ProxyConfig
    for part in re.findall(r"\w+", key):
        fields = {f.name: f.type for f in msgspec.structs.fields(typ)} \
            if isinstance(typ, type) and issubclass(typ, msgspec.Struct) else {}
        if part not in fields:
            return ""
        typ = fields[part]
    if isinstance(typ, type) and issubclass(typ, enum.Enum):
        return f"; choose one of {sorted(m.value for m in typ)}"
    return ""


def load_config_file(path: str | Path) -> ProxyConfig:
    """Read a ``.yaml``/``.yml`` or ``.toml`` file into a ProxyConfig.

    Bounds are checked here; ``validate()`` adds the URL, discovery and admin checks.
    """
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
    return _convert(raw, f"proxy config {path}: ")
