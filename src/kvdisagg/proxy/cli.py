"""``kvdisagg proxy``: command-line entry of the proxy.

Membership comes from ``--prefill/--decode/--both`` URLs, ``--prefill-dns/--decode-dns`` names
(discovery.py) and/or ``--config FILE`` (YAML or
TOML, the ``ProxyConfig`` tree of docs/proxy.md); flags given on the command line override the
file's values.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="proxy config, .yaml/.yml or .toml")
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL")
    p.add_argument("--both", nargs="+", default=[], metavar="URL",
                   help="kv_both instances, usable for either side")
    p.add_argument("--prefill-dns", action="append", default=[], metavar="NAME:PORT",
                   help="discover prefill members: A/AAAA records of NAME with PORT, or "
                   "srv:_http._tcp.NAME for SRV records (repeatable)")
    p.add_argument("--decode-dns", action="append", default=[], metavar="NAME:PORT",
                   help="discover decode members, same forms (repeatable)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument("--timeout", type=float,
                   help="bound on the prefill leg and on mid-stream decode silence, seconds "
                   "(defaults 300 and 60)")
    p.add_argument("--policy", help="policy for both sides (round_robin, least_loaded, "
                   "prefix_aware, slo_aware)")
    p.add_argument("--prefill-policy")
    p.add_argument("--decode-policy")
    p.add_argument("--slo-ttft", type=float, metavar="S", help="TTFT SLO, seconds")
    p.add_argument("--slo-tpot", type=float, metavar="S", help="TPOT SLO, seconds")
    p.add_argument("--admission", choices=["queue", "shed", "colocate"],
                   help="slo_aware: what to do when no instance meets the SLO")
    p.add_argument("--api-key-file", metavar="FILE",
                   help="file holding the key sent to vLLM as Authorization: Bearer KEY on "
                   "upstream legs, replacing the client's (or set KVDISAGG_API_KEY)")
    p.add_argument("--api-key", help=argparse.SUPPRESS)  # refused: argv is public
    p.add_argument("--admin-port", type=int, metavar="PORT",
                   help="serve the admin API on its own listener (default: no admin API)")
    p.add_argument("--admin-host", metavar="ADDR",
                   help="admin listener address (default 127.0.0.1; beyond loopback a key is "
                   "required)")
    p.add_argument("--admin-key-file", metavar="FILE",
                   help="file holding the admin key (or set KVDISAGG_ADMIN_KEY); every admin "
                   "call then needs Authorization: Bearer KEY")
    p.add_argument("--admin-allow", action="append", default=[], metavar="CIDR|NAME",
                   help="a target /admin/add may add: a CIDR or a host name (exact or "
                   "*.suffix); repeatable")
    p.add_argument("--admin-key", help=argparse.SUPPRESS)  # refused: argv is public
    p.add_argument("--always-disaggregate", action="store_true",
                   help="send every request through prefill (no per-request decision)")
    p.add_argument("--local-prefill-tokens", type=int, metavar="N",
                   help="decode serves a request alone when it would compute at most N "
                   "prompt tokens itself (default 512)")
    p.add_argument("--early-decode", action="store_true",
                   help="send a disaggregated request's decode leg together with its prefill "
                   "leg when the prefill is idle (decision.early_decode; docs/proxy.md)")
    p.add_argument("--no-first-token-from-prefill", action="store_true",
                   help="a disaggregated stream's first token comes from decode, after the "
                   "handoff (decision.first_token_from_prefill false; docs/proxy.md)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="the served model's tokenizer (a model directory): request token ids "
                   "are worked out in the proxy for cache-hit predictions (else vLLM's "
                   "/tokenize is asked)")
    p.add_argument("--no-cache-index", action="store_true",
                   help="do not follow the instances' KV cache events")
    p.add_argument("--no-decode-only-fallback", action="store_true",
                   help="fail instead of letting decode recompute when no prefill is usable")
    p.add_argument("--health-interval", type=float, metavar="S")
    p.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="OTLP/HTTP collector for request spans, e.g. http://127.0.0.1:4318")


def config_from_args(args: argparse.Namespace):  # -> ProxyConfig
    import msgspec

    from kvdisagg.errors import ConfigError
    from kvdisagg.keys import API_KEY_ENV, refused_on_command_line
    from kvdisagg.proxy.app import build_config
    from kvdisagg.proxy.config import ProxyConfig, instances_from_urls, load_config_file

    cfg = load_config_file(args.config) if args.config else ProxyConfig()
    rep = msgspec.structs.replace
    if args.admin_key is not None:
        raise ConfigError("--admin-key is not accepted: any local user can read a command line. "
                          "Put the key in a file (--admin-key-file) or in KVDISAGG_ADMIN_KEY")
    if args.api_key is not None:
        raise refused_on_command_line("--api-key", "--api-key-file", API_KEY_ENV)
    top = {k: v for k, v in (("host", args.host), ("port", args.port),
                             ("api_key_file", args.api_key_file),
                             ("otlp_traces_endpoint", args.otlp_traces_endpoint))
           if v is not None}
    cfg = rep(cfg, **top)
    adm = {k: v for k, v in (("host", args.admin_host), ("port", args.admin_port),
                             ("key_file", args.admin_key_file)) if v is not None}
    if args.admin_allow:
        adm["allowed_targets"] = [*cfg.admin.allowed_targets, *args.admin_allow]
    if adm:
        cfg = rep(cfg, admin=rep(cfg.admin, **adm))
    pol = {}
    if args.policy:
        pol = {"prefill": args.policy, "decode": args.policy}
    if args.prefill_policy:
        pol["prefill"] = args.prefill_policy
    if args.decode_policy:
        pol["decode"] = args.decode_policy
    cfg = rep(cfg, policy=rep(cfg.policy, **pol))
    slo = {k: v for k, v in (("ttft_s", args.slo_ttft), ("tpot_s", args.slo_tpot),
                             ("admission", args.admission)) if v is not None}
    if slo:
        cfg = rep(cfg, slo=rep(cfg.slo, **slo))  # build_config's validate() converts the enum
    if args.no_decode_only_fallback:
        cfg = rep(cfg, retry=rep(cfg.retry, decode_only_fallback=False))
    dec = {k: v for k, v in (("enabled", False if args.always_disaggregate else None),
                             ("local_prefill_tokens", args.local_prefill_tokens),
                             ("early_decode", True if args.early_decode else None),
                             ("first_token_from_prefill",
                              False if args.no_first_token_from_prefill else None))
           if v is not None}
    if dec:
        cfg = rep(cfg, decision=rep(cfg.decision, **dec))
    if args.tokenizer or args.no_cache_index:
        ci = cfg.cache_index
        if args.tokenizer:
            ci = rep(ci, tokenizer=rep(ci.tokenizer, model=args.tokenizer))
        if args.no_cache_index:
            ci = rep(ci, enabled=False)
        cfg = rep(cfg, cache_index=ci)
    if args.health_interval is not None:  # 0 is refused by validate(), not ignored
        cfg = rep(cfg, health=rep(cfg.health, interval_s=args.health_interval))
    if args.prefill_dns or args.decode_dns:
        d = cfg.discovery
        cfg = rep(cfg, discovery=rep(d, prefill_dns=[*d.prefill_dns, *args.prefill_dns],
                                     decode_dns=[*d.decode_dns, *args.decode_dns]))
    extra = instances_from_urls(args.prefill, args.decode, args.both)
    cfg = rep(cfg, instances=[*cfg.instances, *extra])
    return build_config(timeout_s=args.timeout, config=cfg)


def run(args: argparse.Namespace) -> int:
    from kvdisagg.errors import ConfigError
    from kvdisagg.proxy.app import run as run_app

    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        raise SystemExit(f"kvdisagg proxy: {exc}") from None
    if not cfg.instances and not cfg.discovery.enabled:
        raise SystemExit("kvdisagg proxy: no instances; give --prefill/--decode URLs, "
                         "--prefill-dns/--decode-dns names or --config")
    return run_app(cfg)
