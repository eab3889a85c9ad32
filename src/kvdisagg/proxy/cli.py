"""``kvdisagg proxy``: command-line entry of the proxy.

Membership comes from ``--prefill/--decode/--both`` URLs, ``--prefill-dns/--decode-dns`` names
(discovery.py) and/or ``--config FILE`` (YAML or
TOML, the ``ProxyConfig`` tree of docs/proxy.md); flags given on the command line override the
file's values.

Every flag is one row of ``FLAGS``: the config keys it sets, or what it does instead, and its
help. Its type (and, where asked, its choices) come from the key's field in ``ProxyConfig``, and
``config_from_args`` applies the rows in order over the file, so a flag cannot drift from its
key. Bounds are not checked here: ``validate()`` checks the result as it checks a file, and its
error names the key (``health.interval_s: ...``).
"""

from __future__ import annotations

import argparse
import enum
import types
import typing
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from kvdisagg.keys import ADMIN_KEY_ENV, API_KEY_ENV, refused_on_command_line
from kvdisagg.proxy.config import InstanceSpec, ProxyConfig, TimeoutConfig, load_config_file
from kvdisagg.proxy.types import PolicyName, Role

Apply = Callable[[ProxyConfig, Any], ProxyConfig]


class Flag(NamedTuple):
    """One flag of ``kvdisagg proxy``.

    ``keys``: the config keys (``policy.prefill``) it sets to its value, or extends with its
    values when ``many`` (``"append"``: repeatable; ``"+"``: one or more after the flag).
    ``switch``: a flag without a value, setting the keys to this. ``apply``: what it does
    instead of setting keys (given the config so far and the value). A flag with neither is
    read by ``config_from_args`` itself (``--config``).
    """

    name: str
    keys: tuple[str, ...] = ()
    help: str | None = None
    metavar: str | None = None
    switch: Any = None
    many: str | None = None
    choices: bool = False
    """Refuse values outside the key's enum at parse time (else ``validate()`` names them)."""
    apply: Apply | None = None
    type: Callable[[str], Any] | None = None
    """The value's type where no key gives it (``apply``)."""


def _refuse(flag: str, file_flag: str, env: str) -> Apply:
    def refuse(cfg: ProxyConfig, value: Any) -> ProxyConfig:
        raise refused_on_command_line(flag, file_flag, env)
    return refuse


def _members(role: Role) -> Apply:
    def add(cfg: ProxyConfig, urls: list[str]) -> ProxyConfig:
        extra = [InstanceSpec(url=u, role=role) for u in urls]
        return msgspec.structs.replace(cfg, instances=[*cfg.instances, *extra])
    return add


def _timeout(cfg: ProxyConfig, timeout_s: float) -> ProxyConfig:
    """One bound for the prefill leg and a stream's silence (the connect and the decode phase
    follow it: at most 10 s, at least the configured whole)."""
    return msgspec.structs.replace(cfg, timeouts=TimeoutConfig(
        prefill_s=timeout_s, decode_connect_s=min(10.0, timeout_s),
        decode_total_s=max(timeout_s, cfg.timeouts.decode_total_s), decode_idle_s=timeout_s))


_POLICIES = ", ".join(p.value for p in PolicyName)

FLAGS: tuple[Flag, ...] = (
    # Keys never come from argv (any local user can read it): refused first, before any other
    # flag is applied, with where the key goes instead.
    Flag("--admin-key", help=argparse.SUPPRESS,
         apply=_refuse("--admin-key", "--admin-key-file", ADMIN_KEY_ENV)),
    Flag("--api-key", help=argparse.SUPPRESS,
         apply=_refuse("--api-key", "--api-key-file", API_KEY_ENV)),
    Flag("--config", metavar="FILE", help="proxy config, .yaml/.yml or .toml"),
    Flag("--prefill", many="+", metavar="URL", apply=_members(Role.PREFILL)),
    Flag("--decode", many="+", metavar="URL", apply=_members(Role.DECODE)),
    Flag("--both", many="+", metavar="URL", apply=_members(Role.BOTH),
         help="kv_both instances, usable for either side"),
    Flag("--prefill-dns", ("discovery.prefill_dns",), many="append", metavar="NAME:PORT",
         help="discover prefill members: A/AAAA records of NAME with PORT, or "
         "srv:_http._tcp.NAME for SRV records (repeatable)"),
    Flag("--decode-dns", ("discovery.decode_dns",), many="append", metavar="NAME:PORT",
         help="discover decode members, same forms (repeatable)"),
    Flag("--host", ("host",), help="listen address (default 127.0.0.1)"),
    Flag("--port", ("port",), help="listen port (default 8000)"),
    Flag("--timeout", apply=_timeout, type=float,
         help="bound on the prefill leg and on mid-stream decode silence, seconds "
         "(defaults 300 and 60)"),
    Flag("--policy", ("policy.prefill", "policy.decode"),
         help=f"policy for both sides ({_POLICIES})"),
    Flag("--prefill-policy", ("policy.prefill",)),  # after --policy: it wins
    Flag("--decode-policy", ("policy.decode",)),
    Flag("--slo-ttft", ("slo.ttft_s",), metavar="S", help="TTFT SLO, seconds"),
    Flag("--slo-tpot", ("slo.tpot_s",), metavar="S", help="TPOT SLO, seconds"),
    Flag("--admission", ("slo.admission",), choices=True,
         help="slo_aware: what to do when no instance meets the SLO"),
    Flag("--api-key-file", ("api_key_file",), metavar="FILE",
         help="file holding the key sent to vLLM as Authorization: Bearer KEY on "
         "upstream legs, replacing the client's (or set KVDISAGG_API_KEY)"),
    Flag("--admin-port", ("admin.port",), metavar="PORT",
         help="serve the admin API on its own listener (default: no admin API)"),
    Flag("--admin-host", ("admin.host",), metavar="ADDR",
         help="admin listener address (default 127.0.0.1; beyond loopback a key is "
         "required)"),
    Flag("--admin-key-file", ("admin.key_file",), metavar="FILE",
         help="file holding the admin key (or set KVDISAGG_ADMIN_KEY); every admin "
         "call then needs Authorization: Bearer KEY"),
    Flag("--admin-allow", ("admin.allowed_targets",), many="append", metavar="CIDR|NAME",
         help="a target /admin/add may add: a CIDR or a host name (exact or "
         "*.suffix); repeatable"),
    Flag("--always-disaggregate", ("decision.enabled",), switch=False,
         help="send every request through prefill (no per-request decision)"),
    Flag("--local-prefill-tokens", ("decision.local_prefill_tokens",), metavar="N",
         help="decode serves a request alone when it would compute at most N "
         "prompt tokens itself (default 512)"),
    Flag("--early-decode", ("decision.early_decode",), switch=True,
         help="send a disaggregated request's decode leg together with its prefill "
         "leg when the prefill is idle (decision.early_decode; docs/proxy.md)"),
    Flag("--no-first-token-from-prefill", ("decision.first_token_from_prefill",), switch=False,
         help="a disaggregated stream's first token comes from decode, after the "
         "handoff (decision.first_token_from_prefill false; docs/proxy.md)"),
    Flag("--tokenizer", ("cache_index.tokenizer.model",), metavar="DIR",
         help="the served model's tokenizer (a model directory): request token ids "
         "are worked out in the proxy for cache-hit predictions (else vLLM's "
         "/tokenize is asked)"),
    Flag("--no-cache-index", ("cache_index.enabled",), switch=False,
         help="do not follow the instances' KV cache events"),
    Flag("--no-decode-only-fallback", ("retry.decode_only_fallback",), switch=False,
         help="fail instead of letting decode recompute when no prefill is usable"),
    Flag("--health-interval", ("health.interval_s",), metavar="S"),
    Flag("--otlp-traces-endpoint", ("otlp_traces_endpoint",), metavar="URL",
         help="OTLP/HTTP collector for request spans, e.g. http://127.0.0.1:4318"),
)


def _field_type(key: str) -> Any:
    """The type of config key ``key`` (``slo.admission``), without ``| None``, its bounds
    (``Annotated``) or its list: what one value on the command line is."""
    typ: Any = ProxyConfig
    for part in key.split("."):
        typ = {f.name: f.type for f in msgspec.structs.fields(typ)}[part]
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if typing.get_origin(typ) in (typing.Union, types.UnionType) and len(args) == 1:
            typ = args[0]
        if typing.get_origin(typ) is typing.Annotated:
            typ = typing.get_args(typ)[0]
    if typing.get_origin(typ) is list:
        typ = typing.get_args(typ)[0]
    return typ


def add_arguments(p: argparse.ArgumentParser) -> None:
    for f in FLAGS:
        kw: dict[str, Any] = {"help": f.help}
        if f.metavar:
            kw["metavar"] = f.metavar
        if f.switch is not None:
            p.add_argument(f.name, action="store_true", **kw)
            continue
        if f.many == "append":
            kw.update(action="append", default=[])
        elif f.many:
            kw.update(nargs=f.many, default=[])
        typ = f.type or (_field_type(f.keys[0]) if f.keys else str)
        if isinstance(typ, type) and issubclass(typ, enum.Enum):
            if f.choices:
                kw["choices"] = [m.value for m in typ]
        elif typ in (int, float):
            kw["type"] = typ
        p.add_argument(f.name, **kw)


def _set(cfg: Any, key: str, value: Any, extend: bool) -> Any:
    """``cfg`` with ``value`` at ``key`` (``a.b.c``), or appended to the list there."""
    head, _, rest = key.partition(".")
    old = getattr(cfg, head)
    new = _set(old, rest, value, extend) if rest else [*old, *value] if extend else value
    return msgspec.structs.replace(cfg, **{head: new})


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """The validated config: ``--config``'s file (or the defaults), then each flag given, in
    ``FLAGS`` order."""
    cfg = load_config_file(args.config) if args.config else ProxyConfig()
    for f in FLAGS:
        value = getattr(args, f.name[2:].replace("-", "_"))
        if value is None or value is False or value == []:
            continue  # not given
        if f.apply is not None:
            cfg = f.apply(cfg, value)
            continue
        for key in f.keys:
            cfg = _set(cfg, key, value if f.switch is None else f.switch, bool(f.many))
    return cfg.validate()  # the enums' strings converted, bounds checked


def run(args: argparse.Namespace) -> int:
    from kvdisagg.errors import ConfigError
    from kvdisagg.proxy.app import serve_until_signalled

    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        raise SystemExit(f"kvdisagg proxy: {exc}") from None
    if not cfg.instances and not cfg.discovery.enabled:
        raise SystemExit("kvdisagg proxy: no instances; give --prefill/--decode URLs, "
                         "--prefill-dns/--decode-dns names or --config")
    return serve_until_signalled(cfg)
