"""``nccl``: KV moved by point-to-point send/recv of ``torch.distributed`` process groups.

One two-rank group per side-channel connection, i.e. per (prefill worker, decode worker) pair:
prefill is rank 0 and hosts the rendezvous (a TCPStore on its side-channel address, one per
worker, a fresh prefix per group); decode joins as rank 1 right after the Hello reply. The
group lives as long as the connection and is dropped with it, so a peer that goes away takes its
group along. vLLM's default group is never touched.

``ProcessGroupNCCL`` when the KV cache is on CUDA, ``ProcessGroupGloo`` on CPU: the same code,
tested on CPU with gloo. Each pull is a batch of sends matched by receives in CopyRun order; the
side channel runs one pull at a time per connection, so batches of two pulls never interleave.
"""

from __future__ import annotations

import datetime
import secrets
import socket
from typing import Any, ClassVar, Sequence

import msgspec
import torch
import torch.distributed as dist

from kvdisagg.errors import IncompatiblePeerError, TransferFailed, TransferTimeout
from kvdisagg.layout import CopyRun, LayerRegion, run_tensor
from kvdisagg.transport.pull import Deadline, PullTransport


class GroupInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill -> decode in the Hello reply: where to rendezvous for this connection's group."""

    store_host: str
    store_port: int
    group: str
    backend: str


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


class NcclTransport(PullTransport):
    name: ClassVar[str] = "nccl"

    def attach(self, regions: Sequence[LayerRegion], is_producer: bool) -> None:
        device = regions[0].pages.device if regions else torch.device("cpu")
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self._store: dist.TCPStore | None = None
        if is_producer:
            self._store = dist.TCPStore(self.config.side_channel_host, 0, None, True,
                                        timeout=_timedelta(self.config.transfer_timeout_seconds),
                                        wait_for_workers=False)

    def server_info(self) -> dict[str, Any]:
        assert self._store is not None
        return msgspec.to_builtins(GroupInfo(
            store_host=self.config.side_channel_host, store_port=self._store.port,
            group=secrets.token_hex(8), backend=self.backend))

    def open_server(self, sock: socket.socket, info: dict[str, Any], sent: dict[str, Any]) -> Any:
        assert self._store is not None
        return self._group(dist.PrefixStore(sent["group"], self._store), rank=0,
                           timeout_s=self.config.transfer_timeout_seconds,
                           hostname=sock.getsockname()[0])

    def open_client(self, sock: socket.socket, info: dict[str, Any], deadline: Deadline) -> Any:
        try:
            group = msgspec.convert(info, GroupInfo)
        except msgspec.ValidationError as exc:
            raise TransferFailed(f"nccl: bad group info from prefill: {exc}") from None
        if group.backend != self.backend:
            raise IncompatiblePeerError(f"nccl: prefill's KV needs {group.backend}, decode's "
                                        f"{self.backend} (both on GPU, or both on CPU)")
        try:
            store = dist.TCPStore(group.store_host, group.store_port, None, False,
                                  timeout=_timedelta(deadline.left()))
        except (RuntimeError, ValueError) as exc:
            raise TransferFailed(f"nccl: rendezvous at {group.store_host}:{group.store_port} "
                                 f"failed: {exc}") from None
        return self._group(dist.PrefixStore(group.group, store), rank=1,
                           timeout_s=deadline.left(),
                           hostname=sock.getsockname()[0])

    def _group(self, store: dist.Store, rank: int, timeout_s: float, hostname: str) -> Any:
        """``hostname``: this end's address of the side channel, i.e. the interface that
        reaches the peer (gloo binds it; vLLM's own groups are never involved)."""
        try:
            if self.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = _timedelta(timeout_s)
                return dist.ProcessGroupNCCL(store, rank, 2, opts)
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = _timedelta(timeout_s)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
            return dist.ProcessGroupGloo(store, rank, 2, opts)
        except RuntimeError as exc:
            raise TransferFailed(f"nccl: forming the {self.backend} group failed: {exc}"
                                 ) from None

    def close_peer(self, peer: Any) -> None:
        if peer is not None and hasattr(peer, "abort") and self.backend == "nccl":
            peer.abort()

    def send(self, peer: Any, sock: socket.socket, runs: Sequence[CopyRun],
             deadline: Deadline, grant: bytes) -> None:
        sock.sendall(grant)
        self._wait([peer.send([run_tensor(self.regions, run, "src")], 1, i)
                    for i, run in enumerate(runs)], deadline)

    def recv(self, peer: Any, sock: socket.socket, runs: Sequence[CopyRun],
             deadline: Deadline) -> None:
        self._wait([peer.recv([run_tensor(self.regions, run, "dst")], 0, i)
                    for i, run in enumerate(runs)], deadline)

    def _wait(self, works: list[Any], deadline: Deadline) -> None:
        try:
            for work in works:
                if not work.wait(_timedelta(deadline.left())):
                    raise TransferTimeout(f"{deadline.what}: {self.backend} op timed out")
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise TransferTimeout(f"{deadline.what}: {exc}") from None
            raise TransferFailed(f"{deadline.what}: {self.backend} transfer failed: {exc}"
                                 ) from None
