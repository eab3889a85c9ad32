"""Who is in the fleet (proxy/fleet/registry.py), against fake vLLM upstreams on loopback: the
listeners told of members. (Health probes are tested through requests in test_serving.py.)"""

from __future__ import annotations

from tests.support.proxy_harness import proxy, run


def test_the_registry_tells_its_listeners_of_members() -> None:
    from kvdisagg.proxy.app import REGISTRY
    from kvdisagg.proxy.config import InstanceSpec
    from kvdisagg.proxy.fleet.registry import MemberEvent
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


def test_an_instances_protocol_versions_from_its_gauges_and_from_handoff_params() -> None:
    from kvdisagg.connector.protocol.versions import Versions
    from kvdisagg.proxy.fleet.registry import handoff_versions, probe_samples, protocol_versions

    def parse_protocol(text: bytes) -> Versions | None:
        return protocol_versions(probe_samples(text))

    both = (b'# HELP vllm:kvdisagg_protocol_version The newest ...\n'
            b'vllm:kvdisagg_protocol_version{engine="0",model_name="m"} 5.0\n'
            b'vllm:kvdisagg_protocol_version_min{engine="0",model_name="m"} 4.0\n')
    assert parse_protocol(both) == Versions(4, 5)
    # Engines of one instance (data parallel) that differ: what all of them speak.
    assert parse_protocol(both + b'vllm:kvdisagg_protocol_version{engine="1"} 6.0\n'
                          b'vllm:kvdisagg_protocol_version_min{engine="1"} 5.0\n') == \
        Versions(5, 5)
    assert parse_protocol(b"vllm:kvdisagg_protocol_version 6.0\n") == Versions(6, 6)
    assert parse_protocol(b'vllm:num_requests_waiting{engine="0"} 0.0\n') is None
    assert handoff_versions(b'{"kvdisagg": {"version": 6, "min_version": 4, "token": "t"}}') \
        == Versions(4, 6)
    assert handoff_versions(b'{"kvdisagg": {"version": 5}}') == Versions(5, 5)
    for unknown in (None, b'{"remote_host": "h"}', b"not json", b'{"kvdisagg": 3}'):
        assert handoff_versions(unknown) is None
