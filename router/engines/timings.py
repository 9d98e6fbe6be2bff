"""What recent requests of one model took, as the router saw them: the adaptive choice's
estimates (``router/pd/adaptive.py``).

Two exponentially weighted moving averages, each None until its first observation:

- ``prefill_s_per_token``: seconds an engine took to compute a prompt, per prompt token
  (estimated the same way the choice estimates the next prompt, so the estimator's bias
  cancels): from every P leg (sent to P's answer) and every single-engine request (sent to
  its first bytes). Both include the wait in the engine's queue, so under load the estimate
  grows, which is what a choice between waiting there and elsewhere needs;
- ``step_s``: seconds per output token of a stream, from its first bytes to its end over the
  reads in between (about one per token; reads that merged tokens make it err high);

and two shares, 0 until observed: ``prefill_busy`` and ``decode_busy``, the share of recent
requests that found P (D) computing a prompt for this router. Poisson arrivals see time
averages, so each is an estimate of the share of time that engine spends on prompts, during
which the streams it decodes wait.

The dispatcher (``router/pd/dispatch.py``) is the one writer; the choice reads.
"""

from __future__ import annotations

__all__ = ["BUSY_WEIGHT", "WEIGHT", "Timings"]

# The weight of a new observation: the estimate follows roughly the last ten requests.
WEIGHT = 0.2
# A share is of 0/1 samples: a lower weight (about the last twenty requests) steadies it.
BUSY_WEIGHT = 0.1


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)


class Timings:
    """One model's recent prefill and decode-step times (see module doc)."""

    __slots__ = ("decode_busy", "prefill_busy", "prefill_s_per_token", "step_s")

    def __init__(self) -> None:
        self.prefill_s_per_token: float | None = None
        self.step_s: float | None = None
        self.prefill_busy = 0.0
        self.decode_busy = 0.0

    def observe_arrival(self, prefill_busy: bool, decode_busy: bool) -> None:
        """A request arrived and found P (D) computing a prompt, or not."""
        self.prefill_busy += BUSY_WEIGHT * (prefill_busy - self.prefill_busy)
        self.decode_busy += BUSY_WEIGHT * (decode_busy - self.decode_busy)

    def observe_prefill(self, seconds: float, prompt_tokens: int) -> None:
        """A prompt of ``prompt_tokens`` (estimated) took ``seconds`` to compute."""
        if prompt_tokens > 0 and seconds >= 0:
            self.prefill_s_per_token = _ewma(self.prefill_s_per_token, seconds / prompt_tokens)

    def observe_stream(self, seconds: float, tokens: int) -> None:
        """A stream took ``seconds`` from its first bytes to its end over ``tokens`` reads."""
        if tokens > 0 and seconds >= 0:
            self.step_s = _ewma(self.step_s, seconds / tokens)
