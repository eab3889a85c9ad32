"""A P/D fleet of real processes on one host, as ``kvdisagg demo`` runs it (and the tests and
benchmarks reuse it): the tiny offline model (tiny_model), vLLM and LMCache server processes
(servers) and prefill and decode instances behind the proxy (fleet). Test-only scaffolding (fake
servers, transport peers, faulty transports) lives under tests/support, outside the package, so
no production config can name it."""
