"""No engine coordinates reach a client (router/pd/scrub.py): every ``kv_transfer_params``
value becomes null, every other byte is the engine's, whatever pieces a stream is read in."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from router.pd.scrub import StreamScrub, without_params

COORDS = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[100, 101, 102]],
    "remote_engine_id": "d-engine-7",
    "remote_request_id": "cmpl-x-0-ffff",
    "remote_host": "10.1.2.3",
    "remote_port": 5700,
    "tp_size": 1,
    "remote_num_tokens": 40,
    "note": 'a "quoted" } ] { [ value\\',
}
SECRETS = (b"10.1.2.3", b"5700", b"d-engine-7", b"remote_block_ids")


def _event(doc: dict[str, object], compact: bool = True) -> bytes:
    sep = (",", ":") if compact else (", ", ": ")
    return b"data: " + json.dumps(doc, separators=sep).encode() + b"\n\n"


def _token(i: int, params: object = None, compact: bool = True) -> bytes:
    doc = {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
    return _event({**doc, "kv_transfer_params": params}, compact)


def _stream(compact: bool = True) -> tuple[bytes, bytes]:
    """A 0.33 stream (null on token chunks, D's coordinates on the last), and the same
    stream as an aggregated engine sends it."""
    tokens = b"".join(_token(i, compact=compact) for i in range(5))
    last_raw = _token(5, COORDS, compact)
    last_clean = _token(5, None, compact)
    done = b"data: [DONE]\n\n"
    return tokens + last_raw + done, tokens + last_clean + done


def _feed(reads: list[bytes]) -> bytes:
    scrub = StreamScrub()
    return b"".join(scrub.feed(r) for r in reads) + scrub.flush()


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(points)]


@pytest.mark.parametrize("compact", [True, False])
def test_a_stream_read_in_any_pieces_comes_out_as_an_aggregated_engine_sends_it(
    compact: bool,
) -> None:
    raw, clean = _stream(compact)
    rng = random.Random(7)
    assert _feed([raw]) == clean
    for _ in range(300):
        cuts = rng.sample(range(1, len(raw)), rng.randint(1, 12))
        assert _feed(_split(raw, cuts)) == clean
    # Every single cut point, one byte at a time around the key and the value.
    for cut in range(1, len(raw)):
        assert _feed(_split(raw, [cut])) == clean
    assert _feed([raw[i : i + 1] for i in range(len(raw))]) == clean


def test_nothing_is_held_back_from_a_read_without_the_key() -> None:
    scrub = StreamScrub()
    token = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
    assert scrub.feed(token) is token
    assert scrub.feed(b"data: [DO") == b"data: [DO"  # a part of an event goes on as read
    # 0.33's token chunks carry the key, null: sent whole at once.
    assert scrub.feed(_token(1)) == _token(1)


def test_only_the_bytes_from_an_incomplete_value_on_wait_for_the_read_that_completes_it() -> None:
    scrub = StreamScrub()
    last = _token(5, COORDS)
    cut = last.index(b"remote_host")
    assert scrub.feed(_token(4) + last[:cut]) == _token(4) + last[: last.index(b'"kv_transfer')]
    out = scrub.feed(last[cut:])
    assert out.endswith(b'"kv_transfer_params":null}\n\n')
    assert not any(s in out for s in SECRETS)


def test_a_whole_body_keeps_every_other_byte() -> None:
    doc = {"id": "cmpl-1", "choices": [{"text": "kv_transfer_params: {}"}], "x": 1e-05}
    body = json.dumps({**doc, "kv_transfer_params": COORDS, "usage": {"a": 1}}).encode()
    out = without_params(body)
    assert out == json.dumps({**doc, "kv_transfer_params": None, "usage": {"a": 1}}).encode()
    assert not any(s in out for s in SECRETS)
    assert without_params(b'{"kv_transfer_params":null}') == b'{"kv_transfer_params":null}'


def test_text_that_reads_like_the_key_is_the_engines() -> None:
    # Generated text: inside a JSON string every quote is escaped, so it is never the key.
    text = json.dumps({"text": '"kv_transfer_params": {"remote_host": "x"}'}).encode()
    assert without_params(text) == text
    value = b'{"a":"kv_transfer_params","b":1}'  # a string value, not a key
    assert without_params(value) == value
    assert _feed([value[:5], value[5:]]) == value


def test_any_value_that_is_not_null_becomes_null() -> None:
    for value in (b'"x"', b"12", b"true", b"[1,[2]]", b'{"a":{"b":"}"}}'):
        body = b'{"kv_transfer_params": ' + value + b',"z":0}'
        assert without_params(body) == b'{"kv_transfer_params": null,"z":0}'


def test_a_stream_that_ends_inside_the_value_sends_none_of_it() -> None:
    last = _token(5, COORDS)
    cut = last.index(b"remote_host") + 5
    out = _feed([_token(1), last[:cut]])
    assert out.startswith(_token(1)) and not any(s in out for s in SECRETS)
    # A key cut before its value is no coordinate: sent as read.
    assert _feed([b'{"kv_transfer_par']) == b'{"kv_transfer_par'


def test_the_params_made_null_are_kept_for_the_router_whatever_the_cuts() -> None:
    raw, _clean = _stream(compact=False)
    for cut in range(1, len(raw)):
        scrub = StreamScrub()
        for piece in _split(raw, [cut]):
            scrub.feed(piece)
        scrub.flush()
        assert scrub.last_value is not None and json.loads(scrub.last_value) == COORDS
    tokens_only = StreamScrub()
    tokens_only.feed(_token(1) + _token(2))
    assert tokens_only.last_value is None  # null values are not params


def test_a_whole_read_is_sent_as_is_only_while_every_value_in_it_is_null() -> None:
    scrub = StreamScrub()
    token = _token(1)
    assert scrub.feed_whole(token) is token  # 0.33+'s token chunk: nothing to change
    spaced = _token(2, compact=False)
    assert scrub.feed_whole(spaced) == spaced
    # A null value, then D's coordinates in the same read: the second is made null.
    out = scrub.feed_whole(_token(3) + _token(4, COORDS))
    assert out == _token(3) + _token(4)
    assert scrub.last_value is not None and json.loads(scrub.last_value) == COORDS
    # A read whose bytes are held back is not taken whole: the caller feeds it.
    held = StreamScrub()
    assert held.feed(_token(5) + b'data: {"kv_transfer') == _token(5) + b"data: {"
    assert held.feed_whole(_token(6)) is None
