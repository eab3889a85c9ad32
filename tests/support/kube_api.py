"""A stand-in for the Kubernetes API server's pods of one namespace: list and watch, as JSON on
the wire the way kube-apiserver (core/v1) writes it, over plain http on 127.0.0.1.

What it speaks (what ``discovery.KubernetesSource`` relies on):

- ``GET /api/v1/namespaces/NS/pods?labelSelector=&limit=&continue=``: a ``PodList`` with
  ``metadata.resourceVersion`` and, while items remain, ``metadata.continue``. Pages come from
  the snapshot the first page was cut from (a consistent list); a continue token older than the
  compaction point answers HTTP 410 ``Expired``.
- ``...&watch=1&resourceVersion=RV&allowWatchBookmarks=true&timeoutSeconds=N``: HTTP 200 and
  newline-separated ``{"type", "object"}`` events after RV (replayed from the change log, then
  live), BOOKMARKs when asked, the stream ended after ``timeoutSeconds`` (or ``max_watch_s``).
  An RV older than the compaction point gets one ERROR event with a 410 ``Status``, as the real
  server does.
- A bearer token is required (401 otherwise); ``forbidden`` answers 403; ``fail_status``
  answers that status to every request.

Faults a test flips: ``drop_watches()`` (the connection closes in the middle of an event),
``compact()`` (old resourceVersions and continue tokens are gone), ``hang`` (a watch that
never sends nor ends), ``expire_next_continue`` (the next continue token is refused with 410).
Every request's query is kept in ``requests``.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
from typing import Any

from aiohttp import web

_DROP = object()


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selectors: ``a=b,c==d,e!=f``."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        else:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
    return True


class KubeApi:
    def __init__(self, namespace: str = "kvdisagg", token: str = "test-token",
                 page_size: int = 2) -> None:
        self.namespace, self.token, self.page_size = namespace, token, page_size
        self.pods: dict[str, dict[str, Any]] = {}
        self.rv = 1000
        self.log: list[tuple[int, str, dict[str, Any]]] = []  # (rv, type, object) per change
        self.compacted = 0  # resourceVersions <= this are gone (410)
        self.snapshots: dict[int, list[dict[str, Any]]] = {}
        self.requests: list[dict[str, str]] = []
        self.forbidden = False
        self.fail_status: int | None = None
        self.hang = False
        self.expire_next_continue = False
        self.max_watch_s: float | None = None  # end every watch sooner than it asked
        self._watchers: list[tuple[asyncio.Queue[Any], bool]] = []  # (queue, bookmarks)

    # the cluster changes
    def _change(self, kind: str, pod: dict[str, Any]) -> None:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        obj = copy.deepcopy(pod)
        self.log.append((self.rv, kind, obj))
        for q, _ in self._watchers:
            q.put_nowait((kind, obj))

    def add(self, name: str, labels: dict[str, str], ip: str | None, ready: bool = True,
            phase: str = "Running") -> None:
        pod = {"kind": "Pod", "apiVersion": "v1",
               "metadata": {"name": name, "namespace": self.namespace, "labels": dict(labels),
                            "uid": f"uid-{name}", "creationTimestamp": "2025-01-01T00:00:00Z"},
               "spec": {"containers": [{"name": "vllm", "image": "kvdisagg-vllm"}]},
               "status": {"phase": phase}}
        if ip:
            pod["status"]["podIP"] = ip
            pod["status"]["podIPs"] = [{"ip": ip}]
        self.pods[name] = pod
        self._set_ready(pod, ready)
        self._change("ADDED", pod)

    @staticmethod
    def _set_ready(pod: dict[str, Any], ready: bool) -> None:
        pod["status"]["conditions"] = [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
            {"type": "ContainersReady", "status": "True" if ready else "False"},
            {"type": "PodScheduled", "status": "True"}]

    def set_ready(self, name: str, ready: bool) -> None:
        self._set_ready(self.pods[name], ready)
        self._change("MODIFIED", self.pods[name])

    def terminate(self, name: str) -> None:
        """``kubectl delete``: the deletion timestamp first (the pod still runs its preStop)."""
        pod = self.pods[name]
        pod["metadata"]["deletionTimestamp"] = "2025-01-01T00:10:00Z"
        pod["metadata"]["deletionGracePeriodSeconds"] = 120
        self._change("MODIFIED", pod)

    def delete(self, name: str) -> None:
        """The pod object goes (after its containers stopped)."""
        self._change("DELETED", self.pods.pop(name))

    def compact(self) -> None:
        """etcd compaction: every resourceVersion up to now is gone."""
        self.compacted = self.rv
        self.log.clear()
        self.snapshots = {k: v for k, v in self.snapshots.items() if k >= self.compacted}

    def bookmark(self) -> None:
        """Each watch that allows bookmarks gets one at the current resourceVersion."""
        for q, bookmarks in self._watchers:
            if bookmarks:
                q.put_nowait(("BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": {
                    "resourceVersion": str(self.rv), "creationTimestamp": None}}))

    def drop_watches(self) -> None:
        for q, _ in self._watchers:
            q.put_nowait(_DROP)

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    # the HTTP side
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        return app

    @staticmethod
    def _json(obj: Any, status: int = 200) -> web.Response:
        return web.json_response(obj, status=status)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        q = dict(request.query)
        self.requests.append(q)
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return self._json(_status(401, "Unauthorized", "Unauthorized"), 401)
        if self.forbidden:
            return self._json(_status(403, "Forbidden", (
                'pods is forbidden: User "system:serviceaccount:kvdisagg:default" cannot list '
                'resource "pods" in API group "" in the namespace "kvdisagg"')), 403)
        if self.fail_status is not None:
            return self._json(_status(self.fail_status, "InternalError", "etcd unavailable"),
                              self.fail_status)
        if request.match_info["ns"] != self.namespace:
            return self._json({"kind": "PodList", "apiVersion": "v1",
                               "metadata": {"resourceVersion": str(self.rv)}, "items": []})
        selector = q.get("labelSelector", "")
        if q.get("watch") in ("1", "true"):
            return await self._watch(request, selector, q)
        return self._list(selector, q)

    def _list(self, selector: str, q: dict[str, str]) -> web.Response:
        limit = int(q.get("limit", "0")) or None
        if "continue" in q:
            token = json.loads(base64.b64decode(q["continue"]))
            rv, start = token["rv"], token["start"]
            if rv < self.compacted or rv not in self.snapshots or self.expire_next_continue:
                self.expire_next_continue = False
                return self._json(_status(410, "Expired", (
                    "The provided continue parameter is too old to display a consistent list "
                    "result. You can start a new list without the continue parameter.")), 410)
        else:
            rv, start = self.rv, 0
            self.snapshots[rv] = [copy.deepcopy(self.pods[n]) for n in sorted(self.pods)]
        items = [p for p in self.snapshots[rv] if _matches(selector, p["metadata"]["labels"])]
        page = min(self.page_size, limit or self.page_size)
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if start + page < len(items):
            meta["continue"] = base64.b64encode(json.dumps(
                {"rv": rv, "start": start + page}).encode()).decode()
            meta["remainingItemCount"] = len(items) - start - page
        return self._json({"kind": "PodList", "apiVersion": "v1", "metadata": meta,
                           "items": items[start:start + page]})

    async def _watch(self, request: web.Request, selector: str,
                     q: dict[str, str]) -> web.StreamResponse:
        since = int(q.get("resourceVersion") or self.rv)
        timeout = float(q.get("timeoutSeconds", "1800"))
        if self.max_watch_s is not None:
            timeout = min(timeout, self.max_watch_s)
        bookmarks = q.get("allowWatchBookmarks") == "true"
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)

        async def send(kind: str, obj: dict[str, Any]) -> None:
            await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        if since < self.compacted:
            await send("ERROR", _status(410, "Expired",
                                        f"too old resource version: {since} ({self.compacted})"))
            await resp.write_eof()
            return resp
        queue: asyncio.Queue[Any] = asyncio.Queue()
        entry = (queue, bookmarks)
        self._watchers.append(entry)
        try:
            for rv, kind, obj in list(self.log):
                if rv > since and _matches(selector, obj["metadata"].get("labels", {})):
                    await send(kind, obj)
            if self.hang:
                await asyncio.sleep(3600)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                try:
                    async with asyncio.timeout(max(0.0, deadline - loop.time())):
                        item = await queue.get()
                except TimeoutError:
                    break  # timeoutSeconds: the server ends the watch
                if item is _DROP:
                    await resp.write(b'{"type":"MODIFIED","object":{"kind":"Pod","metad')
                    assert request.transport is not None
                    request.transport.abort()  # the connection breaks inside an event
                    return resp
                kind, obj = item
                if kind == "BOOKMARK" or _matches(selector, obj["metadata"].get("labels", {})):
                    await send(kind, obj)
            await resp.write_eof()
            return resp
        finally:
            self._watchers.remove(entry)
