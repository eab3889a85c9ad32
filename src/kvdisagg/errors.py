"""The exceptions kvdisagg raises, as one tree so callers can catch at the depth they need.

    KvDisaggError
    ├── ConfigError             a bad or unknown kv_connector_extra_config key
    ├── HandoffError            kv_transfer_params that cannot be honoured (missing, forged, stale)
    ├── IncompatiblePeerError   the two sides' KV layouts differ
    └── TransportError
        ├── PeerUnreachable     could not connect within the timeout
        ├── TransferTimeout     a transfer did not finish within the timeout
        └── TransferFailed      the peer refused the read, or the stream broke
            └── ChecksumMismatch  the KV that landed differs from what the peer sent
"""


class KvDisaggError(Exception):
    """Base of every kvdisagg error."""


class ConfigError(KvDisaggError, ValueError):
    """A connector setting is unknown or out of range; the message names the key."""


class HandoffError(KvDisaggError):
    """kv_transfer_params that decode cannot use."""


class IncompatiblePeerError(KvDisaggError):
    """Prefill and decode disagree on KV geometry; the message says what differs."""


class TransportError(KvDisaggError):
    """Moving bytes between workers failed."""


class PeerUnreachable(TransportError):
    pass


class TransferTimeout(TransportError):
    pass


class TransferFailed(TransportError):
    pass


class ChecksumMismatch(TransferFailed):
    """The bytes decode received are not the bytes prefill sent (or the store holds): the load
    fails, never an answer computed from them. The message names the handoff and the peer."""
