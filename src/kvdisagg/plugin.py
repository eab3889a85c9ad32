"""vLLM general plugin: registers DisaggConnector in every vLLM process (idempotent)."""


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "DisaggConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            "DisaggConnector", "kvdisagg.connector.connector", "DisaggConnector")
