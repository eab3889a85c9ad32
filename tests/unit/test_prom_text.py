"""kvdisagg.prom_text: the one reading of a /metrics page (prometheus_client's parser)."""

from __future__ import annotations

import pytest

from kvdisagg.prom_text import Sample, samples, total

TEXT = ('# HELP vllm:num_requests_waiting Requests waiting.\n'
        '# TYPE vllm:num_requests_waiting gauge\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0\n'
        '# TYPE vllm:e2e_seconds histogram\n'
        'vllm:e2e_seconds_bucket{le="1.0"} 4.0\n'
        'vllm:e2e_seconds_bucket{le="+Inf"} 5.0\n'
        'vllm:e2e_seconds_count 5.0\nvllm:e2e_seconds_sum 2.5\n'
        'kvdisagg_proxy_discovery_errors_total{source="k8s:app=\\"v\\"\\\\x"} 1\n')


def test_samples_keep_names_as_written_and_unescape_labels() -> None:
    found = samples(TEXT)
    assert found[0] == Sample("vllm:num_requests_waiting", {"engine": "0", "model_name": "m"}, 3.0)
    assert [s.name for s in found[2:6]] == ["vllm:e2e_seconds_bucket"] * 2 + [
        "vllm:e2e_seconds_count", "vllm:e2e_seconds_sum"]
    assert found[-1].labels == {"source": 'k8s:app="v"\\x'}
    assert samples(TEXT.encode()) == found and samples("") == []


def test_prefixes_keep_only_those_names() -> None:
    assert [s.value for s in samples(TEXT, ("vllm:num_requests_",))] == [3.0, 2.0]
    assert samples(TEXT, ("vllm:e2e_seconds_c",)) == [Sample("vllm:e2e_seconds_count", {}, 5.0)]


def test_total_sums_the_samples_whose_labels_match() -> None:
    found = samples(TEXT)
    assert total(found, "vllm:num_requests_waiting") == 5.0
    assert total(found, "vllm:num_requests_waiting", engine="1") == 2.0
    assert total(found, "vllm:num_requests_waiting", engine="9") is None
    assert total(found, "vllm:no_such_metric") is None


def test_text_that_is_not_the_format_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        samples("vllm:num_requests_waiting{engine=0} 3.0\n")
