"""kvdisagg: prefill/decode disaggregated serving for vLLM.

Its parts (docs/architecture.md draws them): ``connector/`` (DisaggConnector, loaded inside
vLLM) with ``transport/`` (moves KV bytes between workers), ``proxy/`` (the OpenAI-compatible
front door: the per-request decision, the handoff, routing by cache, failover and migration),
``slo_scheduler.py`` (a vLLM scheduler plugin), ``bench/`` and ``planner/`` (goodput measured and
planned), ``local/`` (a fleet of real vLLM processes on one host, for the demo) and
``doctor.py``; ``compat/`` holds the few private APIs of dependencies we reach.
"""

__version__ = "0.1.0"
