"""The exceptions kvdisagg raises, as one tree so callers can catch at the depth they need.

    KvDisaggError
    ├── ConfigError             a bad or unknown kv_connector_extra_config key
    ├── IncompatiblePeerError   the two sides' KV layouts differ
    ├── TransportError
    │   ├── PeerUnreachable     could not connect within the timeout
    │   ├── TransferTimeout     a transfer did not finish within the timeout
    │   └── TransferFailed      the peer refused the read, or the stream broke
    │       └── ChecksumMismatch  the KV that landed differs from what the peer sent
    ├── EndpointError           an endpoint kvdisagg bench or profile measures answered an error
    └── ProxyError
        ├── BodyError           a client request body the proxy cannot read (400)
        ├── DiscoveryError      a discovery source could not be read (its last answer stands)
        ├── Refusal             a request the proxy ends with an HTTP error (proxy/responses.py)
        └── UpstreamError       an upstream leg failed (``sent``: it may have reached vLLM)
            ├── ConnectError    no connection: vLLM never saw the request
            ├── UpstreamTimeout a bound ran out
            └── Abandoned       the proxy gave up waiting: probes found the instance dead
"""


class KvDisaggError(Exception):
    """Base of every kvdisagg error."""


class ConfigError(KvDisaggError, ValueError):
    """A connector setting is unknown or out of range; the message names the key."""


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


class EndpointError(KvDisaggError):
    """An OpenAI-compatible endpoint that ``kvdisagg bench`` or ``profile`` measures refused or
    failed a request it must answer (a warm-up); the message names the endpoint and its
    answer."""


class ProxyError(KvDisaggError):
    """An error of ``kvdisagg proxy``."""


class BodyError(ProxyError, ValueError):
    """A client request body the proxy cannot read; the message says why (HTTP 400)."""


class DiscoveryError(ProxyError):
    """A discovery source could not be read; its last good answer stands."""


class UpstreamError(ProxyError):
    """An upstream leg failed; ``sent`` says whether the request may have reached the server."""

    def __init__(self, message: str, *, sent: bool = True) -> None:
        super().__init__(message)
        self.sent = sent


class ConnectError(UpstreamError):
    """No connection could be made: the server never saw the request, unless an earlier copy
    of it went out on a reused connection that then closed (``sent``; Pool.request)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, sent=False)


class UpstreamTimeout(UpstreamError):
    """A bound on the leg ran out (headers, a body, silence mid-stream)."""


class Abandoned(UpstreamError):
    """The pool's owner gave up waiting (``Pool.fail_waiting``): its health probes failed."""
