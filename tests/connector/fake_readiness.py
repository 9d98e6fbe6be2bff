"""A readiness whose marks the test releases: the "device" finishes work when the test says."""

from __future__ import annotations

from dataclasses import dataclass, field


class HeldMark:
    """Not ready until ``release``; counts how often it was asked."""

    def __init__(self) -> None:
        self.released = False
        self.queries = 0

    def ready(self) -> bool:
        self.queries += 1
        return self.released

    def release(self) -> None:
        self.released = True


@dataclass
class HeldReadiness:
    """Implements ``connector.readiness.Readiness``; ``marks`` in the order they were recorded."""

    marks: list[HeldMark] = field(default_factory=list)

    def mark(self) -> HeldMark:
        m = HeldMark()
        self.marks.append(m)
        return m

    def release_all(self) -> None:
        for m in self.marks:
            m.release()
