"""D's streamed answer as the client gets it: the end of the answer, as a client reads it, is
D's terminal ``[DONE]`` event, not D's HTTP end. Whatever the router records at the end
(``before_last``: a kept turn, the stream's counts) must be in place before that event
leaves, whichever reads D's bytes came in."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from router.engines.breaker import Breaker
from router.engines.instance import Instance, Role
from router.errors import Fault, UpstreamError
from router.pd.decode_leg import DecodeLeg
from router.pd.sse import SSE_DONE, ends_answer

TOKEN = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
# Generated text that looks like the terminal event: JSON-escaped, inside a token's event.
LOOKALIKE = b'data: {"choices": [{"delta": {"content": "data: [DONE]\\n\\n"}}]}\n\n'


class _Stream:
    """D's body in the reads given; ``ended`` is never True before the reads run out
    (D's HTTP end in a read of its own, as it often is), or a read error at the end."""

    def __init__(self, reads: Sequence[bytes], error: Exception | None = None) -> None:
        self._reads, self._error = list(reads), error
        self.ended = False

    async def chunks(self) -> AsyncIterator[bytes]:
        for read in self._reads:
            yield read
        if self._error is not None:
            raise self._error


def _leg(first: bytes, stream: _Stream) -> DecodeLeg:
    inst = Instance("http://d:8000", Role.DECODE, "m", Breaker(3, 10.0), slots=4)
    return DecodeLeg(inst, stream, first, stream.chunks())  # type: ignore[arg-type]


async def _forward(
    first: bytes, reads: Sequence[bytes], error: Exception | None = None, head: bytes = b""
) -> tuple[DecodeLeg, list[tuple[str, Any]]]:
    """What the client is sent, in order, and where ``before_last`` ran: the leg's bytes
    as the relay sends them (each chunk, then its end recorded, then ``tail``)."""
    events: list[tuple[str, Any]] = []
    leg = _leg(first, _Stream(reads, error))

    async def more(chunk: bytes) -> None:
        events.append(("send", (chunk, True)))

    await leg.forward(more, head=head)
    events.append(("before_last", None))
    events.append(("send", (leg.tail, False)))
    return leg, events


def _sent_before_last(events: list[tuple[str, Any]]) -> bytes:
    at = events.index(("before_last", None))
    return b"".join(body for kind, (body, _more) in events[:at] if kind == "send")


async def test_done_in_a_read_of_its_own_waits_for_the_end_of_d() -> None:
    leg, events = await _forward(TOKEN, [TOKEN, SSE_DONE, b""])
    assert b"[DONE]" not in _sent_before_last(events)
    assert events[-1] == ("send", (SSE_DONE, False))  # [DONE] is the last message
    assert leg.verdict is None


async def test_done_split_across_reads_is_held_from_the_read_that_completes_it() -> None:
    _, events = await _forward(TOKEN, [TOKEN + b"data: [DO", b"NE]\n\n"])
    # The client cannot take a part of an event for the end: it reads up to "\n\n".
    assert _sent_before_last(events) == TOKEN + b"data: [DO"
    assert events[-1] == ("send", (b"NE]\n\n", False))


async def test_a_short_answer_whose_first_read_ends_it_comes_as_head() -> None:
    whole = TOKEN + SSE_DONE
    assert ends_answer(b"", whole)
    _, events = await _forward(whole, [b""], head=whole)
    assert events == [("before_last", None), ("send", (whole, False))]


async def test_generated_text_that_looks_like_the_end_is_streamed_at_once() -> None:
    _, events = await _forward(TOKEN, [LOOKALIKE, TOKEN, SSE_DONE])
    sent = _sent_before_last(events)
    assert LOOKALIKE in sent and sent.endswith(TOKEN)
    assert not ends_answer(TOKEN, LOOKALIKE)


async def test_d_cut_after_its_done_is_a_whole_answer() -> None:
    cut = UpstreamError("gone", role="decode", engine="http://d:8000", fault=Fault.ENGINE)
    leg, events = await _forward(TOKEN, [TOKEN, SSE_DONE], error=cut)
    assert events[-2:] == [("before_last", None), ("send", (SSE_DONE, False))]
    assert leg.verdict is None


async def test_d_cut_before_its_done_is_its_fault() -> None:
    cut = UpstreamError("gone", role="decode", engine="http://d:8000", fault=Fault.ENGINE)
    with pytest.raises(UpstreamError):
        await _forward(TOKEN, [TOKEN], error=cut)


async def test_the_client_gets_no_engine_coordinates_whatever_the_reads() -> None:
    # vLLM 0.33+: null on token chunks, a pull D's own NIXL coordinates on the last one.
    token = b'data: {"choices":[{"delta":{"content":"hi"}}],"kv_transfer_params":null}\n\n'
    coords = b'{"remote_host":"10.9.9.9","remote_port":5700,"remote_block_ids":[[7,8]]}'
    last = b'data: {"choices":[],"kv_transfer_params":' + coords + b"}\n\n"
    clean = b'data: {"choices":[],"kv_transfer_params":null}\n\n'
    cut = len(last) - 30  # inside D's coordinates
    leg, events = await _forward(token, [token + last[:cut], last[cut:], SSE_DONE])
    sent = leg.first + b"".join(message[0] for kind, message in events if kind == "send")
    assert sent == token + token + clean + SSE_DONE
    assert events[-1] == ("send", (SSE_DONE, False))
    # D's end in the same read as its last bytes: held bytes and the rest in one write.
    leg, events = await _forward(token + last[:cut], [last[cut:] + SSE_DONE])
    sent = leg.first + b"".join(message[0] for kind, message in events if kind == "send")
    assert sent == token + clean + SSE_DONE
