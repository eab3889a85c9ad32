"""Discovery from the Kubernetes API (issue 19): ``KubernetesSource``'s list-then-watch against a
stand-in API server that speaks the real list/watch JSON (tests/support/kube_api.py), over
plain http on loopback: pagination, events, bookmarks, a watch that drops mid-event, 410 Gone
forcing a re-list, bounded waits, and the proxy's Discovery following pods as they turn ready,
unready, terminate and go (the registry's end state asserted)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from kvdisagg.errors import ConfigError
from kvdisagg.local.servers import free_port
from kvdisagg.proxy.config import DiscoveryConfig, HealthConfig, KubernetesDiscovery, ProxyConfig
from kvdisagg.proxy.fleet.discovery import (
    Discovery,
    DiscoveryError,
    KubernetesSource,
    make_sources,
)
from kvdisagg.proxy.fleet.registry import Outcome, Registry, State
from kvdisagg.proxy.metrics import Metrics
from kvdisagg.proxy.types import Role, Side
from tests.support.fake_vllm import FakeVllm
from tests.support.kube_api import KubeApi
from tests.support.proxy_harness import until

P, D = Role.PREFILL, Role.DECODE
DEC = {"app.kubernetes.io/name": "vllm", "kvdisagg/role": "decode"}
PRE = {"app.kubernetes.io/name": "vllm", "kvdisagg/role": "prefill"}
DEC_SEL = "app.kubernetes.io/name=vllm,kvdisagg/role=decode"
PRE_SEL = "app.kubernetes.io/name=vllm,kvdisagg/role=prefill"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def kube_api(**kw: Any) -> AsyncIterator[tuple[KubeApi, str]]:
    api = KubeApi(**kw)
    server = TestServer(api.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield api, f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


@pytest.fixture
def sa(tmp_path: Path) -> Path:
    """A service account directory as mounted in a pod (no CA: plain http in tests)."""
    (tmp_path / "token").write_text("test-token\n")
    (tmp_path / "namespace").write_text("kvdisagg")
    return tmp_path


def source(url: str, sa: Path, selector: str = DEC_SEL, role: Role = D, port: int = 8000,
           timeout_s: float = 1.0, **kw: Any) -> KubernetesSource:
    kw.setdefault("retry_s", (0.02, 0.2))
    kcfg = KubernetesDiscovery(decode_selector=selector, port=port, api_server=url)
    return KubernetesSource(kcfg, selector, role, timeout_s, sa_dir=sa, plain_http=True, **kw)


def u(ip: str, port: int = 8000) -> str:
    return f"http://{ip}:{port}"


def watches(api: KubeApi) -> list[dict[str, str]]:
    return [r for r in api.requests if r.get("watch") == "1"]


def lists(api: KubeApi) -> list[dict[str, str]]:
    return [r for r in api.requests if "watch" not in r]


def test_lists_every_page_then_applies_watch_events_and_bookmarks(sa: Path) -> None:
    async def t() -> None:
        async with kube_api(page_size=2) as (api, url):
            api.add("decode-0", DEC, "10.0.0.1")
            api.add("decode-1", DEC, "10.0.0.2")
            api.add("decode-2", DEC, "10.0.0.3", ready=False)
            api.add("decode-3", DEC, None, ready=False, phase="Pending")
            api.add("decode-4", DEC, "10.0.0.5")
            api.add("prefill-0", PRE, "10.0.1.1")  # another selector
            src = source(url, sa)
            changes: list[int] = []
            src.subscribe(lambda: changes.append(1))
            try:
                assert await src.resolve() == [u("10.0.0.1"), u("10.0.0.2"), u("10.0.0.5")]
                # five decode pods, two a page: three requests, the 2nd and 3rd continuing
                ls = lists(api)
                assert len(ls) == 3 and all(r["limit"] == "500" for r in ls)
                assert "continue" not in ls[0] and "continue" in ls[1] and "continue" in ls[2]
                assert all(r["labelSelector"] == DEC_SEL for r in api.requests)
                await until(lambda: api.open_watches == 1, "the watch")
                (w,) = watches(api)
                assert w["resourceVersion"] == str(api.rv)  # the list's, not later
                assert w["allowWatchBookmarks"] == "true" and w["timeoutSeconds"] == "300"
                n = len(changes)

                async def members() -> list[str]:
                    return await src.resolve()

                api.add("decode-5", DEC, "10.0.0.6")  # a new ready pod
                await until(lambda: u("10.0.0.6") in src.members(), "ADDED")
                api.set_ready("decode-2", True)  # turns ready
                await until(lambda: u("10.0.0.3") in src.members(), "MODIFIED ready")
                api.set_ready("decode-0", False)  # turns unready
                await until(lambda: u("10.0.0.1") not in src.members(), "MODIFIED unready")
                api.terminate("decode-1")  # still Ready, but being deleted
                await until(lambda: u("10.0.0.2") not in src.members(), "deletionTimestamp")
                assert "decode-1" in src.pods
                api.delete("decode-1")
                await until(lambda: "decode-1" not in src.pods, "DELETED")
                assert await members() == [u("10.0.0.3"), u("10.0.0.5"), u("10.0.0.6")]
                assert len(changes) >= n + 4  # each change of the member set woke discovery
                # a bookmark only moves the resume point
                api.rv += 7  # other objects changed meanwhile (not pods of this selector)
                api.bookmark()
                await until(lambda: src.resource_version == str(api.rv), "BOOKMARK")
                assert await members() == [u("10.0.0.3"), u("10.0.0.5"), u("10.0.0.6")]
                assert src.lists == 1 and src.watches == 1
            finally:
                await src.close()
    run(t())


def test_only_running_ready_pods_with_an_address_are_members(sa: Path) -> None:
    """A pod is a member while Running, Ready and not being deleted, with a valid podIP
    (IPv6 bracketed); none of a selector's pods: no members."""
    async def t() -> None:
        async with kube_api(page_size=10) as (api, url):
            empty = source(url, sa, port=8200)
            try:
                assert await empty.resolve() == []
            finally:
                await empty.close()
            api.add("a", DEC, "10.1.0.5")
            api.add("b", DEC, "10.1.0.6", ready=False)
            api.add("c", DEC, "10.1.0.7")
            api.terminate("c")  # deletionTimestamp set, still Ready
            api.add("d", DEC, None, phase="Pending")
            api.add("e", DEC, "10.1.0")  # not an address
            api.add("f", DEC, "fd00::7")
            src = source(url, sa, port=8200)
            try:
                assert await src.resolve() == ["http://10.1.0.5:8200", "http://[fd00::7]:8200"]
            finally:
                await src.close()
    run(t())


def test_dropped_watch_resumes_from_the_last_resource_version(sa: Path) -> None:
    async def t() -> None:
        async with kube_api() as (api, url):
            api.add("decode-0", DEC, "10.0.0.1")
            src = source(url, sa, retry_s=(0.3, 1.0))  # reconnects 0.3 s after a drop
            try:
                await src.resolve()
                await until(lambda: api.open_watches == 1, "the watch")
                api.set_ready("decode-0", False)
                await until(lambda: src.members() == [], "MODIFIED")
                seen = src.resource_version
                api.drop_watches()  # the connection breaks in the middle of an event
                await until(lambda: api.open_watches == 0, "the drop")
                api.add("decode-1", DEC, "10.0.0.2")  # while no watch is open
                api.set_ready("decode-0", True)
                await until(lambda: src.members() == [u("10.0.0.1"), u("10.0.0.2")],
                            "the missed events, replayed")
                resumed = watches(api)[-1]
                assert resumed["resourceVersion"] == seen  # from where it was, not a re-list
                assert src.lists == 1 and src.watches == 2
                assert await src.resolve() == [u("10.0.0.1"), u("10.0.0.2")]  # no error left
                # the server ends each watch (timeoutSeconds): resumed at once, no re-list
                api.max_watch_s = 0.1
                api.drop_watches()
                await until(lambda: src.watches >= 6, "watches ended by the server")
                api.add("decode-2", DEC, "10.0.0.3")
                await until(lambda: u("10.0.0.3") in src.members(), "an event across watches")
                assert src.lists == 1
            finally:
                await src.close()
    run(t())


def test_gone_forces_a_relist(sa: Path) -> None:
    async def t() -> None:
        async with kube_api(page_size=1) as (api, url):
            for i in range(3):
                api.add(f"decode-{i}", DEC, f"10.0.0.{i + 1}")
            api.expire_next_continue = True  # the first list's 2nd page: 410 Expired
            src = source(url, sa, retry_s=(0.3, 1.0))
            try:
                assert await src.resolve() == [u("10.0.0.1"), u("10.0.0.2"), u("10.0.0.3")]
                ls = lists(api)
                assert ["continue" in r for r in ls] == [False, True, False, True, True]
                await until(lambda: api.open_watches == 1, "the watch")
                # the watch drops; meanwhile a pod goes and etcd compacts its DELETED event
                api.drop_watches()
                await until(lambda: api.open_watches == 0, "the drop")
                api.delete("decode-0")
                api.add("decode-3", DEC, "10.0.0.4")
                api.compact()
                # resuming gets ERROR 410 (too old resource version): list again
                await until(lambda: src.lists == 2, "the re-list")
                assert src.members() == [u("10.0.0.2"), u("10.0.0.3"), u("10.0.0.4")]
                assert "decode-0" not in src.pods
                await until(lambda: api.open_watches == 1, "a watch from the new list")
                assert watches(api)[-1]["resourceVersion"] == str(api.rv)
                assert await src.resolve() == src.members()
            finally:
                await src.close()
    run(t())


def test_api_failures_are_errors_and_every_wait_is_bounded(sa: Path) -> None:
    async def t() -> None:
        async with kube_api() as (api, url):
            api.add("decode-0", DEC, "10.0.0.1")
            api.forbidden = True  # no RBAC
            src = source(url, sa, timeout_s=3.0)  # wide: a loaded host answers late
            try:
                t0 = time.monotonic()
                with pytest.raises(DiscoveryError, match=r"HTTP 403 .*rbac.yaml.*forbidden"):
                    await src.resolve()
                assert time.monotonic() - t0 < 2.0  # the answer, not the timeout
                api.forbidden = False
                await until(lambda: src.lists == 1, "the list once allowed")
                assert await src.resolve() == [u("10.0.0.1")]
                # the API fails while the watch is down: members are kept, resolve() says why
                api.fail_status = 500
                api.drop_watches()
                await until(lambda: src._error is not None, "the failed resume")
                with pytest.raises(DiscoveryError, match="HTTP 500.*etcd unavailable"):
                    await src.resolve()
                assert src.members() == [u("10.0.0.1")]
                api.fail_status = None
                api.add("decode-1", DEC, "10.0.0.2")
                await until(lambda: len(src.members()) == 2, "the resumed watch")
                assert await src.resolve() == [u("10.0.0.1"), u("10.0.0.2")]
                # a watch that neither sends nor ends is given up after its timeoutSeconds
                # plus timeout_s, and resumed
                api.hang = True
                api.drop_watches()
            finally:
                await src.close()
            hung = source(url, sa, timeout_s=0.3, watch_timeout_s=0.3)
            try:
                await hung.resolve()
                await until(lambda: hung.watches >= 3, "hung watches given up", 15.0)
            finally:
                await hung.close()
        # nothing listening: resolve() fails within timeout_s
        dead = source(f"http://127.0.0.1:{free_port()}", sa, timeout_s=0.5)
        try:
            t0 = time.monotonic()
            with pytest.raises(DiscoveryError, match="no pod list yet: .*Connect"):
                await dead.resolve()
            assert time.monotonic() - t0 < 1.0
        finally:
            await dead.close()
        # a bad token
        (sa / "token").write_text("stale")
        async with kube_api() as (api, url):
            src = source(url, sa, timeout_s=0.5)
            try:
                with pytest.raises(
                    DiscoveryError, match=r"HTTP 401 \(the service account token was refused\)"
                ):
                    await src.resolve()
            finally:
                await src.close()
    run(t())


def test_production_talks_https_only(sa: Path) -> None:
    kcfg = KubernetesDiscovery(decode_selector=DEC_SEL, api_server="http://10.0.0.1:6443")
    with pytest.raises(ConfigError, match=r"discovery.kubernetes.api_server: .*not https"):
        KubernetesSource(kcfg, DEC_SEL, D, 1.0)
    cfg = ProxyConfig(discovery=DiscoveryConfig(kubernetes=kcfg)).validate()
    with pytest.raises(ConfigError, match="api_server"):
        make_sources(cfg.discovery)
    ok = make_sources(ProxyConfig(discovery=DiscoveryConfig(kubernetes=KubernetesDiscovery(
        prefill_selector=PRE_SEL, decode_selector=DEC_SEL))).validate().discovery)
    assert [(s.label, s.role) for s in ok] == [(f"k8s:{PRE_SEL}", P), (f"k8s:{DEC_SEL}", D)]
    assert all(isinstance(s, KubernetesSource) and not s.plain_http for s in ok)


def test_discovery_follows_pods_through_the_watch(sa: Path) -> None:
    """Real fake-vLLM upstreams on 127.0.0.2-4 (one port, as pods share a containerPort); the
    discovery interval is a minute, so each change below is acted on because the watch woke
    discovery."""
    async def t() -> None:
        port = free_port()
        ips = {"prefill-0": "127.0.0.2", "decode-0": "127.0.0.3", "decode-1": "127.0.0.4"}
        servers = [TestServer(FakeVllm(n).app(), host=ip, port=port) for n, ip in ips.items()]
        for s in servers:
            await s.start_server()
        url_of = {n: f"http://{ip}:{port}" for n, ip in ips.items()}
        async with kube_api() as (api, api_url):
            api.add("prefill-0", PRE, ips["prefill-0"])
            api.add("decode-0", DEC, ips["decode-0"])
            cfg = ProxyConfig(
                discovery=DiscoveryConfig(interval_s=60, timeout_s=1.0),
                health=HealthConfig(interval_s=0.2, timeout_s=0.5)).validate()
            reg = Registry(cfg)
            metrics = Metrics(cfg.slo)
            srcs = [source(api_url, sa, PRE_SEL, P, port), source(api_url, sa, DEC_SEL, D, port)]
            disc = Discovery(cfg.discovery, reg, drain_timeout_s=5.0, sources=list(srcs),
                             on_error=lambda s: metrics.discovery_error(s.role.value, s.label))
            try:
                await disc.start()
                assert set(reg.instances) == {url_of["prefill-0"], url_of["decode-0"]}
                assert reg.get(url_of["decode-0"]).healthy  # probed, as an admin add does
                assert reg.get(url_of["prefill-0"]).role is P
                # a pod scheduled, then ready: added within moments, not at the next interval
                api.add("decode-1", DEC, ips["decode-1"], ready=False)
                await asyncio.sleep(0.2)
                assert url_of["decode-1"] not in reg.instances
                t0 = time.monotonic()
                api.set_ready("decode-1", True)
                await until(lambda: url_of["decode-1"] in reg.instances, "decode-1 added")
                assert time.monotonic() - t0 < 3.0
                await until(lambda: reg.get(url_of["decode-1"]).probed, "decode-1 probed")
                assert reg.get(url_of["decode-1"]).healthy
                # kubectl delete decode-0 with a leg in flight: drained at once, removed when
                # its leg ends
                d0 = reg.get(url_of["decode-0"])
                d0.start(Side.DECODE, 10)
                api.terminate("decode-0")
                await until(lambda: d0.state is State.DRAINING, "decode-0 draining")
                await asyncio.sleep(0.2)
                assert url_of["decode-0"] in reg.instances  # waits for the leg
                d0.finish(Side.DECODE, 10, Outcome.OK)
                await until(lambda: url_of["decode-0"] not in reg.instances, "decode-0 removed")
                assert d0.state is State.REMOVED
                api.delete("decode-0")
                # a prefill pod turning unready (its readiness probe fails): drained, removed
                api.set_ready("prefill-0", False)
                await until(lambda: url_of["prefill-0"] not in reg.instances, "prefill-0 out")
                # the API fails: members stay, errors are counted
                api.fail_status = 503
                api.drop_watches()
                await until(lambda: all(s._error for s in srcs), "the failed resumes")
                await disc.sync()
                assert set(reg.instances) == {url_of["decode-1"]}
                text = metrics.render(reg)
                assert (
                    f'kvdisagg_proxy_discovery_errors_total{{side="decode",source="k8s:{DEC_SEL}"}}'
                    in text
                )
                # back: the prefill pod is ready again
                api.fail_status = None
                api.set_ready("prefill-0", True)
                await until(lambda: url_of["prefill-0"] in reg.instances, "prefill-0 back")
                assert set(reg.instances) == {url_of["prefill-0"], url_of["decode-1"]}
                assert disc.owned == {url_of["prefill-0"]: P, url_of["decode-1"]: D}
                assert all(reg.get(x).state is State.ACTIVE for x in reg.instances)
            finally:
                await disc.close()
                await reg.close()
                for s in servers:
                    await s.close()
        assert all(s._task is None for s in srcs)  # closed with discovery
    run(t())
