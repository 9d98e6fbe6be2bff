"""No engine coordinates reach a client: every ``kv_transfer_params`` value an engine answers
with becomes ``null``, as an aggregated engine answers.

An engine's ``kv_transfer_params`` are for the router and the other engine only. A pull D with
vLLM's ``bidirectional_kv_xfer`` (kept turns) names there its NIXL host, port, engine id and the
blocks it keeps; a P names its own. vLLM 0.32 puts them in non-streamed bodies; from 0.33 every
streamed chunk has the field too, ``null`` on token chunks and the engine's params on the last
one. The router sets every such value to ``null`` in what the client gets, streamed or not, in
every mode: the client sees what an aggregated engine of the same version sends (the field
present, ``null``), and every other byte as the engine sent it.

The rewrite works on bytes, not on parsed JSON: nothing else is re-encoded. A stream is read in
arbitrary pieces, so :class:`StreamScrub` holds back the bytes from a key whose value is not
complete yet (the client could not have used them: an SSE event is read up to its end) until
the read that completes it. Generated text cannot look like the key: inside a JSON string
every ``"`` is escaped, so ``"kv_transfer_params"`` followed by ``:`` is always a key.
"""

from __future__ import annotations

import re

__all__ = ["KEY", "StreamScrub", "without_params"]

KEY = b'"kv_transfer_params"'
_NULL = b"null"
# vLLM 0.33+ ends every token chunk with the key and a null value, compact: nothing to change.
_COLON_NULL = b":null"
_KEY_LEN = len(KEY)
_KEY_NULL_END = len(KEY) + len(_COLON_NULL)
_WS = b" \t\r\n"
# The next byte that opens or closes a string, an object or an array.
_STRUCTURE = re.compile(rb'["{}\[\]]')
# The rest of a JSON string after its opening quote, its closing quote included.
_STRING_REST = re.compile(rb'(?:[^"\\]|\\.)*"', re.DOTALL)
# A scalar other than a string: up to the next delimiter.
_SCALAR = re.compile(rb"[^,}\]\s]*")


def without_params(body: bytes) -> bytes:
    """A whole body (a non-streamed answer) with every ``kv_transfer_params`` value null."""
    out, _held = _scrub(body, final=True)
    return out


class StreamScrub:
    """The same for a stream read in pieces: :meth:`feed` each read in order, then
    :meth:`flush` at the end. Bytes held back by a read come out with a later one.
    ``last_value`` is the last value it made null (JSON bytes; None: none yet): a 0.33+
    stream's params, for the router alone (a streamed kept turn, router/pd/kept_turns.py)."""

    __slots__ = ("_held", "_removed")

    def __init__(self) -> None:
        self._held = b""
        self._removed: list[bytes] = []

    def feed_whole(self, chunk: bytes) -> bytes | None:
        """:meth:`feed` of a read that ends with a whole event (``}\\n\\n``), when nothing is
        held back: all of it can go to the client (no key or value is cut at an event's
        end). None, with nothing done, when bytes are held back (then :meth:`feed` it)."""
        if self._held:
            return None
        found = chunk.find(KEY)
        if found < 0 or (  # the usual chunk, inlined: one key, already null (_null_only)
            chunk.startswith(_COLON_NULL, found + _KEY_LEN)
            and chunk.find(KEY, found + _KEY_NULL_END) < 0
        ):
            return chunk
        return _scrub_keys(chunk, found, True, self._removed)[0]

    @property
    def last_value(self) -> bytes | None:
        return self._removed[-1] if self._removed else None

    def feed(self, chunk: bytes) -> bytes:
        """What of the stream so far can go to the client now."""
        if self._held:
            chunk, self._held = self._held + chunk, b""
        out, self._held = _scrub(chunk, final=False, removed=self._removed)
        return out

    def flush(self) -> bytes:
        """The stream ended: what was held back (a value the stream never completed is
        dropped, not sent: its bytes may be coordinates)."""
        held, self._held = self._held, b""
        return _scrub(held, final=True, removed=self._removed)[0] if held else b""


def _skip_ws(data: bytes, i: int) -> int:
    n = len(data)
    while i < n and data[i] in _WS:
        i += 1
    return i


def _value_end(data: bytes, i: int) -> int | None:
    """The end of the JSON value starting at ``data[i]`` (not whitespace), or None if
    ``data`` ends before it does."""
    first = data[i]
    if first == 0x22:  # '"'
        m = _STRING_REST.match(data, i + 1)
        return None if m is None else m.end()
    if first not in b"{[":
        if data.startswith(_NULL, i):
            return i + len(_NULL)
        end = _SCALAR.match(data, i)
        assert end is not None  # the pattern matches the empty string
        return None if end.end() == len(data) else end.end()
    depth, k = 0, i
    while True:
        m = _STRUCTURE.search(data, k)
        if m is None:
            return None
        c = data[m.start()]
        if c == 0x22:
            s = _STRING_REST.match(data, m.end())
            if s is None:
                return None
            k = s.end()
            continue
        depth += 1 if c in b"{[" else -1
        k = m.end()
        if depth == 0:
            return k


def _scrub(data: bytes, *, final: bool, removed: list[bytes] | None = None) -> tuple[bytes, bytes]:
    """(the bytes to send, the bytes to hold back until more come). With ``final``, nothing
    is held back: a key without a value is sent as is, a value cut short is dropped. The
    last value made null is left as ``removed``'s one item."""
    found = data.find(KEY)
    if found < 0:
        if final or _ends_in_key(data, 0) < 0:
            return data, b""  # the fast path: no key in these bytes
    elif _null_only(data, found, final):
        return data, b""  # vLLM 0.33+'s token chunk: its one key already null
    return _scrub_keys(data, found, final, removed)


def _null_only(data: bytes, found: int, final: bool) -> bool:
    """Whether the key at ``found`` is the only one in ``data``, its value ``null`` written
    compactly (as vLLM writes it), and (not ``final``) ``data`` does not end in the start
    of another: then nothing in ``data`` changes and nothing is held back."""
    after = found + _KEY_NULL_END
    return (
        data.startswith(_COLON_NULL, found + _KEY_LEN)
        and data.find(KEY, after) < 0
        and (final or _ends_in_key(data, after) < 0)
    )


def _scrub_keys(
    data: bytes, found: int, final: bool, removed: list[bytes] | None
) -> tuple[bytes, bytes]:
    """:func:`_scrub` where ``data`` holds the key (first at ``found``) or may end in it."""
    parts: list[bytes] = []
    emitted = 0  # data[:emitted] is in parts
    search = 0
    n = len(data)
    while found >= 0:
        colon = _skip_ws(data, found + len(KEY))
        if colon == n:  # the key, maybe with its ':' still to come
            if final:
                break
            parts.append(data[emitted:found])
            return b"".join(parts), data[found:]
        if data[colon] != 0x3A:  # ':': a string that happens to read so, not a key
            search = found + len(KEY)
            found = data.find(KEY, search)
            continue
        start = _skip_ws(data, colon + 1)
        end = None if start == n else _value_end(data, start)
        if end is None:  # the value not whole: held back, or (final) dropped
            parts.append(data[emitted : start if final else found])
            return b"".join(parts), b"" if final else data[found:]
        if data[start:end] != _NULL:
            if removed is not None:
                removed[:] = [data[start:end]]
            parts += (data[emitted:start], _NULL)
            emitted = end
        search = end
        found = data.find(KEY, search)
    return _rest(data, parts, emitted, search, final)


def _rest(
    data: bytes, parts: list[bytes], emitted: int, search: int, final: bool
) -> tuple[bytes, bytes]:
    """The bytes after the last key: held back from where a key may begin (not ``final``)."""
    if not final:
        tail = _ends_in_key(data, max(search, emitted))
        if tail >= 0:
            parts.append(data[emitted:tail])
            return b"".join(parts), data[tail:]
    if not parts:
        return data, b""
    parts.append(data[emitted:])
    return b"".join(parts), b""


def _ends_in_key(data: bytes, lo: int) -> int:
    """Where ``data`` ends with a proper start of :data:`KEY`, at ``lo`` or after (-1: it
    does not). :data:`KEY` holds no ``"`` but its first and last, so only the last ``"``
    can start it."""
    q = data.rfind(b'"', max(lo, len(data) - len(KEY) + 1))
    return q if q >= 0 and KEY.startswith(data[q:]) else -1
