"""The SSE framing of an OpenAI stream as the relay reads it: D's error event, the terminal
``[DONE]`` event, and where a read ends the answer."""

from __future__ import annotations

__all__ = ["ENGINE_ERROR_EVENT", "SSE_DONE", "ends_answer"]

# How vLLM reports a failure after a streaming response has started (the JSON of
# an error response as one SSE event). Generated text cannot contain it: inside
# the JSON of a token event its quotes are escaped.
ENGINE_ERROR_EVENT = b'data: {"error"'
# The last event of an OpenAI stream. A client stops reading there, before the HTTP end that
# follows; the router must have recorded the answer's end by then (before it sends
# ``DecodeLeg.tail``, what ``DecodeLeg.forward`` leaves).
SSE_DONE = b"data: [DONE]\n\n"


def ends_answer(prev: bytes, chunk: bytes) -> bool:
    """True if a stream's bytes, read so far as ``prev`` then ``chunk``, end with its terminal
    event (:data:`SSE_DONE`) at an event's start. Generated text cannot end a read so: its
    event's JSON holds no raw newline."""
    if not chunk.endswith(b"]\n\n"):  # the fast path: a token's event ends with "}"
        return False
    n = len(SSE_DONE)
    tail = (prev[-n:] + chunk)[-(n + 1) :]
    return tail.endswith(SSE_DONE) and (len(tail) == n or tail[0] == ord("\n"))
