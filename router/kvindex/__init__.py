"""vLLM's KV cache events, followed by every router replica: each engine's prefix-cache blocks
(``engine.py``) fed by its ZMQ stream (``stream.py``, ``wire.py``), kept in step with the
registry (``index.py``), and the cache-aware choice of P and D made from them (``route.py``,
with the request's token ids from ``tokens.py``). See ``docs/kv-events.md``."""
