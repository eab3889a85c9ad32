"""kvdisagg: prefill/decode disaggregated serving for vLLM.

Its parts (docs/architecture.md draws them): ``connector/`` (DisaggConnector, loaded inside
vLLM, with its config, KV layout, sharding, checksums and the P->D protocol in
``connector/protocol/``) with ``transport/`` (moves KV bytes between workers), ``proxy/`` (the
OpenAI-compatible front door: the per-request decision, the handoff, routing by cache, failover
and migration), ``slo_scheduler.py`` (a vLLM scheduler plugin, a product of its own: vLLM loads
it by its path, ``--scheduler-cls kvdisagg.slo_scheduler.SloScheduler``), ``bench/`` and
``planner/`` (goodput measured and planned), ``local/`` (a fleet of real vLLM processes on one
host, for the demo) and ``cli/`` (the ``kvdisagg`` command, and the commands that span the parts:
demo, doctor, gpu-check). Shared by all: ``errors.py``, ``keys.py``, ``tracing.py``, ``plugin.py``
(vLLM's plugin entry point) and ``compat/`` (the few private APIs of dependencies we reach).
"""

__version__ = "0.1.0"
