"""Fleet discovery: prefill and decode members from DNS and the Kubernetes API.

Each *source* (one DNS name, or one label selector) is resolved every ``discovery.interval_s``
into a list of member URLs. What the sources say now is compared with what discovery added
before (``plan()``, pure): new URLs are added and probed the way ``POST /admin/add`` does it,
vanished ones are drained, then removed, the way ``POST /admin/drain`` does it (both through
``admin.add_instance`` / ``admin.drain_instance``, so there is one membership mechanism, the
registry's). Discovery owns only what it added: static ``instances`` and members added over the
admin API are never drained by it.

A source that fails (DNS server down or timing out, NXDOMAIN, SERVFAIL, the API unreachable)
keeps its last good answer, and the failure is logged and counted in
``kvdisagg_proxy_discovery_errors_total``: a resolver outage must not empty the fleet. Only a
successful answer that lists nothing (NOERROR without records, no ready pod) drains.

A record form ``host:port``: every A and AAAA address with that port. SRV form
``srv:_http._tcp.name``: each record's target and port (how one address serves several ports).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple, Protocol

from kvdisagg.proxy.config import DiscoveryConfig, InstanceSpec, KubernetesDiscovery, Role

if TYPE_CHECKING:
    from kvdisagg.proxy.registry import Registry

log = logging.getLogger("kvdisagg.proxy")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class DiscoveryError(Exception):
    """A source could not be read; its last good answer stands."""


# parsing
class Target(NamedTuple):
    """One configured DNS name: ``srv`` True for SRV records, else A/AAAA with ``port``."""

    name: str
    port: int | None
    srv: bool


def parse_hostport(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; ValueError says what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: write an IPv6 address as [addr]:port")
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"{text!r}: port {port!r} is not a number") from None
    if not 1 <= p <= 65535:
        raise ValueError(f"{text!r}: port {p} is not in 1-65535")
    return host, p


def parse_target(text: str) -> Target:
    """``host:port`` (A/AAAA) or ``srv:_service._proto.name`` (SRV)."""
    if text.startswith("srv:"):
        name = text[4:].strip()
        if not name or ":" in name:
            raise ValueError(f"{text!r}: SRV form is srv:_http._tcp.name (no port: "
                             "SRV records carry it)")
        return Target(name, None, True)
    host, port = parse_hostport(text)
    return Target(host, port, False)


def url_for(host: str, port: int) -> str:
    host = host.rstrip(".")
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{port}"


def srv_urls(records: Iterable[tuple[str, int]]) -> list[str]:
    """SRV (target, port) pairs as sorted URLs (DNS rotates the order; priority and weight
    are not used: routing policies balance), a target of ``.`` ("no such service") skipped."""
    return sorted({url_for(t, p) for t, p in records if t.rstrip(".") and p})


def address_urls(addresses: Iterable[str], port: int) -> list[str]:
    """A/AAAA addresses with the configured port, sorted (DNS rotates the order)."""
    return sorted({url_for(str(ipaddress.ip_address(a)), port) for a in addresses})


def parse_pods(doc: dict[str, Any], port: int) -> list[str]:
    """URLs of the ready, not terminating pods in a ``PodList``."""
    out: set[str] = set()
    for pod in doc.get("items") or []:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp") or status.get("phase") != "Running":
            continue
        ip = status.get("podIP")
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions") or [])
        if ip and ready:
            out.add(url_for(ip, port))
    return sorted(out)


def parse_endpoints(doc: dict[str, Any], port: int) -> list[str]:
    """URLs of the ready addresses of an ``Endpoints`` object (or an ``EndpointsList``)."""
    out: set[str] = set()
    for ep in doc.get("items") or [doc]:
        for subset in ep.get("subsets") or []:
            for addr in subset.get("addresses") or []:  # notReadyAddresses are not routed
                if addr.get("ip"):
                    out.add(url_for(addr["ip"], port))
    return sorted(out)


# sources
class Source(Protocol):
    label: str  # as logged and in the metric's `source` label
    role: Role

    async def resolve(self) -> list[str]:
        """Member URLs now; DiscoveryError when the answer is unknown."""
        ...


def make_resolver(cfg: DiscoveryConfig) -> Any:
    import dns.asyncresolver
    import dns.nameserver
    import dns.resolver

    try:
        r = dns.asyncresolver.Resolver(configure=not cfg.nameservers)
    except dns.resolver.NoResolverConfiguration as exc:
        raise DiscoveryError(f"no system DNS configuration: {exc}") from None
    if cfg.nameservers:
        r.nameservers = [dns.nameserver.Do53Nameserver(*parse_hostport(ns))
                         for ns in cfg.nameservers]
    r.timeout = r.lifetime = cfg.timeout_s
    return r


class DnsSource:
    def __init__(self, target: Target, role: Role, cfg: DiscoveryConfig) -> None:
        self.target, self.role, self.cfg = target, role, cfg
        self.label = f"srv:{target.name}" if target.srv else f"{target.name}:{target.port}"
        self._resolver: Any = None

    async def _query(self, rdtype: str) -> list[Any]:
        import dns.exception
        import dns.resolver

        if self._resolver is None:
            self._resolver = make_resolver(self.cfg)
        try:
            ans = await self._resolver.resolve(self.target.name, rdtype, search=True,
                                               raise_on_no_answer=False,
                                               lifetime=self.cfg.timeout_s)
        except dns.resolver.NXDOMAIN:
            raise DiscoveryError(f"{rdtype} {self.target.name}: NXDOMAIN") from None
        except dns.exception.Timeout:
            raise DiscoveryError(f"{rdtype} {self.target.name}: no answer within "
                                 f"{self.cfg.timeout_s}s") from None
        except dns.exception.DNSException as exc:
            raise DiscoveryError(f"{rdtype} {self.target.name}: {exc}") from None
        return list(ans.rrset) if ans.rrset is not None else []

    async def resolve(self) -> list[str]:
        t = self.target
        if t.srv:
            return srv_urls((r.target.to_text(), r.port) for r in await self._query("SRV"))
        try:
            ip = ipaddress.ip_address(t.name)
        except ValueError:
            pass
        else:  # an address literal needs no lookup
            return [url_for(str(ip), t.port or 0)]
        a, aaaa = await asyncio.gather(self._query("A"), self._query("AAAA"))
        assert t.port is not None
        return address_urls([r.address for r in a + aaaa], t.port)


class KubernetesSource:
    """``GET /api/v1/namespaces/NS/pods?labelSelector=...`` with the service account."""

    def __init__(self, kcfg: KubernetesDiscovery, selector: str, role: Role,
                 timeout_s: float) -> None:
        self.kcfg, self.selector, self.role, self.timeout_s = kcfg, selector, role, timeout_s
        self.label = f"k8s:{selector}"

    async def resolve(self) -> list[str]:
        import aiohttp

        try:
            token = (SA_DIR / "token").read_text().strip()  # re-read: it is rotated
            ns = self.kcfg.namespace or (SA_DIR / "namespace").read_text().strip()
            ctx = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
        except OSError as exc:
            raise DiscoveryError(f"service account not readable: {exc}") from None
        url = f"{self.kcfg.api_server.rstrip('/')}/api/v1/namespaces/{ns}/pods"
        try:
            async with aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as s:
                async with s.get(url, params={"labelSelector": self.selector}, ssl=ctx,
                                 headers={"Authorization": f"Bearer {token}"}) as r:
                    text = await r.text()
                    if r.status != 200:
                        raise DiscoveryError(f"{url}: HTTP {r.status}: {text[:200]}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise DiscoveryError(f"{url}: {exc!r}") from None
        try:
            return parse_pods(json.loads(text), self.kcfg.port)
        except (ValueError, AttributeError) as exc:
            raise DiscoveryError(f"{url}: not a PodList: {exc}") from None


def make_sources(cfg: DiscoveryConfig) -> list[Source]:
    out: list[Source] = []
    for role, names in ((Role.PREFILL, cfg.prefill_dns), (Role.DECODE, cfg.decode_dns)):
        out += [DnsSource(parse_target(n), role, cfg) for n in names]
    k = cfg.kubernetes
    if k is not None:
        for role, sel in ((Role.PREFILL, k.prefill_selector), (Role.DECODE, k.decode_selector)):
            if sel:
                out.append(KubernetesSource(k, sel, role, cfg.timeout_s))
    return out


# the diff
class Plan(NamedTuple):
    add: list[InstanceSpec]  # new: add and probe
    drain: list[str]  # discovered, vanished: drain then remove
    undrain: list[str]  # discovered, vanished, back before its drain ended


def desired(answers: Iterable[tuple[Role, list[str]]]) -> tuple[dict[str, Role], list[str]]:
    """URL -> role over every source's last good answer; a URL given for two roles keeps the
    first and is returned in the second list (the registry keys instances by URL)."""
    want: dict[str, Role] = {}
    clash: list[str] = []
    for role, urls in answers:
        for u in urls:
            if want.setdefault(u, role) is not role:
                clash.append(u)
    return want, clash


def plan(want: dict[str, Role], owned: dict[str, Role], present: Iterable[str],
         draining: Iterable[str]) -> Plan:
    """What to change. ``owned``: URLs discovery added (and has not removed yet); ``present``:
    every URL in the registry (static, admin-added, discovered); ``draining``: owned URLs whose
    drain is under way. Only owned URLs are ever drained or undrained."""
    present, draining = set(present), set(draining)
    add, undrain = [], []
    for url, role in want.items():
        if url in owned:
            if url in draining and owned[url] is role:
                undrain.append(url)
        elif url not in present:  # static or admin-added members are left as they are
            add.append(InstanceSpec(url=url, role=role))
    drain = [u for u, role in owned.items()
             if u not in draining and want.get(u) is not role]  # gone, or now the other role
    return Plan(add, drain, undrain)


class Discovery:
    """Runs the sources on a timer and applies ``plan()`` to the registry."""

    def __init__(self, cfg: DiscoveryConfig, registry: Registry, drain_timeout_s: float,
                 on_error: Callable[[Source], None] | None = None,
                 sources: list[Source] | None = None) -> None:
        self.cfg = cfg
        self.registry = registry
        self.drain_timeout_s = drain_timeout_s
        self.on_error = on_error or (lambda source: None)
        self.sources = make_sources(cfg) if sources is None else sources
        self.last: dict[int, list[str]] = {}  # source index -> last good answer
        self.owned: dict[str, Role] = {}
        self.drains: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None

    async def _resolve(self, i: int, src: Source) -> None:
        try:
            async with asyncio.timeout(self.cfg.timeout_s * 2):  # a backstop to the resolver's
                urls = await src.resolve()
        except (DiscoveryError, TimeoutError) as exc:
            kept = len(self.last.get(i, []))
            log.warning("discovery of %s %s failed, keeping its %d last known members: %s",
                        src.role.value, src.label, kept, exc or "timed out")
            self.on_error(src)
            return
        if urls != self.last.get(i):
            log.info("discovery: %s %s -> %s", src.role.value, src.label, urls or "nothing")
        self.last[i] = urls

    def found(self, url: str) -> bool:
        """Whether a source lists ``url`` now (the admin API may then add it back)."""
        return any(url in urls for urls in self.last.values())

    async def sync(self) -> Plan:
        """One round: resolve every source, then add, drain and undrain."""
        await asyncio.gather(*(self._resolve(i, s) for i, s in enumerate(self.sources)))
        want, clash = desired((s.role, self.last.get(i, [])) for i, s in enumerate(self.sources))
        for u in clash:
            log.warning("discovery: %s is listed as both prefill and decode; kept as %s",
                        u, want[u].value)
        p = plan(want, self.owned, self.registry.instances, self.drains)
        from kvdisagg.proxy.admin import add_instance

        for url in p.undrain:
            self.drains.pop(url).cancel()
            self.registry.undrain(url)
            log.info("discovery: %s is back; undrained", url)
        for spec in p.add:
            self.owned[spec.key] = spec.role
        results = await asyncio.gather(*(add_instance(self.registry, s) for s in p.add),
                                       return_exceptions=True)
        for spec, res in zip(p.add, results):
            if isinstance(res, BaseException):
                self.owned.pop(spec.key, None)
                log.warning("discovery: cannot add %s: %s", spec.key, res)
        loop = asyncio.get_running_loop()
        for url in p.drain:
            self.drains[url] = loop.create_task(self._drain(url))
        return p

    async def _drain(self, url: str) -> None:
        from kvdisagg.proxy.admin import drain_instance

        try:
            drained, _ = await drain_instance(self.registry, url, self.drain_timeout_s,
                                              remove=True, force=True)
            log.info("discovery: %s vanished; removed (%s)", url,
                     "idle" if drained else "legs still in flight after the drain timeout")
        except KeyError:  # already removed (admin API)
            pass
        finally:
            if self.drains.get(url) is asyncio.current_task():
                del self.drains[url]
                self.owned.pop(url, None)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.sync()
            except Exception:  # a bug in one round must not stop discovery
                log.exception("discovery round failed")

    async def start(self) -> None:
        """First round now (so start-up probes see the members), then every ``interval_s``."""
        await self.sync()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self.drains.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
