"""The goodput sweep's figures: per-request SLO checks, medians over repeats, tables, the PNG.

Goodput is vLLM's own measure (``vllm bench serve --goodput``, after DistServe): requests that
met every bound of an SLO, per second of the run. It is computed here from ``vllm bench serve``'s
per-request detail with vLLM's formulas (a request's TPOT is ``(latency - TTFT) / (tokens - 1)``,
0 for one token), so one run gives it for any number of SLOs.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# What ``vllm bench serve`` reports that the tables show (its own names).
CLIENT_KEYS = (
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
    "request_throughput",
)  # fmt: skip
BASELINE = "dp2"  # two aggregated engines on the same two cores: what P/D must beat


@dataclass(frozen=True)
class Slo:
    """A latency target: ``chat:2000:100`` is TTFT <= 2,000 ms and TPOT <= 100 ms."""

    name: str
    ttft_ms: float
    tpot_ms: float

    @classmethod
    def parse(cls, text: str) -> Slo:
        name, ttft, tpot = text.split(":")
        return cls(name, float(ttft), float(tpot))

    @property
    def key(self) -> str:
        return f"goodput_{self.name}"

    def label(self) -> str:
        return f"{self.name} (TTFT <= {self.ttft_ms:g} ms, TPOT <= {self.tpot_ms:g} ms)"


def goodput(detail: dict[str, Any], slo: Slo) -> float:
    """Requests of one ``vllm bench serve`` result (``--save-detailed``) that met ``slo``, per
    second of its duration; a failed request never counts."""
    good = 0
    columns = ("ttfts", "latencies", "output_lens", "errors")
    rows = zip(*(detail[c] for c in columns), strict=True)  # one entry per request in each
    for ttft, latency, tokens, error in rows:
        if error or not tokens:
            continue
        tpot = (latency - ttft) / (tokens - 1) if tokens > 1 else 0.0
        good += ttft * 1000 <= slo.ttft_ms and tpot * 1000 <= slo.tpot_ms
    return good / float(detail["duration"])


def client_figures(detail: dict[str, Any], slos: Sequence[Slo]) -> dict[str, float]:
    figures = {key: float(detail[key]) for key in CLIENT_KEYS if detail.get(key) is not None}
    figures |= {slo.key: goodput(detail, slo) for slo in slos}
    figures["failed"] = float(detail.get("failed") or 0)
    return figures


@dataclass(frozen=True)
class Point:
    input_len: int
    qps: float


@dataclass
class Result:
    """One mode at one point, over repeats: the client's figures and the TTFT breakdown."""

    client: list[dict[str, float]] = field(default_factory=list)
    breakdown: list[dict[str, float]] = field(default_factory=list)

    def median(self, key: str) -> float:
        values = [r[key] for r in self.client if key in r]
        return statistics.median(values) if values else float("nan")

    def breakdown_median(self, key: str) -> float:
        values = [b[key] for b in self.breakdown if key in b and b[key] == b[key]]
        return statistics.median(values) if values else float("nan")


Results = dict[tuple[str, Point], Result]


def save(results: Results, path: Path, meta: dict[str, Any]) -> None:
    """Everything the tables and the PNG are drawn from, to draw them again (``--replot``)."""
    rows = [
        {"mode": mode, **asdict(point), **asdict(result)}
        for (mode, point), result in results.items()
    ]
    path.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))


def load(path: Path) -> tuple[Results, dict[str, Any]]:
    data = json.loads(path.read_text())
    results: Results = {}
    for row in data["results"]:
        point = Point(int(row["input_len"]), float(row["qps"]))
        results[(row["mode"], point)] = Result(row["client"], row["breakdown"])
    return results, data["meta"]


# -- ratios and tables -----------------------------------------------------------------------


def ratio_text(results: Results, mode: str, base: str, p: Point, key: str) -> str:
    """Median over repeats of ``key``'s ratio to ``base``'s in the same repeat, with its range:
    ``0.52 (0.48-0.57)``."""
    mine, theirs = results.get((mode, p)), results.get((base, p))
    if mine is None or theirs is None:
        return "-"
    pairs = zip(mine.client, theirs.client, strict=False)
    ratios = [a[key] / b[key] for a, b in pairs if key in a and b.get(key, 0) > 0]
    if not ratios:
        return "-"
    med = statistics.median(ratios)
    return f"{med:.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else f"{med:.2f}"


def _num(value: float, digits: int = 0) -> str:
    return "-" if value != value else f"{value:,.{digits}f}"  # NaN: no observation


def print_goodput_table(
    results: Results, modes: list[str], points: list[Point], slos: list[Slo]
) -> None:
    """One row per point and mode: goodput per SLO, TTFT and TPOT, and their ratios to dp2."""
    head = [f"goodput {s.name}" for s in slos] + [
        "mean TTFT", "p99 TTFT", "mean TPOT", "p99 TPOT", "req/s",
    ]  # fmt: skip
    ratios = [f"{s.name} goodput vs {BASELINE}" for s in slos] + [
        f"TTFT vs {BASELINE}", f"TPOT vs {BASELINE}",
    ]  # fmt: skip
    print("| mode | input | QPS | " + " | ".join(head + ratios) + " |")
    print("|---|---|---|" + "---|" * (len(head) + len(ratios)))
    for p in points:
        for mode in modes:
            r = results.get((mode, p))
            if r is None:
                continue
            cells = [_num(r.median(s.key), 2) for s in slos]
            cells += [_num(r.median(k)) for k in ("mean_ttft_ms", "p99_ttft_ms")]
            cells += [_num(r.median(k)) for k in ("mean_tpot_ms", "p99_tpot_ms")]
            cells.append(_num(r.median("request_throughput"), 2))
            keys = [s.key for s in slos] + ["mean_ttft_ms", "mean_tpot_ms"]
            cells += [ratio_text(results, mode, BASELINE, p, k) for k in keys]
            print(f"| {mode} | {p.input_len} | {p.qps:g} | " + " | ".join(cells) + " |")


BREAKDOWN_KEYS = (
    "router_ttft", "p_queue", "p_prefill", "kv_xfer", "d_queue", "d_first_step", "d_ttft",
    "router_prefill", "router_handoff", "d_alone_pct", "p_alone_pct",
)  # fmt: skip


def print_breakdown(results: Results, modes: list[str], points: list[Point]) -> None:
    print("\nTTFT breakdown, mean ms per request (router's and engines' own histograms)\n")
    print("| mode | input | QPS | client TTFT | " + " | ".join(BREAKDOWN_KEYS) + " |")
    print("|---|---|---|---|" + "---|" * len(BREAKDOWN_KEYS))
    for p in points:
        for mode in modes:
            r = results.get((mode, p))
            if r is None:
                continue
            cells = [_num(r.median("mean_ttft_ms"))]
            cells += [_num(r.breakdown_median(k)) for k in BREAKDOWN_KEYS]
            print(f"| {mode} | {p.input_len} | {p.qps:g} | " + " | ".join(cells) + " |")


def plot(
    results: Results, modes: list[str], points: list[Point], slos: list[Slo], path: Path
) -> None:
    """Goodput against QPS, one line per mode, one panel per input length and SLO."""
    import matplotlib  # the `bench` extra; imported here so the sweep runs without it

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    inputs = sorted({p.input_len for p in points})
    fig, axes = plt.subplots(
        len(slos), len(inputs), figsize=(5 * len(inputs), 3.6 * len(slos)), squeeze=False
    )
    for row, slo in enumerate(slos):
        for col, n in enumerate(inputs):
            ax = axes[row][col]
            qps = sorted(p.qps for p in points if p.input_len == n)
            for mode in modes:
                ys = [_median_or_nan(results, mode, Point(n, q), slo.key) for q in qps]
                ax.plot(qps, ys, marker="o", label=mode)
            ax.plot(qps, qps, color="grey", linestyle=":", linewidth=1, label="offered")
            ax.set_title(f"{n}-token prompts, {slo.label()}", fontsize=8)
            ax.set_xlabel("offered QPS")
            ax.set_ylabel("goodput (req/s)")
            ax.set_xlim(left=0)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _median_or_nan(results: Results, mode: str, p: Point, key: str) -> float:
    r = results.get((mode, p))
    return r.median(key) if r is not None else float("nan")
