"""What a starting vLLM engine is doing, read from its log: the phase a person waits on.

A cold engine takes a minute or more before ``/health`` answers (imports, the model's config,
the engine core's process, weights, the KV cache, compilation); the stack reports which of
these each engine is in rather than only that it is not ready. Pure functions over the log's
text; the lines matched are vLLM 0.32-0.34's own (an unknown line changes nothing).
"""

from __future__ import annotations

# (a line vLLM logs as it enters the phase, the phase), in start-up order.
_MARKERS: tuple[tuple[str, str], ...] = (
    ("non-default args:", "reading the model's config"),
    ("Initializing a V1 LLM engine", "starting the engine core"),
    ("Starting to load model", "loading weights"),
    ("Loading weights took", "measuring memory, allocating the KV cache"),
    ("Dynamo bytecode transform time", "compiling"),
    ("Compiling a graph for", "compiling"),
    ("Capturing CUDA graph", "capturing CUDA graphs"),
    ("init engine (profile, create kv cache, warmup model) took", "starting the API server"),
    ("Starting vLLM server on", "up, waiting for /health"),
)
IMPORTING = "importing vLLM"


def engine_phase(log: str) -> str:
    """The phase of the engine whose output so far is ``log``: the phase of the marker seen
    last (an engine restarted into the same log starts over), or :data:`IMPORTING`."""
    best, phase = -1, IMPORTING
    for marker, name in _MARKERS:
        at = log.rfind(marker)
        if at > best:
            best, phase = at, name
    return phase
