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
from my_utils.core.records import global_batch_of, process_of


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


LEGEND_ENTRIES = 12  # the most lines one panel labels; a folder with more runs gets more panels


def loss_panels(runs: list[dict], labels: dict[str, str]) -> list[tuple[str, list[dict]]]:
    """(folder, its runs) for each panel of ``loss_curves``: the runs with a loss curve (two points at least),
    by the folder that holds them, at most ``LEGEND_ENTRIES`` a panel."""
    folders: dict[str, list[dict]] = {}
    for run in runs:
        if sum("loss" in m and "step" in m for m in run["metrics"]) > 1:
            folders.setdefault(str(Path(labels[run["path"]]).parent), []).append(run)
    return [(folder, members[i:i + LEGEND_ENTRIES]) for folder, members in folders.items()
            for i in range(0, len(members), LEGEND_ENTRIES)]


# Every line of a panel tells apart from the others at a glance, even where two coincide: its own colour, and a line
# style and marker that change with it (a dashed line over a solid one shows both).
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "x")


def line_style(i: int) -> dict:
    """The matplotlib style of the ``i``-th line of a panel."""
    from matplotlib import colormaps

    return {"color": colormaps["tab20"](i % 20), "linestyle": LINE_STYLES[i % len(LINE_STYLES)],
            "marker": MARKERS[i % len(MARKERS)], "markevery": 0.2, "markersize": 4}


def loss_figure(runs: list[dict], labels: dict[str, str]):
    """The figure ``loss_curves`` saves: one panel per folder of runs (at most ``LEGEND_ENTRIES`` lines a panel; a
    folder with more gets several, each titled with its share), every line styled apart (``line_style``). The x-axis
    is samples seen (step x global batch) in a panel whose every run reports its batch, as runs with a larger batch
    take fewer steps for the same data, else optimizer steps; a run with fewer than two logged losses is named under
    its panel's title rather than silently left out."""
    from matplotlib.ticker import MaxNLocator

    panels = loss_panels(runs, labels)
    columns = min(4, len(panels))  # four across: a whole series of lessons stays within a screen's height or two
    rows = -(-len(panels) // columns)
    fig = new_figure(4.5 * columns, 3.6 * rows)
    axes = fig.subplots(rows, columns, squeeze=False).flatten()
    shares = {}
    for folder, _ in panels:
        shares[folder] = shares.get(folder, 0) + 1
    seen = {}
    for ax, (folder, members) in zip(axes, panels):
        seen[folder] = seen.get(folder, 0) + 1
        batches = [global_batch_of(run["run"], run["summary"]) for run in members]
        per_sample = all(batches)
        for i, (run, batch) in enumerate(zip(members, batches)):
            steps, losses = zip(*[(m["step"], m["loss"]) for m in run["metrics"] if "loss" in m and "step" in m])
            scale = batch if per_sample else 1
            ax.plot([step * scale for step in steps], losses, label=Path(labels[run["path"]]).name, **line_style(i))
        title = folder if folder != "." else "runs"
        if shares[folder] > 1:
            title += f" ({seen[folder]} of {shares[folder]})"
        flat = [Path(labels[r["path"]]).name for r in runs if str(Path(labels[r["path"]]).parent) == folder
                and sum("loss" in m and "step" in m for m in r["metrics"]) < 2]
        if flat and seen[folder] == 1:
            title += f"\nno curve (under 2 losses logged): {', '.join(flat)}"
        ax.set(xlabel="samples seen (step x global batch)" if per_sample else "optimizer step",
               ylabel="training loss", title=title)
        ax.title.set_fontsize("small")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    return fig


def loss_curves(runs: list[dict], labels: dict[str, str], path: str | Path) -> Path:
    """Training loss of ``runs``, drawn by ``loss_figure``, saved as PNG at ``path``."""
    return save(loss_figure(runs, labels), path)


ROWS_PER_COLUMN = 70  # bars one column of the memory figure holds; further runs go to a column beside it


def memory_bars(runs: list[dict], labels: dict[str, str], path: str | Path) -> Path:
    """Peak memory of every rank of every run: one row of bars per run, one bar per rank. Past ``ROWS_PER_COLUMN``
    rows the runs go on in a column beside ("k of n"), so that a comparison of many runs stays on a screen."""
    measured = [run for run in runs if run["summary"].get("memory")]
    columns, rows = [[]], 0
    for run in measured:
        n = len(run["summary"]["memory"])
        if columns[-1] and rows + n > ROWS_PER_COLUMN:
            columns.append([])
            rows = 0
        columns[-1].append(run)
        rows += n
    tallest = max(sum(len(run["summary"]["memory"]) for run in column) for column in columns)
    # at most 19.5 inches wide: many columns share that width (an image stays within 2,000 pixels)
    fig = new_figure(11 if len(columns) == 1 else min(6.5 * len(columns), 19.5), 1.2 + 0.3 * tallest)
    axes = fig.subplots(1, len(columns), squeeze=False)[0]
    measures, labelled = set(), set()
    for k, (ax, column) in enumerate(zip(axes, columns), 1):
        ticks, names, y = [], [], 0.0
        for run in column:
            entries = run["summary"]["memory"]
            for j, entry in enumerate(entries):
                end = entry.get("end") or {}
                measures.add("peak allocated (CUDA)" if end.get("peak_allocated") is not None
                             else "peak RSS (CPU process)")
                process = process_of(entry, j)
                bars = ax.barh(y + j, peak_bytes(end) / MiB, 0.8, color=f"C{process % 10}",
                               label=None if process in labelled else f"rank {process}")
                ax.bar_label(bars, fmt="%.0f", fontsize="x-small", padding=2)
                labelled.add(process)
            ticks.append(y + (len(entries) - 1) / 2)
            names.append(labels[run["path"]])
            y += len(entries) + 0.6
        ax.set_yticks(ticks, names, fontsize="small")
        ax.set_ylim(y - 0.8, -0.6)  # the first run on top, as in the tables
        ax.set_title("peak memory per device" + (f" ({k} of {len(columns)})" if len(columns) > 1 else ""))
        ax.grid(axis="x", alpha=0.3)
    for ax in axes:
        ax.set_xlabel("MiB: " + ", ".join(sorted(measures)))
    if labelled:
        axes[0].legend(fontsize="small", loc="lower right")
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
