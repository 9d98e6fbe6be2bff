"""Scraping and reading Prometheus text metrics (vLLM engines and the router)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    """One sample line: full sample name (with ``_total``/``_sum``... suffix), labels, value."""

    name: str
    labels: Mapping[str, str]
    value: float


class MetricsPage:
    """An immutable snapshot of one ``/metrics`` page."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples

    @classmethod
    def parse(cls, text: str) -> MetricsPage:
        """Parse Prometheus text exposition format."""
        samples = [
            Sample(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]
        return cls(samples)

    def select(self, name: str, **labels: str) -> list[Sample]:
        """Samples named exactly ``name`` whose labels include ``labels``."""
        return [
            s
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def total(self, name: str, **labels: str) -> float:
        """Sum of the matching samples (0.0 when there are none)."""
        return sum(s.value for s in self.select(name, **labels))

    def has(self, name: str) -> bool:
        """Whether any sample is named exactly ``name``."""
        return any(s.name == name for s in self.samples)

    def names(self, contains: str = "") -> list[str]:
        """Sorted distinct sample names containing ``contains``."""
        return sorted({s.name for s in self.samples if contains in s.name})


def scrape(base_url: str, timeout_s: float = 5.0) -> MetricsPage:
    """GET ``base_url``/metrics and parse it; raises ``httpx.HTTPError`` on failure."""
    response = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s)
    response.raise_for_status()
    return MetricsPage.parse(response.text)
