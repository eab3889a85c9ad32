"""``kvdisagg admin``: a command-line client of the proxy's admin API (``admin.py``), for
operators and for the vLLM pods' ``preStop`` hooks (so their image needs no curl)::

    kvdisagg admin list    [--json]
    kvdisagg admin add     --url URL --role prefill|decode|kv_both
    kvdisagg admin drain   --url URL [--timeout S] [--remove] [--missing-ok]
    kvdisagg admin undrain --url URL
    kvdisagg admin remove  --url URL [--missing-ok]
            common: [--proxy URL] [--key-file FILE] [--timeout S] [--each-address]

Every subcommand takes ``--proxy`` (the admin listener; ``$KVDISAGG_PROXY_ADMIN``, else
``http://127.0.0.1:8001``) and ``--key-file`` (else ``$KVDISAGG_ADMIN_KEY``, else no key). The
key is never a flag: any local user can read a command line. ``--each-address`` makes the call
at every address the ``--proxy`` host resolves to, at once: behind a headless Service, every
proxy replica (each routes its own share of the requests, so a drain must reach them all).

Every wait is bounded: ``drain`` sends ``--timeout`` as the drain's bound and waits for the
answer ``ANSWER_GRACE_S`` longer; the other commands wait ``--timeout`` for theirs. The exit
status says what happened (``AdminExit``), so a hook or a script can tell a refused call from an
unreachable proxy and from a drain that ran out of time.

Its own imports are the standard library (urllib), msgspec and kvdisagg.keys (the key is read
as the proxy reads its own), nothing of the proxy's server side; it is synchronous, and it
ignores ``HTTP(S)_PROXY`` from the environment: the admin API is reached directly on the
cluster network.
"""

from __future__ import annotations

import argparse
import enum
import io
import json
import os
import socket
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TextIO
from urllib.parse import urlsplit

import msgspec

from kvdisagg.errors import ConfigError
from kvdisagg.keys import ADMIN_KEY_ENV, key_from, refused_on_command_line

PROXY_ENV = "KVDISAGG_PROXY_ADMIN"
DEFAULT_PROXY = "http://127.0.0.1:8001"
ANSWER_GRACE_S = 10.0  # drain: wait this much past the drain's own bound for the answer
ROLES = ("prefill", "decode", "kv_both")


class AdminExit(enum.IntEnum):
    OK = 0
    REFUSED = 1  # the proxy answered with an error (its message is printed)
    USAGE = 2  # bad arguments, or the key file cannot be read (argparse exits 2 too)
    UNREACHABLE = 3  # no answer from the proxy within the bound
    NOT_DRAINED = 4  # drain: legs still in flight when its timeout ran out


class UsageError(Exception):
    pass


# what the admin API answers (admin.py, registry.InstanceInfo); unknown fields are ignored
class InstanceAnswer(msgspec.Struct):
    url: str
    role: str
    state: str
    healthy: bool
    breaker: str = "?"
    in_flight: dict[str, int] = msgspec.field(default_factory=dict)
    last_probe_error: str | None = None


class _Listed(msgspec.Struct):
    instances: list[InstanceAnswer]


class _Drained(msgspec.Struct):
    drained: bool
    instance: InstanceAnswer


class _ErrorBody(msgspec.Struct):
    message: str


class _Error(msgspec.Struct):
    error: _ErrorBody


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="admin_command", required=True, metavar="COMMAND")

    def command(name: str, help: str, timeout_help: str, timeout: float) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        c.add_argument("--proxy", default=os.environ.get(PROXY_ENV) or DEFAULT_PROXY,
                       metavar="URL", help=f"the proxy's admin listener (default ${PROXY_ENV} "
                       f"or {DEFAULT_PROXY})")
        c.add_argument("--key-file", metavar="FILE",
                       help=f"file holding the admin key (else ${ADMIN_KEY_ENV}; else no key)")
        c.add_argument("--key", "--admin-key", dest="key", help=argparse.SUPPRESS)  # refused
        c.add_argument("--timeout", type=float, default=timeout, metavar="S",
                       help=f"{timeout_help} (default {timeout:g})")
        c.add_argument("--each-address", action="store_true",
                       help="make the call at every address the --proxy host resolves to, at "
                       "once (a headless Service: every proxy replica); each answer is printed "
                       "after its address, and the exit status is the highest of theirs")
        return c

    c = command("list", "every instance: role, state, health, breaker, legs in flight",
                "wait at most S for the answer", 10.0)
    c.add_argument("--json", action="store_true", help="print the admin API's JSON")
    c = command("add", "add an instance; the proxy probes it once and routes to it if healthy",
                "wait at most S for the answer (the proxy probes the instance first)", 30.0)
    c.add_argument("--url", required=True, help="the instance, http://host:port")
    c.add_argument("--role", required=True, choices=ROLES)
    c = command("drain", "no new work for an instance; wait (bounded) for its legs in flight",
                f"wait at most S for in-flight legs; the answer at most S + {ANSWER_GRACE_S:g}",
                30.0)
    c.add_argument("--url", required=True, help="the instance, as the proxy knows it")
    c.add_argument("--remove", action="store_true", help="then remove it, if it went idle")
    c.add_argument("--missing-ok", action="store_true",
                   help="an instance the proxy does not know is not an error (exit 0)")
    c = command("undrain", "take new work on a draining instance again",
                "wait at most S for the answer", 10.0)
    c.add_argument("--url", required=True)
    c = command("remove", "out of the fleet now; its legs in flight still finish",
                "wait at most S for the answer", 10.0)
    c.add_argument("--url", required=True)
    c.add_argument("--missing-ok", action="store_true",
                   help="an instance the proxy does not know is not an error (exit 0)")


def read_key(key_file: str | None) -> str | None:
    """The admin key from ``key_file``, else ``$KVDISAGG_ADMIN_KEY`` (kvdisagg.keys, as the
    proxy reads its own); UsageError if the file is unreadable or empty."""
    try:
        return key_from(key_file, ADMIN_KEY_ENV, "--key-file")
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def proxy_base(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise UsageError(f"--proxy: {url!r} is not http(s)://host:port (the admin listener)")
    return url.rstrip("/")


class AdminClient:
    """One admin call at a time; raises ``Refused`` (an HTTP error answer) or ``Unreachable``."""

    def __init__(self, base: str, key: str | None) -> None:
        self.base, self.key = base, key
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def call(self, method: str, path: str, body: dict[str, Any] | None,
             timeout_s: float) -> bytes:
        headers = {"Accept": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        try:
            with self._opener.open(req, timeout=timeout_s) as r:
                answer: bytes = r.read()
                return answer
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                msg = msgspec.json.decode(raw, type=_Error).error.message
            except (msgspec.DecodeError, msgspec.ValidationError):
                msg = raw[:300].decode(errors="replace") or exc.reason
            raise Refused(exc.code, msg) from None
        except (TimeoutError, urllib.error.URLError, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if isinstance(reason, TimeoutError):
                why = f"no answer within {timeout_s:g}s"
            else:
                why = str(reason)
            raise Unreachable(f"{self.base}: {why}") from None


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Unreachable(Exception):
    pass


def _decode(raw: bytes, typ: type) -> Any:
    try:
        return msgspec.json.decode(raw, type=typ)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise Refused(200, f"not an admin API answer ({exc}): {raw[:200]!r}") from None


def _line(i: InstanceAnswer) -> str:
    legs = f"{i.in_flight.get('prefill', 0)}/{i.in_flight.get('decode', 0)}"
    return (f"{i.url:<32} {i.role:<8} {i.state:<9} {'yes' if i.healthy else 'no':<7} "
            f"{i.breaker:<9} {legs}")


def execute(args: argparse.Namespace, out: TextIO) -> AdminExit:
    """One subcommand; raises UsageError, Refused, Unreachable."""
    if args.key is not None:
        raise UsageError(str(refused_on_command_line("--key", "--key-file", ADMIN_KEY_ENV)))
    if args.timeout <= 0:
        raise UsageError(f"--timeout: must be > 0, got {args.timeout:g}")
    client = AdminClient(proxy_base(args.proxy), read_key(args.key_file))
    cmd = args.admin_command
    if cmd == "list":
        raw = client.call("GET", "/admin/list", None, args.timeout)
        listed = _decode(raw, _Listed)
        if args.json:
            print(json.dumps(json.loads(raw), indent=2), file=out)
        else:
            print(f"{'URL':<32} {'ROLE':<8} {'STATE':<9} {'HEALTHY':<7} {'BREAKER':<9} "
                  "IN-FLIGHT P/D", file=out)
            for inst in listed.instances:
                print(_line(inst), file=out)
        return AdminExit.OK
    if cmd == "add":
        inst = _decode(client.call("POST", "/admin/add", {"url": args.url, "role": args.role},
                                   args.timeout), InstanceAnswer)
        print(f"added {inst.url} as {inst.role}: "
              + ("healthy" if inst.healthy else f"not healthy yet ({inst.last_probe_error})"),
              file=out)
        return AdminExit.OK
    if cmd == "drain":
        raw = client.call("POST", "/admin/drain", {"url": args.url, "timeout_s": args.timeout,
                                                   "remove": args.remove},
                          args.timeout + ANSWER_GRACE_S)
        d = _decode(raw, _Drained)
        if d.drained:
            print(f"drained {d.instance.url}: idle" + ("; removed" if args.remove else ""),
                  file=out)
            return AdminExit.OK
        legs = sum(d.instance.in_flight.values())
        print(f"{d.instance.url}: legs still in flight after {args.timeout:g}s: {legs}; "
              "it takes no new work" + ("; not removed" if args.remove else ""), file=out)
        return AdminExit.NOT_DRAINED
    path = f"/admin/{cmd}"  # undrain, remove
    inst = _decode(client.call("POST", path, {"url": args.url}, args.timeout), InstanceAnswer)
    print(f"removed {inst.url}" if cmd == "remove" else f"undrained {inst.url}: {inst.state}",
          file=out)
    return AdminExit.OK


def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (A and AAAA records, with the resolver's search
    domains), sorted; raises ``Unreachable`` when there is none. Tests replace this function."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise Unreachable(f"{host}: {exc.strerror}") from None
    found = sorted({str(info[4][0]) for info in infos})
    if not found:
        raise Unreachable(f"{host}: no address")
    return found


def proxy_addresses(url: str) -> list[str]:
    """``--each-address``: the admin listener at each address of ``url``'s host, as base URLs.
    Only http: a certificate cannot be checked against an address (keep the admin API on the
    cluster network, as its NetworkPolicy does)."""
    base = proxy_base(url)
    parts = urlsplit(base)
    if parts.scheme != "http":
        raise UsageError(f"--each-address: {url!r} is https; a certificate names a host, not "
                         "each of its addresses: use http on the cluster network")
    assert parts.hostname is not None  # proxy_base checked it
    port = parts.port or 80
    return [f"http://{f'[{a}]' if ':' in a else a}:{port}"
            for a in resolve_addresses(parts.hostname, port)]


def run(args: argparse.Namespace, out: TextIO | None = None,
        err: TextIO | None = None) -> int:
    """One subcommand at ``--proxy``, or at each of its addresses (``--each-address``); prints
    the outcome and returns the exit status."""
    out, err = out or sys.stdout, err or sys.stderr
    if getattr(args, "each_address", False):
        return _run_each(args, out, err)
    return _run_one(args, out, err)


def _run_each(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    prog = f"kvdisagg admin {args.admin_command}"
    try:
        bases = proxy_addresses(args.proxy)
    except UsageError as exc:
        print(f"{prog}: {exc}", file=err)
        return AdminExit.USAGE
    except Unreachable as exc:
        print(f"{prog}: cannot reach the proxy's admin API: {exc}", file=err)
        return AdminExit.UNREACHABLE
    buffers = [(io.StringIO(), io.StringIO()) for _ in bases]
    # At once, not in turn: a drain may wait its whole --timeout at each replica, and the hook
    # calling it has one grace period for all of them.
    with ThreadPoolExecutor(max_workers=len(bases)) as pool:
        codes = list(pool.map(
            lambda job: _run_one(argparse.Namespace(**{**vars(args), "proxy": job[0]}), *job[1]),
            zip(bases, buffers, strict=True)))
    for base, (o, e) in zip(bases, buffers, strict=True):
        for line in o.getvalue().splitlines():
            print(f"{base}: {line}", file=out)
        for line in e.getvalue().splitlines():
            print(f"{base}: {line}", file=err)
    return max(codes)


def _run_one(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    prog = f"kvdisagg admin {args.admin_command}"
    try:
        return int(execute(args, out))
    except UsageError as exc:
        print(f"{prog}: {exc}", file=err)
        return AdminExit.USAGE
    except Refused as exc:
        if exc.status == 404 and getattr(args, "missing_ok", False):
            print(f"{prog}: {exc} (ignored: --missing-ok)", file=err)
            return AdminExit.OK
        print(f"{prog}: the proxy refused: {exc}", file=err)
        return AdminExit.REFUSED
    except Unreachable as exc:
        print(f"{prog}: cannot reach the proxy's admin API: {exc}", file=err)
        return AdminExit.UNREACHABLE
