"""The handoff: one client request through its legs, from admission to the last byte.

``serving`` (the front door: admission, one ``Exchange`` per request, the one place a refusal
becomes an HTTP error), ``exchange`` (the per-request object), ``pipeline`` (plan, early
dispatch, prefill, first token, decode, in order), the stages (``prefill``, ``decode``,
``early``, ``first_token``), ``legs`` (what each upstream leg owes), ``relay`` (the answer to
the client, with migrations: ``migrate``), ``fanout`` (several prompts in one request) and
``passthrough`` (the other vLLM routes, to decode).

Imports routing, the fleet and the metrics; only the app imports it.
"""
