"""The connector's stats (connector/stats.py): observations from several workers aggregate, and
reduce to what vLLM logs and exports."""


def test_phase_observations_aggregate_across_workers_and_reduce_to_means():
    from kvdisagg.connector.stats import DisaggStats

    a, b = DisaggStats(), DisaggStats()
    a.observe(transfer=0.002, read=0.001)
    b.observe(transfer=0.004)
    b.add(pulls=2)
    assert DisaggStats().is_empty() and not b.is_empty()
    merged = a.aggregate(b)
    assert merged.data["phase_seconds"] == {"transfer": [0.002, 0.004], "read": [0.001]}
    out = merged.reduce()
    assert out["transfer_ms_mean"] == 3.0 and out["read_ms_mean"] == 1.0 and out["pulls"] == 2
    assert "phase_seconds" not in out


def test_recomputed_counts_aggregate_and_reduce():
    from kvdisagg.connector.stats import DisaggStats

    a, b = DisaggStats(), DisaggStats()
    assert a.is_empty()
    a.recomputed("load_failed")
    b.recomputed("load_failed")
    b.recomputed("not_read")
    assert not b.is_empty()
    a.aggregate(b)
    assert a.reduce()["recomputed_load_failed"] == 2 and a.reduce()["recomputed_not_read"] == 1


def test_the_instance_exports_the_protocol_versions_it_speaks_as_the_proxy_reads_them():
    """Set when vLLM's API server builds the metrics (before any step): a new process's first
    scrape has them. Rendered by prometheus_client as vLLM does, read by the proxy's parser."""
    import functools
    import types

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kvdisagg.connector.protocol.versions import SPOKEN, Versions
    from kvdisagg.connector.stats import DisaggPromMetrics
    from kvdisagg.proxy.fleet.registry import probe_samples, protocol_versions

    for extra, want in (({}, SPOKEN), ({"protocol_version_override": 9}, Versions(9, 9))):
        registry = CollectorRegistry()
        types_ = {cls: functools.partial(cls, registry=registry)
                  for cls in (Gauge, Counter, Histogram)}
        config = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(
            kv_connector_extra_config=extra))
        DisaggPromMetrics(config, types_, ["model_name", "engine"],
                          {0: ["tiny", "0"], 1: ["tiny", "1"]})
        text = generate_latest(registry)
        assert b'vllm:kvdisagg_protocol_version{engine="1",model_name="tiny"}' in text
        assert protocol_versions(probe_samples(text)) == want
