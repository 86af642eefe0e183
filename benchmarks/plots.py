"""`pdserve bench serving --plot DIR`: PNG plots (matplotlib) and the raw results as JSON.

- ttft_cdf.png, itl_cdf.png: the CDF of TTFT and of inter-token latency, one panel per concurrency,
  every target on the same axes;
- throughput.png: output token throughput against concurrency, one line per target;
- results.json: the summary, every request's TTFT and ITL samples, and each plot's axes and series
  (read back from the figures, so that a test can check what was drawn).

`pdserve bench goodput --plot DIR`: goodput.png, goodput and SLO attainment against the request rate
(two panels, one line per server), and goodput.json, the rows and each plot's axes and series.
"""

from __future__ import annotations

import json
import os
from typing import Any


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'pdserve[plot]'") from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _describe(fig: Any) -> list[dict[str, Any]]:
    return [
        {
            "title": ax.get_title(),
            "xlabel": ax.get_xlabel(),
            "ylabel": ax.get_ylabel(),
            "series": [ln.get_label() for ln in ax.get_lines()],
        }
        for ax in fig.axes
    ]


def _cdf(
    plt: Any, samples: dict[tuple[str, int], list[float]], targets: list[str], levels: list[int], what: str
) -> Any:
    fig, axes = plt.subplots(1, len(levels), figsize=(4.2 * len(levels), 3.6), squeeze=False, sharey=True)
    for ax, conc in zip(axes[0], levels):
        for t in targets:
            xs = sorted(x * 1000 for x in samples.get((t, conc), []))
            if xs:
                ys = [0.0] + [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step([xs[0], *xs], ys, where="post", label=t)
        ax.set_ylim(0, 1.02)
        ax.set_title(f"concurrency {conc}")
        ax.set_xlabel(f"{what} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right")
    axes[0][0].set_ylabel("fraction of samples")
    fig.tight_layout()
    return fig


def write_plots(
    out_dir: str,
    summary: list[dict[str, Any]],
    samples: dict[tuple[str, int], dict[str, list[float]]],
    config: dict[str, Any],
) -> list[str]:
    """Writes the plots and results.json into `out_dir`; returns the paths written."""
    plt = _matplotlib()
    os.makedirs(out_dir, exist_ok=True)
    targets = list(dict.fromkeys(s["target"] for s in summary))
    levels = sorted({s["concurrency"] for s in summary})
    figs = {
        "ttft_cdf.png": _cdf(plt, {k: v["ttft"] for k, v in samples.items()}, targets, levels, "TTFT"),
        "itl_cdf.png": _cdf(
            plt, {k: v["itl"] for k, v in samples.items()}, targets, levels, "inter-token latency"
        ),
    }
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for t in targets:
        pts = sorted(
            (s["concurrency"], s["metrics"]["output_throughput"]) for s in summary if s["target"] == t
        )
        ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=t)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_title("throughput against concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    figs["throughput.png"] = fig
    paths, described = [], {}
    for name, f in figs.items():
        path = os.path.join(out_dir, name)
        f.savefig(path, dpi=110)
        described[name] = _describe(f)
        plt.close(f)
        paths.append(path)
    raw = {
        "config": config,
        "summary": summary,
        "samples": [{"target": t, "concurrency": c, **v} for (t, c), v in sorted(samples.items())],
        "plots": described,
    }
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as fh:
        json.dump(raw, fh, indent=1)
    return [*paths, path]


def write_goodput_plots(
    out_dir: str, results: dict[str, list[dict[str, Any]]], config: dict[str, Any]
) -> list[str]:
    """goodput.png and goodput.json into `out_dir` (results: bench goodput's rows per server); the paths."""
    plt = _matplotlib()
    os.makedirs(out_dir, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, rows in results.items():
        rates = [r["rate"] for r in rows]
        left.plot(rates, [r["goodput"] for r in rows], marker="o", label=name)
        right.plot(rates, [100 * r["attainment"] for r in rows], marker="o", label=name)
    top = max((r["rate"] for rows in results.values() for r in rows), default=1.0)
    left.plot([0, top], [0, top], linestyle=":", color="grey", label="offered rate")
    left.set_title("goodput against the request rate")
    left.set_ylabel("goodput (req/s within both SLOs)")
    right.set_title("SLO attainment against the request rate")
    right.set_ylabel("attainment (%)")
    right.set_ylim(0, 102)
    for ax in (left, right):
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png = os.path.join(out_dir, "goodput.png")
    fig.savefig(png, dpi=110)
    described = _describe(fig)
    plt.close(fig)
    raw = os.path.join(out_dir, "goodput.json")
    with open(raw, "w") as fh:
        json.dump({"config": config, "results": results, "plots": {"goodput.png": described}}, fh, indent=1)
    return [png, raw]
