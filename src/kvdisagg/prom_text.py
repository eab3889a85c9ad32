"""Reading Prometheus' text exposition (a ``/metrics`` page): prometheus_client's parser, the
only one kvdisagg uses, for the proxy's probes of vLLM, bench's scrapes, the demo and the tests.

    found = samples(text)                                   # every sample
    total(found, "vllm:num_requests_running", engine="0")   # their sum, or None
    samples(text, ("vllm:num_requests_",))                  # only names with these prefixes

Imports only prometheus_client (a dependency of every install); raises ValueError for text
that is not the exposition format.
"""

from __future__ import annotations

from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Sample", "samples", "total"]


class Sample(NamedTuple):
    """One sample: its name as written (``x_total``, ``h_bucket``), labels and value."""

    name: str
    labels: dict[str, str]
    value: float


def samples(text: str | bytes, prefixes: tuple[str, ...] = ()) -> list[Sample]:
    """The samples of ``text``, in order; ValueError if it is not the exposition format.

    ``prefixes``: only the samples whose names start with one of them. The other lines
    (comments included) are dropped before parsing, so reading a few gauges of a long page
    (vLLM's, with its histograms) costs a scan of its lines, not a parse of all of them.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if prefixes:
        text = "\n".join(line for line in text.splitlines() if line.startswith(prefixes))
    return [Sample(s.name, s.labels, float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def total(found: list[Sample], name: str, **labels: str) -> float | None:
    """Sum of ``name``'s samples whose labels include ``labels``; None if there is none."""
    values = [s.value for s in found
              if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(values) if values else None
