"""Who may get traffic (proxy/registry.py), against fake vLLM upstreams on loopback: health
probes, and the listeners told of members."""

from __future__ import annotations

import asyncio

from kvdisagg.proxy.config import HealthConfig
from tests.support.proxy_harness import GEN, metric, proxy, run


def test_health_probes_mark_unhealthy_and_recover() -> None:
    async def t() -> None:
        async with proxy(n_prefill=2, health=HealthConfig(interval_s=0.1, timeout_s=0.5,
                                                          failure_threshold=2,
                                                          success_threshold=2)) as env:
            env.prefill[1].health_status = 503
            await asyncio.sleep(0.6)
            r = await env.admin.get("/admin/list")
            rows = {i["url"]: i for i in (await r.json())["instances"]}
            assert rows[env.urls["p1"]]["healthy"] is False
            assert "503" in rows[env.urls["p1"]]["last_probe_error"]
            for _ in range(4):
                assert (await env.client.post("/v1/completions", json=GEN)).status == 200
            assert len(env.prefill[1].seen) == 0 and len(env.prefill[0].seen) == 4
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_instance_healthy", instance=env.urls["p1"]) == 0
            env.prefill[1].health_status = 200
            await asyncio.sleep(0.6)
            text = await env.metrics()
            assert metric(text, "kvdisagg_proxy_instance_healthy", instance=env.urls["p1"]) == 1
            for _ in range(4):
                assert (await env.client.post("/v1/completions", json=GEN)).status == 200
            assert len(env.prefill[1].seen) == 2
    run(t())


def test_the_registry_tells_its_listeners_of_members() -> None:
    from kvdisagg.proxy.app import REGISTRY
    from kvdisagg.proxy.config import InstanceSpec
    from kvdisagg.proxy.registry import MemberEvent
    from kvdisagg.proxy.types import Role

    async def t() -> None:
        async with proxy() as env:
            reg = env.client.server.app[REGISTRY]
            heard: list[tuple[MemberEvent, str]] = []
            reg.listeners.append(lambda e, i: heard.append((e, i.url)))
            inst = reg.add(InstanceSpec(url="http://127.0.0.1:9", role=Role.DECODE))
            await reg.probe(inst)  # refused: unhealthy
            inst.probe_result(True, None, reg.cfg)
            inst.probe_result(True, None, reg.cfg)
            reg.remove(inst.url)
            assert heard == [(MemberEvent.ADDED, inst.url), (MemberEvent.RECOVERED, inst.url),
                             (MemberEvent.REMOVED, inst.url)]
    run(t())
