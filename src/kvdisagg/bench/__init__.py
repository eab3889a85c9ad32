"""``kvdisagg bench`` and ``kvdisagg profile``: measure an OpenAI-compatible endpoint under load.

An open-loop load generator (Poisson arrivals or a replayed trace) streams every request so that
TTFT and each inter-token gap are seen at the client; SLO attainment, goodput and a rate sweep
are computed from the per-request records. The package talks HTTP only: it must not import
``vllm`` (``tests/unit/bench/test_layering.py`` guards this), so it runs on any client machine.

Modules: ``records`` (the JSON-lines and summary Structs), ``workload`` (lengths, arrivals and
the dataset format), ``client`` (one streamed request), ``runner`` (one open-loop run),
``attainment`` (percentiles, SLO judgement, attainment, goodput), ``sweep`` (the highest rate
meeting a target), ``scrape`` (the proxy's /metrics), ``plots``, ``report`` (tables and
progress), ``profiler`` (latency samples for the planner), and the two CLI modules ``cli`` and
``profile_cli``.
"""
