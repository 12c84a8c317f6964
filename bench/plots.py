"""Latency-vs-QPS plots (matplotlib, Agg) and markdown tables of benchmark runs.

`python -m bench.plots A.json B.json --out fig.png` overlays result files (one configuration
each, labelled by file stem or `--labels`).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

LATENCIES: tuple[tuple[str, str], ...] = (
    ("ttft_ms", "TTFT"),
    ("tpot_ms", "TPOT"),
    ("itl_ms", "ITL"),
    ("e2el_ms", "E2EL"),
)
STATS: tuple[str, ...] = ("median", "p90", "p99")


def _qps(run: dict[str, Any]) -> float:
    return math.inf if run["qps"] == "inf" else float(run["qps"])


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(series: dict[str, list[dict[str, Any]]]) -> str:
    """One row per (configuration, QPS): counts, throughput and latency mean / P99 in ms."""
    head = (
        "| config | QPS | done | failed | req/s | out tok/s | TTFT mean | TTFT P99 "
        "| TPOT mean | TPOT P99 | ITL P99 | E2EL mean | E2EL P99 | goodput |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, runs in series.items():
        for run in sorted(runs, key=_qps):
            m = run["metrics"]
            lines.append(
                f"| {label} | {run['qps']} | {m['completed']} | {m['failed']} "
                f"| {m['request_throughput']:.2f} | {m['output_throughput']:.1f} "
                f"| {_fmt(m['ttft_ms']['mean'])} | {_fmt(m['ttft_ms']['p99'])} "
                f"| {_fmt(m['tpot_ms']['mean'])} | {_fmt(m['tpot_ms']['p99'])} "
                f"| {_fmt(m['itl_ms']['p99'])} "
                f"| {_fmt(m['e2el_ms']['mean'])} | {_fmt(m['e2el_ms']['p99'])} "
                f"| {_fmt(m.get('goodput'), 2)} |"
            )
    return "\n".join(lines)


def plot_latency_vs_qps(
    series: dict[str, list[dict[str, Any]]], out_png: str | Path, title: str = ""
) -> Path:
    """2x2 panels (TTFT, TPOT, ITL, E2EL): median/P90/P99 vs offered QPS, one colour per config.

    Runs at QPS = inf are plotted at the right end, one step past the largest finite QPS.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    finite = [_qps(r) for runs in series.values() for r in runs if not math.isinf(_qps(r))]
    inf_x = (max(finite) * 1.25) if finite else 1.0
    styles = {"median": "-", "p90": "--", "p99": ":"}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, name) in zip(axes.flat, LATENCIES, strict=True):
        for i, (label, runs) in enumerate(series.items()):
            runs = sorted(runs, key=_qps)
            xs = [inf_x if math.isinf(_qps(r)) else _qps(r) for r in runs]
            for stat in STATS:
                ys = [r["metrics"][key][stat] for r in runs]
                pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
                if pts:
                    ax.plot(
                        *zip(*pts, strict=True),
                        styles[stat],
                        marker="o",
                        markersize=3,
                        color=colors[i % len(colors)],
                        label=f"{label} {stat}",
                    )
        if not ax.lines:  # e.g. TPOT / ITL of a scoring workload: nothing streamed
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{name} (ms)")
        ax.set_xlabel("offered QPS")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plots")
    p.add_argument("results", nargs="+", help="bench.serve result JSON files")
    p.add_argument("--labels", help="comma list, one per file (default: file stems)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [Path(f).stem for f in args.results]
    series = {
        lab: json.loads(Path(f).read_text())["runs"]
        for lab, f in zip(labels, args.results, strict=True)
    }
    plot_latency_vs_qps(series, args.out)
    print(markdown_table(series))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
