"""Fleet discovery: prefill and decode members from DNS and the Kubernetes API.

Each *source* (one DNS name, or one label selector) answers with a list of member URLs: DNS
names are resolved every ``discovery.interval_s``; a Kubernetes selector is kept current by a
list-then-watch of the pods (``KubernetesSource``), which wakes discovery at once on a change.
What the sources say now is compared with what discovery added before (``reconcile()``, pure): new
URLs are added and probed the way ``POST /admin/add`` does it, vanished ones are drained, then
removed, the way ``POST /admin/drain`` does it (both through ``admin.add_instance`` /
``admin.drain_instance``, so there is one membership mechanism, the registry's). Discovery owns
only what it added: static ``instances`` and members added over the admin API are never drained
by it.

A source that fails (DNS server down or timing out, NXDOMAIN, SERVFAIL, the API unreachable or
refusing) keeps its last good answer, and the failure is logged and counted in
``kvdisagg_proxy_discovery_errors_total``: a resolver outage must not empty the fleet. Only a
successful answer that lists nothing (NOERROR without records, no ready pod) drains.

A record form ``host:port``: every A and AAAA address with that port. SRV form
``srv:_http._tcp.name``: each record's target and port (how one address serves several ports).
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging
import ssl
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlsplit

import msgspec

from kvdisagg.errors import ConfigError, DiscoveryError
from kvdisagg.proxy.config import DiscoveryConfig, InstanceSpec, KubernetesDiscovery
from kvdisagg.proxy.fleet.admin import add_instance, drain_instance
from kvdisagg.proxy.fleet.registry import Registry
from kvdisagg.proxy.targets import Target, parse_hostport, parse_target, url_for
from kvdisagg.proxy.types import Role

log = logging.getLogger("kvdisagg.proxy")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def srv_urls(records: Iterable[tuple[str, int]]) -> list[str]:
    """SRV (target, port) pairs as sorted URLs (DNS rotates the order; priority and weight
    are not used: routing policies balance), a target of ``.`` ("no such service") skipped."""
    return sorted({url_for(t, p) for t, p in records if t.rstrip(".") and p})


def address_urls(addresses: Iterable[str], port: int) -> list[str]:
    """A/AAAA addresses with the configured port, sorted (DNS rotates the order)."""
    return sorted({url_for(str(ipaddress.ip_address(a)), port) for a in addresses})


# Kubernetes objects: only the fields discovery reads (unknown ones are ignored), validated by
# msgspec as they are decoded. Names are the API's (camelCase).
class _Condition(msgspec.Struct):
    type: str = ""
    status: str = ""


class _PodStatus(msgspec.Struct):
    phase: str | None = None
    podIP: str | None = None
    conditions: list[_Condition] | None = None


class _ObjectMeta(msgspec.Struct):
    name: str = ""
    resourceVersion: str = ""
    deletionTimestamp: str | None = None


class _Pod(msgspec.Struct):
    metadata: _ObjectMeta = msgspec.field(default_factory=_ObjectMeta)
    status: _PodStatus = msgspec.field(default_factory=_PodStatus)


class _ListMeta(msgspec.Struct):
    resourceVersion: str = ""
    continue_: str | None = msgspec.field(default=None, name="continue")


class _PodList(msgspec.Struct):
    metadata: _ListMeta = msgspec.field(default_factory=_ListMeta)
    items: list[_Pod] | None = None


class _Status(msgspec.Struct):
    """What the API answers on failure, and the object of a watch's ERROR event."""

    code: int | None = None
    reason: str | None = None
    message: str | None = None


class EventType(str, enum.Enum):
    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"
    BOOKMARK = "BOOKMARK"  # only a newer resourceVersion to resume from
    ERROR = "ERROR"  # the object is a Status (410: the resourceVersion is too old)


class _WatchEvent(msgspec.Struct):
    type: EventType
    object: msgspec.Raw


_decode_event = msgspec.json.Decoder(_WatchEvent).decode
_decode_pod = msgspec.json.Decoder(_Pod).decode
_decode_list = msgspec.json.Decoder(_PodList).decode
_decode_status = msgspec.json.Decoder(_Status).decode


def pod_url(pod: _Pod, port: int) -> str | None:
    """The member URL of a pod that may be routed to: Running, condition Ready=True, not being
    deleted (``metadata.deletionTimestamp``), with a valid ``podIP``; else None."""
    st = pod.status
    if pod.metadata.deletionTimestamp or st.phase != "Running" or not st.podIP:
        return None
    if not any(c.type == "Ready" and c.status == "True" for c in st.conditions or []):
        return None
    try:
        return url_for(str(ipaddress.ip_address(st.podIP)), port)
    except ValueError:
        return None


# sources
class Source(Protocol):
    label: str  # as logged and in the metric's `source` label
    role: Role

    async def resolve(self) -> list[str]:
        """Member URLs now; DiscoveryError when the answer is unknown. Called by discovery
        once a round; no state changes but the source's own."""
        ...

    def subscribe(self, on_change: Callable[[], None]) -> None:
        """Call ``on_change`` (cheap, no I/O) whenever the answer may have changed; a source
        that is only polled ignores it."""
        ...

    async def close(self) -> None:
        """Stop what the source runs in the background (once, at shutdown)."""
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

    def subscribe(self, on_change: Callable[[], None]) -> None:
        pass  # polled every interval_s

    async def close(self) -> None:
        pass

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


LIST_PAGE = 500  # pods per list page (limit=; client-go's default)
WATCH_TIMEOUT_S = 300.0  # timeoutSeconds of one watch: the API server ends it, we resume
MAX_EVENT_BYTES = 16 << 20  # one watch event; a pod is a few KiB


class _Resync(Exception):
    """The watch cannot resume (410 Gone: the resourceVersion or continue token is older than
    the API server keeps; an ERROR event; an event we cannot read): list again."""


class WatchEnd(enum.Enum):
    EXPIRED = "expired"  # the API server ended it (timeoutSeconds): resume at once
    DROPPED = "dropped"  # the connection broke mid-stream: resume after a pause


class KubernetesSource:
    """Ready pods matching a label selector, kept current by the Kubernetes list-then-watch
    protocol (client-go's reflector, in small).

    A background task lists the pods (paginated: ``limit``/``continue``), then watches from the
    list's ``resourceVersion`` (``watch=1``, ``allowWatchBookmarks``, ``timeoutSeconds``) and
    applies ADDED/MODIFIED/DELETED to its pod map; BOOKMARKs only move the resume point. A watch
    the server ends, or that drops, resumes from the last resourceVersion seen; 410 Gone (or an
    ERROR event) lists again. Every request is bounded (``timeout_s``; a watch by
    ``timeoutSeconds`` + ``timeout_s``). Each change of the member set calls the subscriber, so
    discovery acts at once instead of at its next ``interval_s``.

    ``resolve()`` starts the task on first use (and waits, bounded, for the first list), then
    answers from memory. While the API cannot be read it raises DiscoveryError, so discovery
    keeps its last answer and counts the error, as for DNS.

    Credentials: the in-cluster service account (token re-read for every request: it is
    rotated; CA ``ca.crt``; namespace). ``api_server`` must be https; ``plain_http`` and
    ``sa_dir`` exist for tests against a stand-in server on loopback.
    """

    def __init__(self, kcfg: KubernetesDiscovery, selector: str, role: Role, timeout_s: float,
                 *, sa_dir: Path = SA_DIR, plain_http: bool = False,
                 watch_timeout_s: float = WATCH_TIMEOUT_S,
                 retry_s: tuple[float, float] = (0.5, 30.0)) -> None:
        scheme = urlsplit(kcfg.api_server).scheme
        if scheme != "https" and not (plain_http and scheme == "http"):
            raise ConfigError(f"discovery.kubernetes.api_server: {kcfg.api_server!r} is not "
                              "https://...: the service account token must not travel in clear")
        self.kcfg, self.selector, self.role, self.timeout_s = kcfg, selector, role, timeout_s
        self.label = f"k8s:{selector}"
        self.sa_dir, self.plain_http = sa_dir, plain_http
        self.watch_timeout_s, self.retry_s = watch_timeout_s, retry_s
        self.pods: dict[str, str | None] = {}  # pod name -> its URL if routable
        self.resource_version: str | None = None  # where the next watch resumes; None: list
        self.lists = self.watches = 0  # requests that succeeded (logs and tests)
        self._error: str | None = None  # why the API cannot be read now
        self._synced = asyncio.Event()  # a first list arrived
        self._tried = asyncio.Event()  # a first list arrived or failed
        self._on_change: Callable[[], None] = lambda: None
        self._task: asyncio.Task[None] | None = None

    def subscribe(self, on_change: Callable[[], None]) -> None:
        self._on_change = on_change

    def members(self) -> list[str]:
        return sorted({u for u in self.pods.values() if u})

    async def resolve(self) -> list[str]:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name=f"watch {self.label}")
        if not self._synced.is_set():
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._tried.wait()
            except TimeoutError:
                pass
            if not self._synced.is_set():
                raise DiscoveryError(f"no pod list yet: {self._error or 'no answer'}")
        if self._error:
            raise DiscoveryError(self._error)
        return self.members()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # the reflector loop
    async def _run(self) -> None:
        import aiohttp

        failures = 0
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    if self.resource_version is None:
                        await self._list(session)
                    end = await self._watch(session)
                    failures = 0
                    if end is WatchEnd.EXPIRED:
                        continue
                    log.info("discovery: watch of %s dropped; resuming from resourceVersion %s",
                             self.label, self.resource_version)
                    await asyncio.sleep(self.retry_s[0])
                    continue
                except _Resync as exc:
                    log.info("discovery: %s: %s; listing again", self.label, exc)
                    self.resource_version = None
                    failures += 1
                    if failures == 1:
                        continue  # list now; a second resync in a row waits like an error
                except DiscoveryError as exc:
                    failures += 1
                    if self._error != str(exc):
                        log.warning("discovery: %s: %s", self.label, exc)
                    self._error = str(exc)
                except Exception as exc:  # a bug must not end the watch for good
                    failures += 1
                    log.exception("discovery: %s failed", self.label)
                    self._error = f"{type(exc).__name__}: {exc}"
                self._tried.set()
                lo, hi = self.retry_s
                await asyncio.sleep(min(hi, lo * 2 ** min(failures - 1, 16)))

    def _request_args(self, params: dict[str, str]) -> tuple[str, dict[str, Any]]:
        try:
            token = (self.sa_dir / "token").read_text().strip()  # re-read: it is rotated
            ns = self.kcfg.namespace or (self.sa_dir / "namespace").read_text().strip()
            ctx: ssl.SSLContext | None = None
            if not self.plain_http:
                ctx = ssl.create_default_context(cafile=str(self.sa_dir / "ca.crt"))
        except (OSError, ssl.SSLError) as exc:
            raise DiscoveryError(f"service account not readable: {exc}") from None
        url = f"{self.kcfg.api_server.rstrip('/')}/api/v1/namespaces/{ns}/pods"
        return url, {"params": {"labelSelector": self.selector, **params},
                     "headers": {"Authorization": f"Bearer {token}",
                                 "Accept": "application/json"},
                     **({"ssl": ctx} if ctx is not None else {})}

    def _refused(self, url: str, status: int, body: bytes) -> DiscoveryError:
        try:
            why = _decode_status(body).message or ""
        except (msgspec.DecodeError, msgspec.ValidationError):
            why = body[:200].decode(errors="replace")
        hint = {401: " (the service account token was refused)",
                403: (" (the proxy's service account may not get/list/watch pods here: bind "
                      "it to a Role that allows them, examples/kubernetes/base/rbac.yaml)")}
        return DiscoveryError(f"{url}: HTTP {status}{hint.get(status, '')}: {why}")

    async def _list(self, session: Any) -> None:
        """Every page of the list; then the pod map is replaced and watching starts from the
        list's resourceVersion."""
        import aiohttp

        pods: dict[str, str | None] = {}
        cont: str | None = None
        while True:
            url, kw = self._request_args({"limit": str(LIST_PAGE),
                                          **({"continue": cont} if cont else {})})
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(
                        total=self.timeout_s), **kw) as r:
                    body = await r.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise DiscoveryError(f"{url}: {exc!r}") from None
            if r.status == 410:  # the continue token expired mid-list
                raise _Resync("the list's continue token expired (410)")
            if r.status != 200:
                raise self._refused(url, r.status, body)
            try:
                page = _decode_list(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise DiscoveryError(f"{url}: not a PodList: {exc}") from None
            for pod in page.items or []:
                pods[pod.metadata.name] = pod_url(pod, self.kcfg.port)
            cont = page.metadata.continue_
            if not cont:
                break
        if not page.metadata.resourceVersion:
            raise DiscoveryError(f"{url}: a PodList without metadata.resourceVersion")
        before = self.members()
        self.pods, self.resource_version = pods, page.metadata.resourceVersion
        self.lists += 1
        self._error = None
        self._synced.set()
        self._tried.set()
        log.info("discovery: %s listed %d pods, %d routable (resourceVersion %s)", self.label,
                 len(pods), len(self.members()), self.resource_version)
        if self.members() != before:
            self._on_change()

    async def _watch(self, session: Any) -> WatchEnd:
        """One watch from ``resource_version`` until the server ends it or it drops."""
        import aiohttp

        assert self.resource_version is not None
        url, kw = self._request_args({
            "watch": "1", "resourceVersion": self.resource_version,
            "allowWatchBookmarks": "true", "timeoutSeconds": str(round(self.watch_timeout_s))})
        timeout = aiohttp.ClientTimeout(total=self.watch_timeout_s + self.timeout_s,
                                        connect=self.timeout_s)
        started = False
        try:
            async with session.get(url, timeout=timeout, **kw) as r:
                if r.status == 410:
                    raise _Resync("resourceVersion too old (410)")
                if r.status != 200:
                    raise self._refused(url, r.status, await r.read())
                started = True
                self.watches += 1
                self._error = None
                buf = bytearray()
                async for chunk in r.content.iter_any():
                    buf += chunk
                    while (i := buf.find(b"\n")) != -1:
                        line = bytes(buf[:i])
                        del buf[:i + 1]
                        if line.strip():
                            self._apply(line)
                    if len(buf) > MAX_EVENT_BYTES:
                        raise _Resync(f"a watch event over {MAX_EVENT_BYTES} bytes")
                if buf.strip():  # the stream ended inside an event
                    return WatchEnd.DROPPED
                return WatchEnd.EXPIRED
        except (aiohttp.ClientError, TimeoutError) as exc:
            if started:  # broke mid-stream, or outlived its timeoutSeconds (a dead peer)
                return WatchEnd.DROPPED
            raise DiscoveryError(f"{url}: {exc!r}") from None

    def _apply(self, line: bytes) -> None:
        try:
            ev = _decode_event(line)
            if ev.type is EventType.ERROR:
                st = _decode_status(ev.object)
                raise _Resync(f"watch ERROR {st.code} {st.reason}: {st.message}")
            pod = _decode_pod(ev.object)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _Resync(f"an unreadable watch event: {exc}") from None
        if pod.metadata.resourceVersion:
            self.resource_version = pod.metadata.resourceVersion
        if ev.type is EventType.BOOKMARK:
            return
        name = pod.metadata.name
        old = self.pods.get(name)
        if ev.type is EventType.DELETED:
            self.pods.pop(name, None)
            new = None
        else:  # ADDED, MODIFIED
            new = self.pods[name] = pod_url(pod, self.kcfg.port)
        if new != old:
            log.info("discovery: %s pod %s: %s -> %s", self.label, name, old or "-", new or "-")
            self._on_change()

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
class Changes(NamedTuple):
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


def reconcile(want: dict[str, Role], owned: dict[str, Role], present: Iterable[str],
         draining: Iterable[str]) -> Changes:
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
    return Changes(add, drain, undrain)


class Discovery:
    """Runs the sources on a timer and applies ``reconcile()`` to the registry."""

    def __init__(self, cfg: DiscoveryConfig, registry: Registry, drain_timeout_s: float,
                 on_error: Callable[[Source], None] | None = None,
                 sources: list[Source] | None = None) -> None:
        self.cfg = cfg
        self.registry = registry
        self.drain_timeout_s = drain_timeout_s
        self.on_error = on_error or (lambda source: None)
        self.sources = make_sources(cfg) if sources is None else sources
        self._wake = asyncio.Event()  # a source's answer changed: a round now
        for src in self.sources:
            src.subscribe(self._wake.set)
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

    async def sync(self) -> Changes:
        """One round: resolve every source, then add, drain and undrain."""
        await asyncio.gather(*(self._resolve(i, s) for i, s in enumerate(self.sources)))
        want, clash = desired((s.role, self.last.get(i, [])) for i, s in enumerate(self.sources))
        for u in clash:
            log.warning("discovery: %s is listed as both prefill and decode; kept as %s",
                        u, want[u].value)
        p = reconcile(want, self.owned, self.registry.instances, self.drains)
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
            try:  # every interval_s, or at once when a watched source changed
                async with asyncio.timeout(self.cfg.interval_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
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
        await asyncio.gather(*(s.close() for s in self.sources), return_exceptions=True)
