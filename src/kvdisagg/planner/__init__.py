"""``kvdisagg plan`` and ``kvdisagg simulate``: DistServe-style placement planning on a simulator.

Modules: ``profile`` (the latency-model file format, fitting, DistServe import), ``latency``
(evaluating the model for one batch), ``trace`` (simulated traces: lengths and arrivals; a
dataset file is read by bench/workload.py, one format for both), ``simulator`` (discrete-event
disaggregated and colocated instances), ``goodput`` (attainment, the highest rate meeting a
target, the tightest SLO scale), ``search`` (placement search, high and low node affinity),
``commands`` (the ``vllm serve`` / ``kvdisagg proxy`` lines realizing a plan), and the CLI
modules ``plan_cli`` and ``simulate_cli``. The package must not import ``vllm``.
"""
