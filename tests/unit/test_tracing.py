"""kvdisagg.tracing: which traceparent strings are taken (anything else is dropped unparsed), the
disabled tracer's no-ops, and spans exported over OTLP/HTTP to a loopback collector
(tests/support/otlp_sink.py): nesting under a remote parent, attributes, events, given times,
the remote parent's sampled flag, and the endpoint forms ``otlp_traces_endpoint`` accepts."""

from __future__ import annotations

import pytest

from kvdisagg.tracing import Tracer, end, event, traceparent_of, valid_traceparent
from tests.support.otlp_sink import OtlpSink

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT = f"00-{TRACE}-00f067aa0ba902b7-01"


@pytest.mark.parametrize("value", [
    CLIENT,
    f"00-{TRACE}-00f067aa0ba902b7-00",  # not sampled: still a valid context
])
def test_w3c_traceparents_are_taken_as_they_are(value: str) -> None:
    assert valid_traceparent(value) == value


@pytest.mark.parametrize("value", [
    None, 7, b"00-" + TRACE.encode() + b"-00f067aa0ba902b7-01", "",
    CLIENT.upper(),  # upper-case hex
    "01" + CLIENT[2:],  # another version
    CLIENT[:-2] + "02",  # flags we do not know
    CLIENT[:-3],  # no flags
    "00-" + TRACE[:-1] + "-00f067aa0ba902b7-01",  # a short trace id
    "00-" + TRACE + "-00f067aa0ba902b-01",  # a short span id
    CLIENT + "\n", " " + CLIENT, CLIENT + "-01",  # anything around it
    "00-x; rm -rf /",
])
def test_anything_else_is_dropped(value: object) -> None:
    assert valid_traceparent(value) == ""


def test_a_disabled_tracer_makes_nothing_and_its_helpers_accept_none() -> None:
    for tracer in (Tracer.disabled(), Tracer.otlp("", "svc")):
        assert not tracer.enabled
        assert tracer.start("x", CLIENT) is None
        assert tracer.record("x", CLIENT, 1, 2) == ""
        end(None, outcome="ok")
        event(None, "first_token")
        assert traceparent_of(None) == ""
        tracer.shutdown()


@pytest.mark.parametrize("suffix", ["", "/", "/v1/traces"])
def test_spans_nest_under_the_remote_parent_and_reach_the_collector(suffix: str) -> None:
    with OtlpSink() as sink:
        tracer = Tracer.otlp(sink.url + suffix, "kvdisagg-test")
        assert tracer.enabled
        root = tracer.start("kvdisagg.request", CLIENT, attributes={"kvdisagg.request_id": "r1"},
                            server=True)
        leg = tracer.start("decode_leg", traceparent_of(root), start_ns=1_000_000)
        event(leg, "first_token", at_ns=1_500_000)
        leg_ctx = traceparent_of(leg)
        load = tracer.record("kvdisagg.load", leg_ctx, 1_200_000, 1_800_000,
                             {"blocks": 3})
        end(leg, 2_000_000, outcome="ok")
        end(root, outcome="ok")
        tracer.shutdown()  # flushes what the batch processor holds
        spans = {s.name: s for s in sink.wait_for(lambda got: len(got) >= 3, timeout_s=10)}

    assert set(spans) == {"kvdisagg.request", "decode_leg", "kvdisagg.load"}
    req, dec, ld = spans["kvdisagg.request"], spans["decode_leg"], spans["kvdisagg.load"]
    assert {s.trace_id for s in spans.values()} == {TRACE}  # the client's trace, joined
    assert req.parent_id == "00f067aa0ba902b7"
    assert dec.parent_id == req.span_id and ld.parent_id == dec.span_id
    assert leg_ctx == f"00-{TRACE}-{dec.span_id}-01"
    assert load == f"00-{TRACE}-{ld.span_id}-01"  # what record() hands on names its span
    assert {s.service for s in spans.values()} == {"kvdisagg-test"}
    assert req.attributes == {"kvdisagg.request_id": "r1", "outcome": "ok"}
    assert dec.attributes == {"outcome": "ok"} and ld.attributes == {"blocks": 3}
    assert (dec.start_ns, dec.end_ns, dec.events) == (1_000_000, 2_000_000,
                                                      {"first_token": 1_500_000})
    assert (ld.start_ns, ld.end_ns) == (1_200_000, 1_800_000)


def test_a_parent_the_client_did_not_sample_is_followed_not_exported() -> None:
    with OtlpSink() as sink:
        tracer = Tracer.otlp(sink.url, "kvdisagg-test")
        unsampled = CLIENT[:-2] + "00"
        ctx = tracer.record("kvdisagg.request", unsampled, 1, 2)
        assert ctx.startswith(f"00-{TRACE}-") and ctx.endswith("-00")  # passed on, unsampled
        assert tracer.record("decode_leg", ctx, 1, 2).endswith("-00")
        sampled = tracer.record("kvdisagg.request", CLIENT, 1, 2)  # a sampled one, as a marker
        tracer.shutdown()
        spans = sink.wait_for(lambda got: len(got) >= 1, timeout_s=10)
    assert [(s.name, s.span_id) for s in spans] == [("kvdisagg.request", sampled[36:52])]
