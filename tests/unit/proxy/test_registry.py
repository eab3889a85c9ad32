"""Who is in the fleet (proxy/registry.py), against fake vLLM upstreams on loopback: the listeners
told of members. (Health probes are tested through requests in test_serving.py.)"""

from __future__ import annotations

from tests.support.proxy_harness import proxy, run


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
