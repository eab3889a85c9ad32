"""The private parts of kvdisagg's dependencies it relies on, one module per dependency.

Each wrapper says why no public way does the job, and ``tests/unit/test_compat.py`` checks it
against the versions pyproject.toml pins, so an upgrade that moves them fails there first:

- ``_vllm``: the scheduler's pause state, toggled for one schedule() without vLLM's log line;
- ``_torch``: a two-rank gloo or NCCL group of its own, outside vLLM's default group;
- ``_aiohttp``: a stream response whose headers leave with its first chunk.

Nothing else in kvdisagg touches a private attribute of vLLM, torch or aiohttp.
"""
