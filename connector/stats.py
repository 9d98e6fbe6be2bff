"""Engine-side transfer statistics: collected per worker, merged by vLLM, exported to Prometheus.

The worker fills a ``WorkerStats`` and hands vLLM a snapshot each step (``take``). vLLM merges
snapshots across workers and logging intervals with ``PipelinedStats.aggregate`` and passes the
merged dict to ``PipelinedPromMetrics.observe``. The dict is plain data so it crosses processes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["FAILURE_KINDS", "WorkerStats", "empty_data", "merge_data", "reduce_data"]

FAILURE_KINDS = (
    "handshake",
    "refused",
    "reg_timeout",
    "recv_timeout",
    "write_timeout",
    "write_error",
    "ack_timeout",
    "prefill_abort",
    "decode_abort",
    "peer_fail",
)

_SUMS = (
    "bytes_written",
    "num_writes",
    "bytes_received",
    "requests_sent",
    "requests_received",
    "turns_kept",  # D: finished turns kept for a next P (connector.kept_turns_worker)
    "kept_expired",  # D: kept turns nobody asked for within keep_ttl_s
    "tokens_pulled",  # P: prompt tokens whose KV came from a kept turn, not computed
    "kept_missed",  # P: kept turns D refused or did not answer (P computed those tokens)
    "notices_repeated",  # both: REG, DONE, ACK or HELLO sent again to a peer still waiting
)
_LISTS = ("writes_per_request", "write_seconds", "write_tail_seconds", "handshake_seconds")


def empty_data() -> dict[str, Any]:
    data: dict[str, Any] = {k: 0 for k in _SUMS}
    data.update({k: [] for k in _LISTS})
    data["failures"] = {}
    return data


def merge_data(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Sum counters, concatenate observations, add failure counts by kind."""
    out = empty_data()
    for k in _SUMS:
        out[k] = int(a.get(k, 0)) + int(b.get(k, 0))
    for k in _LISTS:
        out[k] = list(a.get(k, ())) + list(b.get(k, ()))
    out["failures"] = dict(Counter(a.get("failures", {})) + Counter(b.get("failures", {})))
    return out


def reduce_data(data: dict[str, Any]) -> dict[str, int | float]:
    """One summary line for vLLM's periodic log."""
    writes = data.get("writes_per_request") or [0]
    secs = data.get("write_seconds") or [0.0]
    out: dict[str, int | float] = {k: data.get(k, 0) for k in _SUMS}
    out["avg_writes_per_request"] = round(sum(writes) / len(writes), 2)
    out["avg_request_write_ms"] = round(1000 * sum(secs) / len(secs), 3)
    out["failures"] = sum(data.get("failures", {}).values())
    return out


class WorkerStats:
    """Mutable accumulator owned by one worker (single-threaded use)."""

    def __init__(self) -> None:
        self._data = empty_data()

    def wrote(self, nbytes: int) -> None:
        self._data["bytes_written"] += nbytes
        self._data["num_writes"] += 1

    def sent(self, writes: int, seconds: float, tail: float) -> None:
        """One request fully pushed: ``writes`` WRITEs, ``seconds`` from the first post to the
        last completion, ``tail`` from the end of the prompt's last step to that completion
        (the transfer left after P's compute, which D waits for)."""
        self._data["requests_sent"] += 1
        self._data["writes_per_request"].append(writes)
        self._data["write_seconds"].append(seconds)
        self._data["write_tail_seconds"].append(tail)

    def received(self, nbytes: int) -> None:
        self._data["requests_received"] += 1
        self._data["bytes_received"] += nbytes

    def kept(self) -> None:
        self._data["turns_kept"] += 1

    def kept_expired(self) -> None:
        self._data["kept_expired"] += 1

    def kept_missed(self) -> None:
        self._data["kept_missed"] += 1

    def pulled(self, tokens: int) -> None:
        self._data["tokens_pulled"] += tokens

    def repeated(self) -> None:
        """A notice sent again to a peer still waiting on it (``Timeouts.nudge_s``)."""
        self._data["notices_repeated"] += 1

    def handshake(self, seconds: float) -> None:
        self._data["handshake_seconds"].append(seconds)

    def failure(self, kind: str) -> None:
        fails = self._data["failures"]
        fails[kind] = fails.get(kind, 0) + 1

    def is_empty(self) -> bool:
        return self._data == empty_data()

    def take(self) -> dict[str, Any] | None:
        """The observations since the last call, or None if there were none."""
        if self.is_empty():
            return None
        data, self._data = self._data, empty_data()
        return data
