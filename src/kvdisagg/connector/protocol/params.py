"""The HTTP contract of a handoff: the ``kv_transfer_params`` that prefill returns, the proxy
carries and decode receives, and the other keys a request's kv_transfer_params may hold.

kv_transfer_params keep vLLM NixlConnector's field names so any proxy built for it works; our own
fields live under one key, ``kvdisagg``, which proxies pass through untouched. Its versions are
the protocol's (versions.py). This is the one module of the connector that the proxy, the
scheduler plugin and vLLM's detokenizer patch import: it imports only versions.py and msgspec.
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec

from kvdisagg.connector.protocol.versions import PROTOCOL_VERSION, SPOKEN, Versions

NAMESPACE = "kvdisagg"

BlockId = Annotated[int, msgspec.Meta(ge=0)]
Token = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,128}$")]
"""A handoff's capability (secrets.token_urlsafe); ASCII, so hmac.compare_digest takes it."""
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]  # 0: no side channel (store transports)


class HandoffExtras(msgspec.Struct, frozen=True, kw_only=True):
    """Our fields of kv_transfer_params (under ``kvdisagg``)."""

    version: int = PROTOCOL_VERSION
    """The newest protocol version prefill speaks."""
    min_version: int = 0
    """The oldest one; 0 (params of an instance from before it was sent): ``version`` only."""
    transport: str
    kv_layout: str
    token: Token
    lease_expires: float
    lease_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 30.0
    """Lease length: decode renews each held handoff well within it."""
    ports: list[Port]
    """Side-channel port per prefill rank, PP-major (``pp_rank * tp_size + tp_rank``)."""
    stages: list[Annotated[int, msgspec.Meta(ge=0)]] = msgspec.field(default_factory=lambda: [0])
    """First layer of each of prefill's PP stages (one entry: no PP)."""
    early: bool = False
    """Sent to decode before prefill computed the handoff (the proxy's early dispatch): the
    block ids and token count are not known yet; decode reads the handoff by position."""

    def versions(self) -> Versions:
        """The protocol versions prefill speaks."""
        return Versions(self.min_version or self.version, self.version)


EARLY_PARAMS_KEY = "kvdisagg_early"
"""Key of a prefill request's ``kv_transfer_params`` naming the handoff it will offer (its id
and token chosen by the proxy, which sent the decode leg with them already)."""


class EarlyHandoff(msgspec.Struct, frozen=True, kw_only=True):
    handoff_id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{16,128}$")]
    token: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{16,128}$")]


RESUME_PARAMS_KEY = "kvdisagg_resume"
"""Key of a continuation's ``kv_transfer_params`` (the proxy's: the first token from prefill, a
migrated stream): how many of its prompt tokens are the original request's prompt, the rest
being tokens the client already got. Decode's detokenizer is then primed as the plain instance's
was after those tokens (compat/_vllm_detokenizer.py), so the next token's text is the same."""


SLO_PARAMS_KEY = "kvdisagg_slo"
"""Key of a request's ``kv_transfer_params`` carrying its RequestSlo, e.g.
``{"kvdisagg_slo": {"ttft_s": 0.5}}``: the one key a client may send there (the proxy passes it
on to prefill, validated, and drops everything else). A sibling of the ``kvdisagg`` handoff key,
not inside it: that key is the P->D wire format (HandoffExtras), written by prefill."""


class RequestSlo(msgspec.Struct, frozen=True, kw_only=True):
    """A request's own objectives (``kv_transfer_params["kvdisagg_slo"]``; unknown keys ignored)."""

    ttft_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] | None = None


class RemotePrefill(msgspec.Struct, frozen=True, kw_only=True):
    """kv_transfer_params that prefill returns and decode receives (unknown keys ignored)."""

    do_remote_prefill: bool
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: list[BlockId]
    remote_host: str
    remote_port: Port
    remote_num_tokens: Annotated[int, msgspec.Meta(ge=0)]
    tp_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    kvdisagg: HandoffExtras


def handoff_params(
    *, engine_id: str, request_id: str, block_ids: list[int], host: str, ports: list[int],
    num_tokens: int, transport: str, kv_layout: str, token: str, lease_s: float,
    stages: list[int] | None = None, versions: Versions = SPOKEN,
) -> dict[str, object]:
    """The dict prefill returns from request_finished (becomes the response's kv_transfer_params).
    ``ports``: one per rank, PP-major; ``stages``: the first layer of each PP stage;
    ``versions``: the protocol versions prefill speaks."""
    stages = list(stages or [0])
    params = RemotePrefill(
        do_remote_prefill=True, remote_engine_id=engine_id, remote_request_id=request_id,
        remote_block_ids=list(block_ids), remote_host=host, remote_port=ports[0],
        remote_num_tokens=num_tokens, tp_size=max(len(ports) // len(stages), 1),
        kvdisagg=HandoffExtras(version=versions.hi, min_version=versions.lo,
                               transport=transport, kv_layout=kv_layout, token=token,
                               lease_expires=time.time() + lease_s, lease_s=lease_s,
                               ports=list(ports), stages=stages),
    )
    out: dict[str, object] = msgspec.to_builtins(params)
    out["do_remote_decode"] = False
    return out

