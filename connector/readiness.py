"""When the device has written a layer's KV: marks recorded on the compute stream, polled later.

vLLM calls ``save_kv_layer`` right after it *launches* a layer's kernels and ``wait_for_save``
right after it launches the forward; on a GPU the bytes may not be in the cache yet at either
hook. P therefore records a ``Mark`` at each hook and posts a WRITE only once its mark is ready.
Neither recording nor polling ever blocks the forward thread.

``HostReadiness`` is for a KV cache in host memory (vLLM's CPU backend runs the forward
synchronously, so the KV exists when the hook runs); ``CudaReadiness`` records a CUDA event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["CudaReadiness", "HostReadiness", "Mark", "Readiness", "readiness_for"]


class Mark(Protocol):
    """A point on the compute stream."""

    def ready(self) -> bool:
        """True once the device has finished all work recorded on the stream before the mark.
        Never blocks; once True, stays True."""
        ...


class Readiness(Protocol):
    """Records marks on the stream that computes (and writes) the KV cache."""

    def mark(self) -> Mark:
        """A mark after the work launched so far; never blocks the forward thread."""
        ...


class _Ready:
    """A mark that is always ready."""

    __slots__ = ()

    def ready(self) -> bool:
        return True


class HostReadiness:
    """KV cache in host memory, written synchronously by the forward: always ready, and free
    (every call returns the same mark)."""

    __slots__ = ("_mark",)

    def __init__(self) -> None:
        self._mark = _Ready()

    def mark(self) -> Mark:
        return self._mark


class _EventMark:
    """A recorded CUDA event. The event is dropped once it has completed, so a mark shared by
    several transfers costs one query in all once ready."""

    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event: torch.cuda.Event | None = event

    def ready(self) -> bool:
        if self._event is None:
            return True
        if not self._event.query():  # non-blocking: cudaEventQuery
            return False
        self._event = None
        return True


class CudaReadiness:
    """KV cache in CUDA memory: a mark is an event recorded on ``device``'s current stream,
    the stream vLLM launches the forward (attention and cache writes included) on.

    Must be used on the thread that runs the forward (vLLM's model-runner thread), whose
    current stream is the compute stream. torch is imported on first use only.
    """

    __slots__ = ("_device",)

    def __init__(self, device: torch.device | None = None) -> None:
        self._device = device

    def mark(self) -> Mark:
        import torch

        event = torch.cuda.Event()  # no timing: the cheapest kind to record and query
        event.record(torch.cuda.current_stream(self._device))
        return _EventMark(event)


def readiness_for(device: torch.device) -> Readiness:
    """The readiness for a KV cache on ``device``, by its type.

    Raises ``ValueError`` for other device types: their hooks may run before the KV is
    written, and no mark for them is known to be right.
    """
    if device.type == "cpu":
        return HostReadiness()
    if device.type == "cuda":  # ROCm's devices are "cuda" to torch as well
        return CudaReadiness(device)
    raise ValueError(f"no readiness for a KV cache on {device.type!r} (cpu and cuda only)")
