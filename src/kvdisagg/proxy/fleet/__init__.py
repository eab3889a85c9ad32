"""The fleet: who the proxy routes to and how it reaches them.

``registry`` (membership, health probes with hysteresis, per-instance load, counters and
protocol versions), ``breaker`` (a circuit breaker per instance), ``upstream`` (the keep-alive
HTTP/1.1 client each instance's legs and probes share), ``discovery`` (members from DNS and the
Kubernetes API) and ``admin`` (the admin API: add, drain, remove).

Imports the proxy's vocabulary and config only: nothing of routing, the handoff or the app
(tests/unit/test_layering.py).
"""
