"""Fleet discovery (issue 11 part 2): parsing, the membership diff, failures keeping members,
config bounds, and the proxy following a loopback DNS server while it serves requests."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvdisagg.errors import ConfigError
from kvdisagg.local.servers import free_port
from kvdisagg.proxy import make_app
from kvdisagg.proxy.app import DISCOVERY, REGISTRY
from kvdisagg.proxy.cli import add_arguments, config_from_args
from kvdisagg.proxy.config import (
    DecisionConfig,
    DiscoveryConfig,
    HealthConfig,
    InstanceSpec,
    KubernetesDiscovery,
    ProxyConfig,
    TimeoutConfig,
    load_config_file,
)
from kvdisagg.proxy.fleet.discovery import (
    Discovery,
    DiscoveryError,
    DnsSource,
    Target,
    address_urls,
    desired,
    parse_target,
    reconcile,
    srv_urls,
)
from kvdisagg.proxy.fleet.registry import Outcome, Registry, State
from kvdisagg.proxy.metrics import Metrics
from kvdisagg.proxy.types import Role, Side
from tests.support.fake_vllm import FakeVllm


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# a real DNS server on loopback (UDP), answers changed by the test
class DnsServer(asyncio.DatagramProtocol):
    """``records[(name, type)]``: rdata texts (``"127.0.0.1"``, ``"0 0 8100 127.0.0.1."``);
    a name in ``nxdomain`` answers NXDOMAIN; ``down`` drops every query (a dead server).
    Any other query is NOERROR with no records."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], list[str]] = {}
        self.nxdomain: set[str] = set()
        self.down = False
        self.queries = 0
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.queries += 1
        if self.down or self.transport is None:
            return
        q = dns.message.from_wire(data)
        resp = dns.message.make_response(q)
        resp.flags |= dns.flags.AA
        question = q.question[0]
        name = question.name.to_text().rstrip(".")
        rtype = dns.rdatatype.to_text(question.rdtype)
        if name in self.nxdomain:
            resp.set_rcode(dns.rcode.NXDOMAIN)
        elif self.records.get((name, rtype)):
            resp.answer.append(dns.rrset.from_text_list(
                question.name, 5, "IN", rtype, self.records[(name, rtype)]))
        self.transport.sendto(resp.to_wire(), addr)

    @property
    def address(self) -> str:
        assert self.transport is not None
        return f"127.0.0.1:{self.transport.get_extra_info('sockname')[1]:d}"


@contextlib.asynccontextmanager
async def dns_server() -> AsyncIterator[DnsServer]:
    srv = DnsServer()
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: srv, local_addr=("127.0.0.1", 0))
    try:
        yield srv
    finally:
        transport.close()


# parsing
def test_targets_parse_a_and_srv_forms() -> None:
    assert parse_target("vllm-decode.ns.svc:8200") == Target("vllm-decode.ns.svc", 8200, False)
    assert parse_target("[::1]:8200") == Target("::1", 8200, False)
    assert parse_target("srv:_http._tcp.vllm-decode") == Target("_http._tcp.vllm-decode",
                                                                None, True)
    for bad, why in (("vllm-decode", "host:port"), ("d:0", "1-65535"), ("d:x", "not a number"),
                     ("srv:", "SRV form"), ("srv:_http._tcp.d:80", "SRV form"),
                     ("::1:80", "IPv6")):
        with pytest.raises(ValueError, match=why):
            parse_target(bad)


def test_record_parsing_builds_urls() -> None:
    assert srv_urls([("pod-1.d.ns.svc.cluster.local.", 8200), ("10.0.0.2.", 8201), (".", 0),
                     ("pod-1.d.ns.svc.cluster.local.", 8200)]) == [
        "http://10.0.0.2:8201", "http://pod-1.d.ns.svc.cluster.local:8200"]
    assert address_urls(["10.0.0.9", "10.0.0.1", "fd00::1", "10.0.0.1"], 8100) == [
        "http://10.0.0.1:8100", "http://10.0.0.9:8100", "http://[fd00::1]:8100"]


# the diff
P, D = Role.PREFILL, Role.DECODE


def test_plan_adds_new_drains_vanished_and_leaves_static_alone() -> None:
    static = "http://static:1"
    owned = {"http://d1:1": D, "http://d2:1": D}
    want = {"http://d2:1": D, "http://d3:1": D, static: D, "http://p1:1": P}
    p = reconcile(want, owned, present=[static, *owned], draining=[])
    assert [(s.url, s.role) for s in p.add] == [("http://d3:1", D), ("http://p1:1", P)]
    assert p.drain == ["http://d1:1"] and p.undrain == []
    # the static member vanishing from DNS is not drained: discovery does not own it
    p = reconcile({}, owned, present=[static, *owned], draining=[])
    assert sorted(p.drain) == ["http://d1:1", "http://d2:1"] and p.add == []
    # a member back while its drain runs is undrained, not added twice nor drained again
    p = reconcile({"http://d1:1": D}, owned, present=owned, draining=["http://d1:1"])
    assert p.undrain == ["http://d1:1"] and p.add == [] and p.drain == ["http://d2:1"]
    # a member that changed role is drained (and added again once removed)
    assert reconcile({"http://d1:1": P}, {"http://d1:1": D}, ["http://d1:1"], []).drain == [
        "http://d1:1"]


def test_desired_keeps_first_role_for_a_url_listed_twice() -> None:
    want, clash = desired([(P, ["http://a:1"]), (D, ["http://a:1", "http://b:1"])])
    assert want == {"http://a:1": P, "http://b:1": D} and clash == ["http://a:1"]


class FakeSource:
    def __init__(self, role: Role, urls: list[str], label: str = "fake") -> None:
        self.role, self.urls, self.label = role, urls, label
        self.fail: str | None = None

    async def resolve(self) -> list[str]:
        if self.fail:
            raise DiscoveryError(self.fail)
        return list(self.urls)

    def subscribe(self, on_change: Any) -> None:
        pass

    async def close(self) -> None:
        pass


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # refused: probes fail fast


def test_failure_keeps_members_and_empty_answer_drains_them() -> None:
    async def t() -> None:
        static = dead_url()
        cfg = ProxyConfig(instances=[InstanceSpec(url=static, role=D)],
                          health=HealthConfig(timeout_s=0.5)).validate()
        reg = Registry(cfg)
        reg.add(cfg.instances[0])
        metrics = Metrics(cfg.slo)
        a, b = dead_url(), dead_url()
        src = FakeSource(D, [a, b, static], "srv:_http._tcp.d")
        disc = Discovery(cfg.discovery, reg, drain_timeout_s=1.0, sources=[src],
                         on_error=lambda s: metrics.discovery_error(s.role.value, s.label))
        p = await disc.sync()
        assert [s.url for s in p.add] == [a, b]  # the static one is not added twice
        assert set(reg.instances) == {static, a, b} and reg.get(a).probed  # probed like admin add
        src.fail = "NXDOMAIN"
        for _ in range(3):
            p = await disc.sync()
            assert p == ([], [], [])
        assert set(reg.instances) == {static, a, b}
        text = metrics.render(reg)
        assert ('kvdisagg_proxy_discovery_errors_total{side="decode",'
                'source="srv:_http._tcp.d"} 3') in text
        src.fail, src.urls = None, [b]
        p = await disc.sync()
        assert p.drain == [a]
        await asyncio.gather(*disc.drains.values())
        assert set(reg.instances) == {static, b} and a not in disc.owned
        src.urls = []  # a successful empty answer: every discovered member goes; static stays
        await disc.sync()
        await asyncio.gather(*disc.drains.values())
        assert set(reg.instances) == {static} and disc.owned == {}
        await disc.close()
        await reg.close()
    run(t())


def test_vanished_member_waits_for_its_legs_and_comes_back_undrained() -> None:
    async def t() -> None:
        cfg = ProxyConfig(health=HealthConfig(timeout_s=0.5)).validate()
        reg = Registry(cfg)
        a = dead_url()
        src = FakeSource(D, [a])
        disc = Discovery(cfg.discovery, reg, drain_timeout_s=5.0, sources=[src])
        await disc.sync()
        inst = reg.get(a)
        inst.start(Side.DECODE, 10)  # a leg in flight
        src.urls = []
        await disc.sync()
        await asyncio.sleep(0.05)
        assert inst.state is State.DRAINING and a in reg.instances  # waits for the leg
        src.urls = [a]
        p = await disc.sync()
        assert p.undrain == [a] and inst.state is State.ACTIVE and not disc.drains
        src.urls = []
        await disc.sync()
        await asyncio.sleep(0.05)
        inst.finish(Side.DECODE, 10, Outcome.OK)
        await asyncio.gather(*disc.drains.values())
        assert a not in reg.instances and inst.state is State.REMOVED
        await disc.close()
        await reg.close()
    run(t())


# config
BAD = [
    (DiscoveryConfig(interval_s=0), "discovery.interval_s", "got 0"),
    (DiscoveryConfig(timeout_s=-1), "discovery.timeout_s", "got -1"),
    (DiscoveryConfig(decode_dns=["d:1", "nope"]), "discovery.decode_dns[1]", "host:port"),
    (DiscoveryConfig(prefill_dns=["p:70000"]), "discovery.prefill_dns[0]", "1-65535"),
    (DiscoveryConfig(nameservers=["127.0.0.1"]), "discovery.nameservers[0]", "host:port"),
    (DiscoveryConfig(kubernetes=KubernetesDiscovery(port=0)), "discovery.kubernetes.port",
     "got 0"),
]


@pytest.mark.parametrize(("d", "key", "what"), BAD, ids=[b[1] for b in BAD])
def test_bad_discovery_config_names_its_key(d: DiscoveryConfig, key: str, what: str) -> None:
    with pytest.raises(ConfigError) as err:
        ProxyConfig(discovery=d).validate()
    assert str(err.value).startswith(f"{key}: ") and what in str(err.value), str(err.value)


def test_discovery_from_file_and_flags(tmp_path: Path) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_text("discovery:\n  prefill_dns: ['vllm-prefill:8100']\n  interval_s: 2\n"
                 "  nameservers: ['10.96.0.10:53']\n")
    cfg = load_config_file(f).validate()
    assert cfg.discovery.interval_s == 2 and cfg.discovery.enabled
    f.write_text("discovery: {interval_s: 0}\n")
    with pytest.raises(ConfigError, match=r"discovery.interval_s: .*got 0"):
        load_config_file(f)
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args([
        "--prefill", "http://p0:8100", "--prefill-dns", "vllm-prefill:8100",
        "--decode-dns", "srv:_http._tcp.vllm-decode", "--decode-dns", "vllm-d2:8200"]))
    assert cfg.discovery.prefill_dns == ["vllm-prefill:8100"]
    assert cfg.discovery.decode_dns == ["srv:_http._tcp.vllm-decode", "vllm-d2:8200"]
    assert [i.url for i in cfg.instances] == ["http://p0:8100"]
    with pytest.raises(ConfigError, match=r"discovery.decode_dns\[0\]"):
        config_from_args(p.parse_args(["--decode-dns", "vllm-decode"]))
    assert not ProxyConfig().discovery.enabled


# the resolver against a real DNS server
def test_dns_source_reads_a_aaaa_srv_and_reports_failures() -> None:
    async def t() -> None:
        async with dns_server() as srv:
            cfg = ProxyConfig(discovery=DiscoveryConfig(nameservers=[srv.address],
                                                        timeout_s=0.3)).validate().discovery
            srv.records[("p.test", "A")] = ["10.0.0.2", "10.0.0.1"]
            srv.records[("p.test", "AAAA")] = ["fd00::5"]
            srv.records[("_http._tcp.d.test", "SRV")] = ["0 0 8201 10.0.0.7.",
                                                         "0 0 8202 pod-2.d.test."]
            a = DnsSource(parse_target("p.test:8100"), P, cfg)
            s = DnsSource(parse_target("srv:_http._tcp.d.test"), D, cfg)
            assert await a.resolve() == ["http://10.0.0.1:8100", "http://10.0.0.2:8100",
                                         "http://[fd00::5]:8100"]
            assert await s.resolve() == ["http://10.0.0.7:8201", "http://pod-2.d.test:8202"]
            srv.records[("p.test", "A")] = []
            srv.records[("p.test", "AAAA")] = []
            assert await a.resolve() == []  # NOERROR, no records: a real empty answer
            srv.nxdomain.add("p.test")
            with pytest.raises(DiscoveryError, match="NXDOMAIN"):
                await a.resolve()
            srv.down = True
            t0 = time.monotonic()
            with pytest.raises(DiscoveryError):
                await s.resolve()
            assert time.monotonic() - t0 < 2.0  # bounded by timeout_s
            lit = DnsSource(parse_target("127.0.0.1:9"), D, cfg)
            assert await lit.resolve() == ["http://127.0.0.1:9"]
    run(t())


# end to end on loopback: the proxy follows DNS while it serves
def test_proxy_follows_dns_under_load_without_failing_a_request() -> None:
    async def t() -> None:
        fakes = {n: FakeVllm(n) for n in ("p0", "d0", "d1", "d2")}
        servers = {n: TestServer(f.app(), host="127.0.0.1") for n, f in fakes.items()}
        for s in servers.values():
            await s.start_server()
        port = {n: s.port for n, s in servers.items()}
        url = {n: f"http://127.0.0.1:{p}" for n, p in port.items()}
        async with dns_server() as srv:
            srv.records[("prefill.test", "A")] = ["127.0.0.1"]
            srv.records[("_http._tcp.decode.test", "SRV")] = [
                f"0 0 {port['d0']} 127.0.0.1.", f"0 0 {port['d1']} 127.0.0.1."]
            cfg = ProxyConfig(
                discovery=DiscoveryConfig(prefill_dns=[f"prefill.test:{port['p0']}"],
                                          decode_dns=["srv:_http._tcp.decode.test"],
                                          nameservers=[srv.address], interval_s=0.1,
                                          timeout_s=0.3),
                health=HealthConfig(interval_s=0.2, timeout_s=0.5, startup_timeout_s=2.0),
                timeouts=TimeoutConfig(prefill_s=2.0, decode_connect_s=2.0, decode_total_s=5.0,
                                       decode_idle_s=1.0),
                decision=DecisionConfig(enabled=False),  # prefill gets every request
                drain_timeout_s=2.0)
            app = make_app(config=cfg)
            client = TestClient(TestServer(app, host="127.0.0.1"))
            await client.start_server()
            reg, disc = app[REGISTRY], app[DISCOVERY]
            statuses: list[int] = []
            stop = asyncio.Event()

            async def load() -> None:
                body = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
                while not stop.is_set():
                    r = await client.post("/v1/completions", json=body)
                    await r.read()
                    statuses.append(r.status)

            workers: list[asyncio.Task[None]] = []
            try:
                assert set(reg.instances) == {url["p0"], url["d0"], url["d1"]}
                workers = [asyncio.create_task(load()) for _ in range(4)]
                await asyncio.sleep(0.3)
                # a decode appears, another vanishes, both in one DNS change
                srv.records[("_http._tcp.decode.test", "SRV")] = [
                    f"0 0 {port['d1']} 127.0.0.1.", f"0 0 {port['d2']} 127.0.0.1."]
                deadline = time.monotonic() + 5
                while url["d0"] in reg.instances and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert url["d0"] not in reg.instances and url["d2"] in reg.instances
                d0_after_removal = len(fakes["d0"].seen)
                d2_before = len(fakes["d2"].seen)
                # the DNS server goes down: members stay, errors are counted
                srv.down = True
                await asyncio.sleep(1.0)
                assert set(reg.instances) == {url["p0"], url["d1"], url["d2"]}
                srv.down = False
                await asyncio.sleep(0.3)
                stop.set()
                await asyncio.gather(*workers)
                assert statuses and set(statuses) == {200}, sorted(set(statuses))
                assert len(fakes["d0"].seen) == d0_after_removal  # no work after removal
                assert len(fakes["d2"].seen) > d2_before  # the new member gets traffic
                assert len(statuses) > 50
                assert fakes["d1"].seen and fakes["p0"].seen
                m = await (await client.get("/metrics")).text()
                assert 'kvdisagg_proxy_discovery_errors_total{side="decode"' in m
                assert disc.owned == {url["p0"]: P, url["d1"]: D, url["d2"]: D}
            finally:
                stop.set()
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                await client.close()
                for s in servers.values():
                    await s.close()
    run(t())
