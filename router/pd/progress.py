"""One migratable answer as the client has received it, across its legs (:class:`Progress`).

It rewrites each event for the client (ids the client did not ask for removed; a
continuation's identity, usage and chat shape made the first leg's) and records what the
client has received, from which ``router/pd/continuation.py`` builds the continuation.

The first leg's ordinary token events (one choice, ``"finish_reason":null``, its
generated ids the only ids list, compact JSON) are not parsed: a few byte searches find the
list, the client gets the event with it made null, and its ids' bytes wait to be read in
batches (:meth:`Progress.settle`): one JSON read of up to ``SETTLE_AT`` lists. Splitting the
read into events and scanning each (what ``client_bytes`` does) executed 2.5x the
instructions (bench/results/2026-12-07-relay-splice.md).
Whatever reads what was recorded settles first; any other event is parsed whole, after the
events before it are recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from router.client_request import ClientRequest, Endpoint

__all__ = ["IDS", "SETTLE_AT", "Progress", "null_ids"]

IDS = "return_token_ids"  # the body field asking vLLM for token ids

_WHOLE_OBJECT = {True: "chat.completion", False: "text_completion"}
# A non-streamed chat answer's message as vLLM 0.32 writes one with text only.
_CHAT_MESSAGE: dict[str, Any] = {
    "role": "assistant",
    "content": "",
    "refusal": None,
    "annotations": None,
    "audio": None,
    "function_call": None,
    "tool_calls": [],
    "reasoning": None,
    "reasoning_content": None,
}
# The key of a token-id list in an event's JSON (``token_ids``, ``prompt_token_ids``).
# Generated text cannot hold it: inside a JSON string its quote would be escaped.
_IDS_KEY = b'token_ids":'
# What an ordinary event is told by (Progress.relayed); none can occur inside generated text
# for the same reason. A list's key preceded by a quote is the generated ids'.
_IDS_LIST = b'token_ids":['
_IDS_LEN = len(_IDS_LIST)
_FINISH_NULL = b'"finish_reason":null'
_QUOTE = ord('"')
# Ordinary events' ids read later: at most this many lists a stream (a few hundred bytes).
SETTLE_AT = 32


@dataclass(slots=True)
class Progress:
    """One migratable answer as the client has received it, across its legs.

    ``client_ids``: the client asked for token ids itself (they stay in what it gets).
    ``prompt_ids`` and ``generated`` come from the first leg's events and every leg's; ``legs``
    counts the legs read (above 1: the events are a continuation's, rewritten to look like the
    first leg's). ``usable`` turns False when an event lacked the ids a continuation needs
    (an engine that ignores ``return_token_ids``): such an answer is not migrated.
    """

    chat: bool
    client_ids: bool
    include_usage: bool
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    identity: dict[str, Any] = field(default_factory=dict)  # id, created, model
    finish_reason: str | None = None
    usage_sent: bool = False
    usable: bool = True
    legs: int = 1
    # A non-streamed request's answer, assembled from every leg's events (see whole()).
    collect: bool = False
    texts: list[str] = field(default_factory=list)
    stop_reason: Any = None
    engine_usage: dict[str, Any] | None = None  # the first leg's, as D counted it
    # The ids lists' bytes of the first leg's ordinary events relayed, not yet read: settle().
    pending: list[bytes] = field(default_factory=list)

    @classmethod
    def of(cls, creq: ClientRequest) -> Progress:
        options = creq.body.get("stream_options")
        usage = isinstance(options, dict) and bool(options.get("include_usage"))
        chat, ids = creq.endpoint is Endpoint.CHAT, bool(creq.body.get(IDS))
        return cls(chat, ids, usage, collect=not creq.stream)

    @property
    def resumable(self) -> bool:
        """Whether a continuation can be built from what was received."""
        self.settle()
        return self.usable and self.prompt_ids is not None

    def settle(self) -> None:
        """Record the ids of the ordinary events relayed but not yet read (:meth:`relayed`),
        in the order they came. Lists that are not JSON make the answer not resumable."""
        pending = self.pending
        if not pending:
            return
        self.pending = []
        try:
            ids = orjson.loads(b"[" + b",".join(pending) + b"]")
        except orjson.JSONDecodeError:
            self.usable = False  # the cut could not be placed
            return
        self.generated.extend(ids)

    def relayed(self, event: bytes) -> bytes | None:
        """``event`` (one SSE event, without its ``\\n\\n`` or ending with it: the caller
        says which is whole), if it is an ordinary token event of the first leg, as the
        client gets it (its ids made null unless asked), its ids kept to be recorded by
        :meth:`settle`; None for any other, to be read whole. Ordinary: the first leg's
        identity known, one line, ``"finish_reason":null`` (an error event has none), and
        one ids list, the generated one's (``"token_ids":[``; a prompt's list again, or a
        spaced key, and it is read whole). Each byte search here costs about as much as the
        rest of a token's relay: there are no more than these."""
        if self.legs != 1 or self.collect or not self.identity:
            return None
        end = event.find(b"\n")
        if (end >= 0 and end != len(event) - 2) or event.rfind(_FINISH_NULL) < 0:
            return None  # several events, or not a token's
        i = event.find(_IDS_LIST)
        if i < 1 or event[i - 1] != _QUOTE:
            return None  # no ids list, or a prompt's first
        start = i + _IDS_LEN
        close = event.find(b"]", start)
        if close < 0 or event.find(_IDS_LIST, close) >= 0:
            return None
        pending = self.pending
        if close > start:  # an empty list adds nothing
            pending.append(event[start:close])
        if len(pending) >= SETTLE_AT:
            self.settle()
        return event if self.client_ids else event[: start - 1] + b"null" + event[close + 1 :]

    def first_leg(self, event: bytes, doc: dict[str, Any]) -> bytes:
        """An event of the first leg (``doc`` parsed from it) as the client gets it: as D sent
        it, its ids made null where the client did not ask for them (as vLLM sends a stream
        that did not ask). Records its ids."""
        self.settle()
        self._read_first_leg(doc)
        return event if self.client_ids else null_ids(event)

    def _read_first_leg(self, doc: dict[str, Any]) -> None:
        if not self.identity:
            self.identity = {k: doc.get(k) for k in ("id", "created", "model")}
        ids = doc.get("prompt_token_ids")  # a chat's, on its first chunk
        for choice in doc.get("choices") or ():
            ids = choice.get("prompt_token_ids") or ids  # a completion's
            self._record(choice)
        if isinstance(ids, list) and self.prompt_ids is None:
            self.prompt_ids = ids
        self._saw_usage(doc)

    def continued(self, doc: dict[str, Any]) -> dict[str, Any]:
        """A continuation's completion chunk as the first leg's stream would have sent it:
        the first leg's id, created, model and shape (a chat chunk for a chat), the usage of
        the whole answer. Records its ids."""
        self.settle()
        for choice in doc.get("choices") or ():
            self._record(choice)
        out: dict[str, Any] = dict(self.identity)
        out["object"] = self._object()
        out["choices"] = [self._choice(c) for c in doc.get("choices") or ()]
        if self._saw_usage(doc):
            out["usage"] = self.usage()
        return out

    def _saw_usage(self, doc: dict[str, Any]) -> bool:
        if doc.get("usage") is None or doc.get("choices"):
            return False
        self.usage_sent = True
        if self.legs == 1:
            self.engine_usage = doc["usage"]
        return True

    def _record(self, choice: dict[str, Any]) -> None:
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.generated.extend(ids)
        elif _has_text(choice):
            self.usable = False  # text without ids: the cut could not be placed
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")
        if self.collect:
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if text:
                self.texts.append(text)

    def whole(self) -> dict[str, Any]:
        """A non-streamed request's answer as vLLM 0.32 answers it, from what the legs sent."""
        self.settle()
        text = "".join(self.texts)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {**_CHAT_MESSAGE, "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = self.finish_reason or "length"
        choice["stop_reason"] = self.stop_reason
        choice["token_ids"] = self.generated if self.client_ids else None
        prompt = self.prompt_ids if self.client_ids else None
        if not self.chat:
            choice.update(prompt_logprobs=None, prompt_token_ids=prompt)
        usage = self.engine_usage if self.legs == 1 and self.engine_usage else self.usage()
        doc: dict[str, Any] = {**self.identity, "object": _WHOLE_OBJECT[self.chat]}
        doc.update(choices=[choice], service_tier=None, system_fingerprint=None, usage=usage)
        if self.chat:
            doc.update(prompt_logprobs=None, prompt_token_ids=prompt)
        doc["kv_transfer_params"] = None
        return doc

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        text = choice.get("text") or ""
        out: dict[str, Any] = {"index": 0}
        if self.chat:
            out["delta"] = {"content": text} if text else {}
        else:
            out["text"] = text
        out["logprobs"] = None
        out["finish_reason"] = choice.get("finish_reason")
        if "stop_reason" in choice:
            out["stop_reason"] = choice["stop_reason"]
        if not self.chat:
            out["prompt_token_ids"] = None  # the client's came with the first leg
        out["token_ids"] = choice.get("token_ids") if self.client_ids else None
        return out

    def usage(self) -> dict[str, int]:
        """The whole answer's usage: the first leg's prompt, every token the client got."""
        self.settle()
        prompt = len(self.prompt_ids or ())
        done = len(self.generated)
        return {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done}

    def closing_events(self) -> list[dict[str, Any]]:
        """What an answer cut after its last token still owes the client (no engine left
        to ask): the final chunk if none came (``max_tokens`` reached at the cut), the usage
        if asked and not sent."""
        self.settle()
        events: list[dict[str, Any]] = []
        if self.finish_reason is None:
            choice: dict[str, Any] = {"index": 0}
            if self.chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            choice.update({"logprobs": None, "finish_reason": "length"})
            events.append({**self.identity, "object": self._object(), "choices": [choice]})
            self.finish_reason = "length"
        if self.include_usage and not self.usage_sent:
            usage = {**self.identity, "object": self._object(), "choices": []}
            events.append({**usage, "usage": self.usage()})
            self.usage_sent = True
        return events

    def _object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def client_bytes(self, events: list[bytes]) -> tuple[bytes, bool, bytes | None]:
        """The client's bytes for complete events: (bytes, ``[DONE]`` seen, D's error event
        if one came: the events after it are not the client's)."""
        out: list[bytes] = []
        for event in events:
            client = self.relayed(event)
            if client is not None:
                out.append(client + b"\n\n")
                continue
            payload = event.removeprefix(b"data: ").strip()
            if payload == b"[DONE]":
                return b"".join(out), True, None
            doc = _json(payload)
            if doc is None:
                out.append(event + b"\n\n")  # not a chunk (an SSE comment): as it came
            elif "error" in doc:
                return b"".join(out), False, event + b"\n\n"
            elif self.legs == 1:
                out.append(self.first_leg(event, doc) + b"\n\n")
            else:
                doc = self.continued(doc)
                out.append(b"data: " + orjson.dumps(doc) + b"\n\n")
        return b"".join(out), False, None


def null_ids(event: bytes) -> bytes:
    """``event`` with every token-id list made null, every other byte as it was (a scan, not
    a regex: this runs once per streamed token, and a regex cost four times as much)."""
    i = event.find(_IDS_KEY)
    while i >= 0:
        j = i + len(_IDS_KEY)
        while event[j : j + 1] == b" ":
            j += 1
        if event[j : j + 1] == b"[":
            end = event.index(b"]", j)
            event = event[:j] + b"null" + event[end + 1 :]
        i = event.find(_IDS_KEY, j)
    return event


def _has_text(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return bool(text)


def _json(payload: bytes) -> dict[str, Any] | None:
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None
