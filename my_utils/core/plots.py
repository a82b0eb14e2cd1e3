"""Figures from results folders, saved as PNG: loss curves, peak memory per device, speedup against the ideal.

    from my_utils.tools.compare import compare
    from my_utils.core import plots
    c = compare("runs/run_1_cpu_x2")
    plots.loss_curves(c.runs, c.labels, "loss.png")

``python -m my_utils compare RUNS --output-dir DIR`` draws all of them. Figures are drawn on matplotlib's Agg canvas
(no display, no change to pyplot's backend), and matplotlib is imported only when a figure is drawn.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from my_utils.core.memory import MiB, peak_bytes


def new_figure(width: float = 7.0, height: float = 4.0):
    """A matplotlib Figure on the Agg canvas, independent of pyplot's state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig, path: str | Path, dpi: int = 100) -> Path:
    """Save ``fig`` as PNG through a temporary file and a rename (never half an image)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=dpi)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a figure is for everyone who can read the folder
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def loss_curves(runs: list[dict], labels: dict[str, str], path: str | Path) -> Path:
    """Training loss against optimizer steps (left) and against samples seen (right): runs with a larger
    effective batch take fewer steps for the same data."""
    fig = new_figure(10, 4)
    by_step, by_samples = fig.subplots(1, 2, sharey=True)
    for run in runs:
        points = [(m["step"], m["loss"]) for m in run["metrics"] if "loss" in m and "step" in m]
        if not points:
            continue
        steps, losses = zip(*points)
        line, = by_step.plot(steps, losses, marker=".", label=labels[run["path"]])
        batch = run["summary"].get("effective_batch")
        if batch:
            by_samples.plot([s * batch for s in steps], losses, marker=".", color=line.get_color())
    by_step.set(xlabel="optimizer step", ylabel="training loss", title="loss per step")
    by_samples.set(xlabel="samples seen (step x effective batch)", title="loss per sample")
    from matplotlib.ticker import MaxNLocator

    for ax in (by_step, by_samples):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.legend(loc="outside lower center", ncols=min(3, max(1, len(runs))), fontsize="small")
    return save(fig, path)


def memory_bars(runs: list[dict], labels: dict[str, str], path: str | Path) -> Path:
    """Peak memory of every rank of every run, one group of bars per run."""
    fig = new_figure(max(6.0, 1.2 * len(runs) + 2), 4)
    ax = fig.add_subplot()
    measures, labelled, names = set(), set(), []
    for i, run in enumerate(runs):
        entries = run["summary"].get("memory") or []
        names.append(labels[run["path"]])
        width = 0.8 / max(1, len(entries))
        for j, entry in enumerate(entries):
            end = entry.get("end") or {}
            measures.add("peak allocated (CUDA)" if end.get("peak_allocated") is not None else "peak RSS (CPU process)")
            rank = entry.get("rank", j)
            bars = ax.bar(i - 0.4 + width * (j + 0.5), peak_bytes(end) / MiB, width * 0.9, color=f"C{j % 10}",
                          label=None if rank in labelled else f"rank {rank}")
            ax.bar_label(bars, fmt="%.0f", fontsize="small")
            labelled.add(rank)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize="small")
    ax.set(ylabel="MiB", title="peak memory per device: " + ", ".join(sorted(measures)))
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="outside right upper", fontsize="small")
    return save(fig, path)


def speedup(groups: dict[str, list[tuple[int, float]]], path: str | Path) -> Path:
    """Measured speedup against the number of processes for each group, beside the ideal line y = x."""
    fig = new_figure(6, 4.5)
    ax = fig.add_subplot()
    most = max(n for points in groups.values() for n, _ in points)
    ax.plot([1, most], [1, most], "k--", label="ideal (speedup = processes)")
    for name, points in groups.items():
        points = sorted(points)
        ax.plot([n for n, _ in points], [s for _, s in points], marker="o", label=name)
    ax.set(xlabel="processes", ylabel="speedup (samples/s vs 1 process)", title="speedup against the ideal",
           xlim=(0.8, most + 0.2), ylim=(0, most * 1.1))
    ax.set_xticks(sorted({n for points in groups.values() for n, _ in points}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return save(fig, path)
