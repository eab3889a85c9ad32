"""A fleet in the middle of a rolling upgrade, on real vLLM (docs/operations.md "Rolling
upgrades"): prefill 0 and the decode of this release (side-channel protocol MIN..PROTOCOL_VERSION),
prefill 1 announcing only the next release's version (``protocol_version_override``, a test
setting: it speaks no version the decode speaks). The session's prefill and decode, one
upgraded prefill started here, and a proxy of their own.

Every request succeeds, token-identical to a plain instance (the session's); each one's KV moved
(decode's pull counter), from prefill 0 only: the proxy never pairs prefill 1 with the decode.
A proxy whose only prefill is prefill 1 lets decode serve every request alone, counted as
``no_compatible_prefill``, and still answers as the plain instance does.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvdisagg.connector.protocol.versions import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION
from kvdisagg.local.fleet import Fleet, kv_transfer_args, running_proxy
from kvdisagg.local.servers import VllmServer

from .conftest import (
    LOG_DIR,
    completion_tokens,
    metric,
    plain_tokens,
    prompt_ids,
    wait_handoffs_freed,
)

pytestmark = pytest.mark.e2e

NEXT = PROTOCOL_VERSION + 1  # what prefill 1 announces: a release this decode cannot speak to
REQUESTS = 8


class MixedFleet:
    """The session's prefill and decode (this release) plus one prefill of the next release,
    behind a proxy of their own."""

    def __init__(self, session: Fleet, upgraded: VllmServer) -> None:
        self.prefills = [session.prefill, upgraded]
        self.decode = session.decode
        self.log_dir = LOG_DIR / "upgrade"
        self.session = session
        self.proxy_url = ""

    def wait_proxy_ready(self, url: str) -> None:
        self.session.wait_proxy_ready(url=url)


@pytest.fixture(scope="module")
def fleet(model, session_fleet) -> Iterator[MixedFleet]:
    """One instance more than the session's: the upgraded prefill (on prefill's core)."""
    log_dir = LOG_DIR / "upgrade"
    upgraded = VllmServer(model, log_path=log_dir / "prefill-next.log", omp_threads_bind="0",
                          worker_in_engine=True,
                          extra_args=kv_transfer_args("kv_producer", {
                              "protocol_version_override": NEXT, "lease_seconds": 8.0}))
    upgraded.start()
    try:
        upgraded.wait_ready(900)
        mixed = MixedFleet(session_fleet, upgraded)
        with proxy_of(mixed, [p.base_url for p in mixed.prefills], "proxy-mixed") as url:
            mixed.proxy_url = url
            yield mixed
    finally:
        upgraded.stop()


def bodies(seed: int, n: int) -> list[dict[str, Any]]:
    """Long prompts (disaggregated whatever the decision), streamed and not."""
    return [{"model": "tiny", "prompt": prompt_ids(300 + 50 * (i % 3), seed=seed + i),
             "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
             "stream": i % 2 == 1}
            for i in range(n)]


def wait_for(what: str, cond: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
        time.sleep(0.25)


def wait_versions_known(proxy_url: str, want: dict[str, tuple[int, int]]) -> None:
    """Until the proxy's probes read each instance's protocol versions (its /metrics)."""
    for url, (lo, hi) in want.items():
        wait_for(f"the proxy knows {url} speaks {lo}..{hi}", lambda url=url, lo=lo, hi=hi: (
            metric(proxy_url, "kvdisagg_proxy_instance_protocol_version",
                   instance=url, bound="min") == lo
            and metric(proxy_url, "kvdisagg_proxy_instance_protocol_version",
                       instance=url, bound="max") == hi))


def pulls(fleet) -> float:
    return metric(fleet.decode.base_url, "vllm:kvdisagg_pulls_total")


def decode_metric(fleet, name: str) -> float:
    return metric(fleet.decode.base_url, name)


def proxy_of(fleet, prefills: list[str], name: str) -> contextlib.AbstractContextManager[str]:
    """Another ``kvdisagg proxy`` in front of ``prefills`` and the fleet's decode (each request
    through prefill, as the fleet's own); its log is ``<name>.log``. Yields its URL."""
    return running_proxy(prefills, [fleet.decode.base_url], ["--always-disaggregate"],
                         fleet.log_dir / f"{name}.log")


def test_each_instance_announces_the_versions_it_speaks(fleet):
    """On its own /metrics, from start (no request needed): what the proxy reads."""
    for server, (lo, hi) in ((fleet.prefills[0], (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)),
                             (fleet.prefills[1], (NEXT, NEXT)),
                             (fleet.decode, (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION))):
        assert metric(server.base_url, "vllm:kvdisagg_protocol_version_min") == lo, server
        assert metric(server.base_url, "vllm:kvdisagg_protocol_version") == hi, server


@pytest.mark.timeout(900)
def test_a_mixed_fleet_serves_every_request_pairing_only_instances_that_speak_together(
        fleet, plain):
    current, upgraded = fleet.prefills
    wait_versions_known(fleet.proxy_url, {
        current.base_url: (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION), upgraded.base_url: (NEXT, NEXT),
        fleet.decode.base_url: (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)})
    items = bodies(7000, REQUESTS)
    expected = plain_tokens(plain, items)
    pulls0 = pulls(fleet)
    offered0 = [metric(p.base_url, "vllm:kvdisagg_handoffs_offered_total")
                for p in fleet.prefills]
    legs0 = [metric(fleet.proxy_url, "kvdisagg_proxy_instance_requests_total",
                    instance=p.base_url, side="prefill") for p in fleet.prefills]
    routed0 = metric(fleet.proxy_url, "kvdisagg_proxy_routed_total", route="pd")
    # the session's decode: what other modules did before is counted already
    failures0 = decode_metric(fleet, "vllm:kvdisagg_pull_failures_total")
    recomputed0 = decode_metric(fleet, "vllm:kvdisagg_recomputed_prompts_total")

    with ThreadPoolExecutor(4) as pool:  # prefill's round robin would alternate the two
        results = list(pool.map(lambda b: completion_tokens(fleet.proxy_url, b, 300), items))
    assert results == [("ok", e) for e in expected]

    # Each request's KV moved from prefill 0; prefill 1 never got a leg, never offered KV.
    wait_for("every KV pulled", lambda: pulls(fleet) - pulls0 >= REQUESTS)
    assert pulls(fleet) - pulls0 == REQUESTS
    assert decode_metric(fleet, "vllm:kvdisagg_pull_failures_total") == failures0
    assert decode_metric(fleet, "vllm:kvdisagg_recomputed_prompts_total") == recomputed0
    assert metric(fleet.proxy_url, "kvdisagg_proxy_routed_total", route="pd") - routed0 \
        == REQUESTS
    legs = [metric(fleet.proxy_url, "kvdisagg_proxy_instance_requests_total",
                   instance=p.base_url, side="prefill") - before
            for p, before in zip(fleet.prefills, legs0)]
    assert legs == [REQUESTS, 0]
    offered = [metric(p.base_url, "vllm:kvdisagg_handoffs_offered_total") - before
               for p, before in zip(fleet.prefills, offered0)]
    assert offered == [REQUESTS, 0]
    offered_total, freed = wait_handoffs_freed(current.base_url)
    assert offered_total == freed


@pytest.mark.timeout(900)
def test_with_no_prefill_in_common_decode_serves_alone_counted(fleet, plain):
    """The decode's only prefill announces a version it does not speak: no request goes to
    that prefill (a handoff could not be pulled); decode computes each one, as the plain
    instance answers it, and the proxy counts why."""
    upgraded = fleet.prefills[1]
    items = bodies(8000, 4)
    expected = plain_tokens(plain, items)
    pulls0 = pulls(fleet)
    offered0 = metric(upgraded.base_url, "vllm:kvdisagg_handoffs_offered_total")
    with proxy_of(fleet, [upgraded.base_url], "proxy-upgraded-only") as url:
        wait_versions_known(url, {upgraded.base_url: (NEXT, NEXT), fleet.decode.base_url:
                                  (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)})
        results = [completion_tokens(url, b, 300) for b in items]
        assert results == [("ok", e) for e in expected]
        assert metric(url, "kvdisagg_proxy_routed_total", route="decode_only",
                      reason="no_compatible_prefill") == len(items)
        assert metric(url, "kvdisagg_proxy_instance_requests_total",
                      instance=upgraded.base_url, side="prefill") == 0
    assert pulls(fleet) == pulls0
    assert metric(upgraded.base_url, "vllm:kvdisagg_handoffs_offered_total") == offered0
