"""What ``kvdisagg demo``, the tests and the benchmarks share: the tiny offline model
(tiny_model), real vLLM and LMCache server processes (servers) and a 1P1D fleet behind the proxy
(fleet). Test-only scaffolding (fake servers, transport peers, faulty transports) lives under
tests/support, outside the package, so no production config can name it."""
