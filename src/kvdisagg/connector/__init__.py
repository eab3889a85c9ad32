"""The vLLM KV connector. ``kv_connector_module_path: kvdisagg.connector`` loads it directly."""

from kvdisagg.connector.connector import DisaggConnector

__all__ = ["DisaggConnector"]
