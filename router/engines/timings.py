"""What recent requests of one model took, as the router saw them: the adaptive choice's
estimates (``router/pd/adaptive.py``).

Two exponentially weighted moving averages, each None until its first observation:

- ``prefill_s_per_token``: seconds an engine took to compute a prompt, per prompt token
  (estimated the same way the choice estimates the next prompt, so the estimator's bias
  cancels): from P legs (sent to P's answer) and streamed single-engine requests (sent to
  their first bytes) that found their engine computing no other prompt for this router. A
  prompt sent behind others waits for them, and the choice counts that wait itself (the
  prompts pending times this estimate);
- ``step_s``: seconds per output token of a stream D decodes, from its first bytes to its
  end over the reads in between (about one per token; reads that merged tokens make it err
  high). It includes the stalls the stream met, so it grows as D computes more prompts;
- ``prefill_step_s``: the same, of streams P serves alone (which wait behind every P/D
  prompt): kept apart, so that they do not make D's streams look slow;

and two ledgers, ``given_prefill`` and ``given_decode``: the prompt seconds the choice gave
each role, by time given, which it reads over a stream's life (its admission bound); and
``prefill_tokens``, the prompt tokens sent to P per second over the last minute (what an
autoscaler scales P on: ``router/demand.py``).

The dispatcher (``router/pd/dispatch.py``) is the one writer; the choice reads.
"""

from __future__ import annotations

from collections import deque

__all__ = ["WEIGHT", "PromptLedger", "RateWindow", "Timings"]

# The weight of a new observation: the estimate follows roughly the last ten requests.
WEIGHT = 0.2


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)


class PromptLedger:
    """Prompt seconds given to one role, by the time they were given: the sum over any
    recent window. Entries older than the longest window asked for are dropped, so the
    ledger holds at most one window of choices."""

    __slots__ = ("_entries", "_total")

    def __init__(self) -> None:
        self._entries: deque[tuple[float, float]] = deque()
        self._total = 0.0

    def add(self, now: float, seconds: float) -> None:
        """``seconds`` of prompt given at ``now`` (monotonic, non-decreasing)."""
        self._entries.append((now, seconds))
        self._total += seconds

    def within(self, now: float, window: float) -> float:
        """The seconds given in ``(now - window, now]``; older entries are dropped."""
        entries = self._entries
        while entries and entries[0][0] <= now - window:
            self._total -= entries.popleft()[1]
        if not entries:
            self._total = 0.0  # no drift from the float sums once empty
        return max(0.0, self._total)


class RateWindow:
    """A count per second over the last ``seconds`` seconds (whole-second buckets, a ring):
    constant memory whatever the rate, unlike a ledger of every event."""

    __slots__ = ("_buckets", "_seconds", "_stamps")

    def __init__(self, seconds: int = 60) -> None:
        self._seconds = seconds
        # One more bucket than the window: the second being counted beside the window's.
        self._buckets = [0.0] * (seconds + 1)
        self._stamps = [-1] * (seconds + 1)  # the whole second each bucket holds

    def add(self, now: float, amount: float) -> None:
        second = int(now)
        i = second % len(self._buckets)
        if self._stamps[i] != second:
            self._stamps[i], self._buckets[i] = second, 0.0
        self._buckets[i] += amount

    def rate(self, now: float) -> float:
        """The mean per second over the window's whole seconds before ``now``'s."""
        second = int(now)
        first = second - self._seconds
        total = sum(
            b for b, t in zip(self._buckets, self._stamps, strict=True) if first <= t < second
        )
        return total / self._seconds


class Timings:
    """One model's recent prefill and decode-step times, and the prompt work the choice gave
    each role (see module doc)."""

    __slots__ = (
        "given_decode",
        "given_prefill",
        "prefill_s_per_token",
        "prefill_step_s",
        "prefill_tokens",
        "step_s",
    )

    def __init__(self) -> None:
        self.prefill_s_per_token: float | None = None
        self.step_s: float | None = None
        self.prefill_step_s: float | None = None
        self.given_prefill = PromptLedger()
        self.given_decode = PromptLedger()
        # Prompt tokens (estimated) sent to P legs, per second: P's demand (router/demand.py).
        self.prefill_tokens = RateWindow()

    def observe_prefill(self, seconds: float, prompt_tokens: int) -> None:
        """A prompt of ``prompt_tokens`` (estimated) took ``seconds`` to compute."""
        if prompt_tokens > 0 and seconds >= 0:
            self.prefill_s_per_token = _ewma(self.prefill_s_per_token, seconds / prompt_tokens)

    def observe_stream(self, seconds: float, tokens: int, on_prefill: bool = False) -> None:
        """A stream took ``seconds`` from its first bytes to its end over ``tokens`` reads;
        ``on_prefill``: P served it alone."""
        if tokens > 0 and seconds >= 0:
            if on_prefill:
                self.prefill_step_s = _ewma(self.prefill_step_s, seconds / tokens)
            else:
                self.step_s = _ewma(self.step_s, seconds / tokens)
