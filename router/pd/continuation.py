"""What a migrated request is made of, as pure functions over its body and its stream's events.

A streamed completion or chat completion whose D leg breaks mid-stream is continued on another
engine (router/pd/migration.py) as a completion whose prompt is token ids: the prompt's ids and
the ids of every token the client has received, which vLLM 0.32 streams when asked with
``return_token_ids`` (a completion's prompt ids on its first choice, a chat's at the top of its
first chunk; each chunk's generated ids on its choice). A chat's template was applied by the
first engine, so its prompt ids are the conversation as the model saw it: the continuation goes
through ``/v1/completions`` and its chunks are re-wrapped as chat chunks.

:func:`refusal` says which requests are never migrated: those whose continuation could not give
the uninterrupted answer's tokens (several choices, logprobs, stop strings that may span the cut,
penalties counted over the output, structured output whose state would restart, kept turns).

:class:`Progress` (router/pd/progress.py) follows one answer across its legs: it rewrites each
event for the client (ids the client did not ask for removed; a continuation's identity, usage
and chat shape made the first leg's) and records what the client has received, from which the
continuation's body is built (:func:`continuation`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from router.client_request import ClientRequest, Endpoint
from router.pd.progress import IDS as _IDS
from router.pd.progress import Progress

__all__ = ["continuation", "refusal", "remaining", "with_token_ids"]

# Fields that make the continuation differ from the uninterrupted answer: present and not
# null/false/0/empty, the request is not migrated (docs/operations.md#migration).
_REFUSING_FIELDS = {
    "logprobs": "logprobs",
    "top_logprobs": "logprobs",
    "prompt_logprobs": "logprobs",
    "echo": "echo",
    "suffix": "suffix",
    # vLLM checks stop strings in the new text only: one spanning the cut would be missed.
    "stop": "stop_strings",
    # Counted over the output tokens: the continuation's output starts empty.
    "presence_penalty": "penalties",
    "frequency_penalty": "penalties",
    # The grammar's or the parser's state would restart at the cut.
    "response_format": "structured_output",
    "structured_outputs": "structured_output",
    "guided_json": "structured_output",
    "guided_regex": "structured_output",
    "guided_choice": "structured_output",
    "guided_grammar": "structured_output",
    "tools": "tools",
    "truncate_prompt_tokens": "truncation",
}
# Chat fields a completion does not take (the template was applied by the first leg).
_CHAT_ONLY = (
    "messages",
    "max_completion_tokens",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "tool_choice",
    "parallel_tool_calls",
    "documents",
    "reasoning_effort",
    "include_reasoning",
    "add_special_tokens",
    "mm_processor_kwargs",
)


def refusal(creq: ClientRequest, kept_turns: bool, non_streamed: bool = False) -> str | None:
    """Why ``creq`` is never migrated (a short reason for the log), or None if it may be.
    ``kept_turns``: its model keeps turns on D (a kept turn is D's own, it cannot move).
    ``non_streamed``: a non-streamed request may be (``migration.non_streamed``)."""
    body = creq.body
    if creq.endpoint not in (Endpoint.COMPLETIONS, Endpoint.CHAT):
        return "endpoint"
    if not creq.stream and not non_streamed:
        return "not_streamed"
    if creq.n != 1 or (_set(body.get("best_of")) and body.get("best_of") != 1):
        return "n"
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs is not False:  # a completion's 0 asks for some
        return "logprobs"
    if creq.num_prompts != 1:
        return "prompts"
    if kept_turns:
        return "kept_turns"
    for name, reason in _REFUSING_FIELDS.items():
        if _set(body.get(name)):
            return reason
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "continuous_usage"
    return None


def _set(value: Any) -> bool:
    return value is not None and value is not False and value != 0 and value != [] and value != ""


def with_token_ids(creq: ClientRequest) -> ClientRequest:
    """``creq`` asking its engines for token ids (``return_token_ids``); a non-streamed one
    streamed, with its usage, for the router to assemble (:meth:`Progress.whole`)."""
    body = {**creq.body, _IDS: True}
    if creq.stream:
        return dataclasses.replace(creq, body=body)
    body.update(stream=True, stream_options={"include_usage": True})
    return dataclasses.replace(creq, body=body, stream=True)


def remaining(creq: ClientRequest, progress: Progress) -> int | None:
    """Output tokens the continuation may still generate (None: no limit was asked)."""
    if creq.max_output is None:
        return None
    return max(0, creq.max_output - len(progress.generated))


def continuation(creq: ClientRequest, progress: Progress) -> ClientRequest:
    """The completion that continues ``creq`` where ``progress`` stands: its prompt the prompt's
    ids then the generated ids, ``max_tokens`` (and ``min_tokens``) less what was generated,
    every other sampling and stop setting kept, token ids asked for; its priority class and
    session kept, no TTFT deadline."""
    assert progress.prompt_ids is not None, "continued without the prompt's ids"
    ids = [*progress.prompt_ids, *progress.generated]
    body = {k: v for k, v in creq.body.items() if k not in _CHAT_ONLY}
    body["prompt"] = ids
    body["stream"] = True
    body[_IDS] = True
    left = remaining(creq, progress)
    if left is not None:
        body["max_tokens"] = left
    minimum = body.get("min_tokens")
    if isinstance(minimum, int) and minimum:
        body["min_tokens"] = max(0, minimum - len(progress.generated))
    return dataclasses.replace(
        creq,
        endpoint=Endpoint.COMPLETIONS,
        body=body,
        num_prompts=1,
        prompt_chars=len(ids),
        prompt_is_tokens=True,
        max_output=left,
        max_output_field="max_tokens",
        # The TTFT deadline was the first token's, met: a continuation waiting for a slot
        # must not be refused for it.
        ttft_deadline_ms=None,
        deadline_at=None,
    )
