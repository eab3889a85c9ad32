"""Routing: what a request asks, which paths may serve it, and where it goes.

``body`` (the client's request read once, and the bodies of its legs), ``contract`` (which
paths answer it exactly as a plain vLLM instance, from the request alone), ``policies`` (pick an
instance; ``CacheAware`` weighs what each cache holds), ``decide`` (the ``RoutePlan``: decode
alone or a handoff, and every reason for decode alone), and what the caches hold:
``cache_index`` (one index fed by every instance's ``kv_events``, ``prefix_index``), ``tokens``,
``token_memo`` and ``chat_template`` (the token ids vLLM would run).

Imports the fleet and the vocabulary below it; nothing of the handoff or the app.
"""
