"""Test scaffolding that must not ship in the package: fake vLLM servers (proxy tests and the
proxy benchmark), the prefill side of a transport in its own process (conformance tests, the
transfer benchmark, doctor tests), and fault-injecting transports (e2e)."""
