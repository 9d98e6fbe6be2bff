"""The check's "attention kernels": each writes one layer's KV for some tokens, *late*.

vLLM calls ``save_kv_layer`` right after it launches a layer's kernels; on CUDA the bytes land
in the cache some time later. A connector that posts a layer's WRITE before they land sends
stale KV. Two ways to make that happen on purpose:

* ``CudaKernels``: the real thing. ``torch.cuda._sleep`` then the copy, both on the current
  stream, so the write lands well after the hook returned. The connector picks its own
  readiness (a CUDA event per mark).
* ``SimKernels``: a deterministic CPU stand-in for a stream. A launched write runs only after
  ``LAG`` more of P's hooks have returned (so a step's last layers land after its
  ``get_finished``, as on a busy GPU), and only once every WRITE the connector has posted so
  far has completed; ``SimReadiness``'s marks become ready once everything launched before
  them ran, as an event recorded on a stream does. A connector that posts a layer before its
  mark is ready therefore always sends the stale bytes (the negative control), and one that
  waits always sends the final ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from connector.readiness import Readiness

__all__ = ["CudaKernels", "Kernels", "SimKernels", "SimMark", "SimReadiness", "write"]

Index = tuple["torch.Tensor", "torch.Tensor"]  # (block ids, token slots), one pair per token


def write(dst: torch.Tensor, index: Index, values: torch.Tensor) -> None:
    """``dst[block, slot] = values[token]`` for every token (``dst``: ``[B, N, H, C]``)."""
    dst[index] = values


class Kernels(Protocol):
    """Where P's kernels run, as the check's driver sees it."""

    def launch(self, dst: torch.Tensor, index: Index, values: torch.Tensor) -> None:
        """Start writing ``values`` into ``dst`` at ``index``; it lands later."""

    def hook_returned(self) -> None:
        """One of P's connector hooks has just returned."""

    def finish(self) -> None:
        """Block until everything launched has landed."""

    def readiness(self) -> Readiness | None:
        """What P's worker is given to know when a layer has landed (None: its own pick)."""


class CudaKernels:
    """Kernels on the current CUDA stream, each delayed by ``sleep_cycles`` GPU cycles."""

    def __init__(self, sleep_cycles: int) -> None:
        self._cycles = sleep_cycles

    def launch(self, dst: torch.Tensor, index: Index, values: torch.Tensor) -> None:
        import torch

        torch.cuda._sleep(self._cycles)
        write(dst, index, values)

    def hook_returned(self) -> None:
        """The GPU needs no help to make progress."""

    def finish(self) -> None:
        import torch

        torch.cuda.synchronize()

    def readiness(self) -> Readiness | None:
        return None  # the connector's choice for CUDA tensors: a CUDA event per mark


@dataclass(slots=True)
class _Launch:
    after_hooks: int  # runs once this many of P's hooks have returned
    run: Callable[[], None]


class SimKernels:
    """A CPU stream whose work lands late, deterministically (see the module docstring).

    ``wait_writes`` blocks until every WRITE P's connector has posted has completed; it is
    called before any launched write runs, so no WRITE can read bytes written after it.
    """

    LAG = 3  # P's hooks that return between a launch and its write landing

    def __init__(self, wait_writes: Callable[[], None]) -> None:
        self._wait_writes = wait_writes
        self._queue: list[_Launch] = []
        self._hooks = 0
        self.launched = 0
        self.ran = 0

    def launch(self, dst: torch.Tensor, index: Index, values: torch.Tensor) -> None:
        def run() -> None:
            write(dst, index, values)

        self._queue.append(_Launch(self._hooks + self.LAG, run))
        self.launched += 1

    def hook_returned(self) -> None:
        self._hooks += 1
        if self._queue and self._queue[0].after_hooks <= self._hooks:
            self._wait_writes()
        while self._queue and self._queue[0].after_hooks <= self._hooks:
            self._queue.pop(0).run()
            self.ran += 1

    def finish(self) -> None:
        self._wait_writes()
        while self._queue:
            self._queue.pop(0).run()
            self.ran += 1

    def readiness(self) -> Readiness | None:
        return SimReadiness(self)


class SimMark:
    """Ready once every write launched before it was recorded has run."""

    def __init__(self, kernels: SimKernels) -> None:
        self._kernels = kernels
        self._upto = kernels.launched

    def ready(self) -> bool:
        return self._kernels.ran >= self._upto


class SimReadiness:
    """The connector's readiness seam over ``SimKernels``: a mark on the simulated stream."""

    def __init__(self, kernels: SimKernels) -> None:
        self._kernels = kernels

    def mark(self) -> SimMark:
        return SimMark(self._kernels)
