"""The protocol between a prefill and a decode instance, one module per contract.

    versions.py   PROTOCOL_VERSION and its history, the range an instance speaks (``Versions``)
    params.py     the HTTP contract: kv_transfer_params (the handoff prefill returns and the
                  proxy passes to decode, and the keys the proxy itself adds)
    frames.py     the side channel's wire frames between workers (msgspec Structs)
    sockets.py    exact reads and batched scatter/gather of buffers over a socket

Imports run down this list's dependencies only: versions <- params <- frames -> sockets. The
proxy, the scheduler plugin and the compat patches import ``versions`` and ``params`` only
(tests/unit/test_layering.py); the frames and sockets are the connector's and the transports'.
"""
