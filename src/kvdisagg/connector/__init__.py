"""The vLLM KV connector. ``kv_connector_module_path: kvdisagg.connector`` loads it directly.

What it holds, in layers (each imports only the layers above it in this list)::

    protocol/      the P->D protocol by contract: versions, kv_transfer_params (the HTTP
                   contract, the one part the proxy and the scheduler plugin import), the side
                   channel's frames, socket helpers
    config.py      ConnectorConfig, parsed once from kv_connector_extra_config
    layout.py      page views, CopyRuns, Slices, KvGeometry
    sharding.py    which heads and layers each decode rank pulls, for any TP and PP
    integrity.py   KV checksums
    threads.py     kvdisagg's I/O threads
      (kvdisagg.transport sits here: it moves the bytes, and imports only the modules above)
    metadata.py    plain data from the scheduler side to the worker side
    scheduler.py   EngineCore: handoffs, leases (leases.py), retirement (retire.py); no torch,
                   no kvdisagg.transport
    worker.py      each worker: registered KV, pulls; never imports scheduler.py
    stats.py       counters vLLM exports as vllm:kvdisagg_*
    connector.py   DisaggConnector, the facade vLLM instantiates; it only forwards

``DisaggConnector`` is imported on first access (vLLM's factory does ``getattr`` on this module),
so importing a module of this package (the proxy's ``protocol.params``, the transports'
``layout``) does not import vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvdisagg.connector.connector import DisaggConnector

__all__ = ["DisaggConnector"]


def __getattr__(name: str) -> object:
    if name == "DisaggConnector":
        from kvdisagg.connector.connector import DisaggConnector

        return DisaggConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
