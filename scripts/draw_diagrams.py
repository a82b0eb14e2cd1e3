"""Draw the course's diagrams with matplotlib into ``assets/diagrams/*.png`` (small files, committed).

    python scripts/draw_diagrams.py            # all of them
    python scripts/draw_diagrams.py --only lora

- ``ddp_data_flow.png``: data shards -> model replicas -> gradients -> all-reduce -> the same update everywhere.
- ``lora_adapter.png``: a frozen weight W beside the trainable low-rank path B·A, added to its output.
- ``pipeline_bubbles.png``: a GPipe schedule: micro-batches flow through stages, forward then backward, and the
  idle slots (the bubble) that a pipeline pays at its start and end.

Notebooks show them with ``IPython.display.Image("../assets/diagrams/lora_adapter.png")``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from my_utils.core.plots import new_figure, save  # noqa: E402

OUT = ROOT / "assets" / "diagrams"
FROZEN, TRAINABLE, DATA, COMM, IDLE = "#c9ced6", "#f4a259", "#8cb8e0", "#9bc995", "#ffffff"


def box(ax, x, y, w, h, text, color, fontsize=10, **kwargs):
    """A rounded box centred on (x, y) with centred text."""
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=color, edgecolor="#333333", linewidth=1.2, **kwargs))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize)


def arrow(ax, start, end, text="", offset=(0.0, 0.12), color="#333333"):
    """An arrow from ``start`` to ``end``, its label ``offset`` from the middle."""
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color=color, lw=1.4, shrinkA=2, shrinkB=2))
    if text:
        ax.text((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1], text,
                ha="left" if offset[0] > 0 else "center", fontsize=8.5, color="#333333")


def canvas(width, height, xlim, ylim):
    fig = new_figure(width, height)
    ax = fig.add_subplot()
    ax.set(xlim=xlim, ylim=ylim, aspect="equal")
    ax.axis("off")
    return fig, ax


def ddp_data_flow(path: Path) -> Path:
    """Each process trains a full replica on its own shard; all-reduce averages the gradients so that every
    replica takes the same step and stays identical."""
    ranks = 3
    fig, ax = canvas(10.5, 4.6, (0, 11.4), (-0.3, 4.7))
    ax.text(5.7, 4.45, "DDP: one replica per device, gradients averaged by all-reduce", ha="center", fontsize=13,
            weight="bold")
    box(ax, 0.75, 2.0, 1.3, 3.2, "dataset\n\nsplit by a\nDistributed-\nSampler", DATA, fontsize=9)
    ys = [3.2, 2.0, 0.8]
    for rank, y in enumerate(ys):
        box(ax, 2.75, y, 1.4, 0.8, f"shard {rank}\n(its batch)", DATA, fontsize=9)
        arrow(ax, (1.4, y), (2.05, y))
        box(ax, 5.05, y, 1.6, 0.8, f"model replica\non device {rank}", FROZEN, fontsize=9)
        arrow(ax, (3.45, y), (4.25, y), "forward" if rank == 0 else "")
        box(ax, 7.35, y, 1.3, 0.8, f"gradients\ng{rank}", TRAINABLE, fontsize=9)
        arrow(ax, (5.85, y), (6.7, y), "backward" if rank == 0 else "")
        arrow(ax, (8.0, y), (8.65, 2.0 + (y - 2.0) * 0.35))
    box(ax, 9.15, 2.0, 1.0, 2.2, "all-\nreduce\n\n(g0+g1+g2)\n/ 3", COMM, fontsize=9)
    for y in ys:
        arrow(ax, (9.65, 2.0 + (y - 2.0) * 0.35), (10.35, y))
        box(ax, 10.8, y, 0.9, 0.6, "same\nupdate", COMM, fontsize=8.5)
    ax.text(5.7, -0.2, "every replica ends the step with identical weights; the effective batch is "
            f"{ranks} x the per-device batch", ha="center", fontsize=9.5, style="italic")
    return save(fig, path)


def lora_adapter(path: Path) -> Path:
    """h = W x + (alpha / r) B A x: W (d_out x d_in) stays frozen; only A (r x d_in) and B (d_out x r) train."""
    fig, ax = canvas(8, 5.2, (0, 8), (-0.2, 5.2))
    ax.text(4, 4.95, "LoRA: a frozen weight plus a trainable low-rank path", ha="center", fontsize=13,
            weight="bold")
    box(ax, 4, 0.45, 1.8, 0.55, "input x  (d_in)", DATA)
    box(ax, 4, 4.25, 2.4, 0.55, "output h  (d_out)", DATA)
    box(ax, 2.3, 2.35, 2.6, 2.0, "W\nd_out x d_in\n\nfrozen\n(no gradient, no\noptimizer state)", FROZEN)
    # A is short and wide (r x d_in), B tall and thin (d_out x r): the picture keeps their shapes' flavour.
    box(ax, 5.7, 1.55, 1.9, 0.5, "A   r x d_in", TRAINABLE)
    box(ax, 5.7, 3.0, 0.9, 0.95, "B\nd_out\nx r", TRAINABLE, fontsize=9)
    box(ax, 4, 3.45, 0.45, 0.45, "+", "white", fontsize=14)
    arrow(ax, (3.6, 0.75), (2.6, 1.33))
    arrow(ax, (4.4, 0.75), (5.4, 1.28))
    arrow(ax, (5.7, 1.82), (5.7, 2.5), "A x: r numbers", offset=(0.1, -0.05))
    arrow(ax, (5.25, 3.15), (4.25, 3.45), "x alpha/r", offset=(0.0, 0.14))
    arrow(ax, (2.3, 3.37), (3.77, 3.45), "W x", offset=(-0.2, 0.14))
    arrow(ax, (4, 3.7), (4, 3.95))
    ax.text(4, -0.1, "trainable: r (d_in + d_out) parameters instead of d_in x d_out. B starts at zero, so "
            "training starts from the base model.", ha="center", fontsize=8.5, style="italic")
    return save(fig, path)


def pipeline_bubbles(path: Path, stages: int = 4, micro_batches: int = 4) -> Path:
    """GPipe: every micro-batch goes forward through the stages, then all go backward; a stage waits (idle)
    until the first micro-batch reaches it and after the last one has left it."""
    from matplotlib.patches import Rectangle

    slots = 2 * (micro_batches + stages - 1)
    fig = new_figure(10, 3.8)
    ax = fig.add_subplot()
    for stage in range(stages):
        busy = {}
        for m in range(micro_batches):
            busy[stage + m] = ("F", m)  # forward of micro-batch m reaches this stage at slot stage + m
            busy[micro_batches + stages - 1 + (stages - 1 - stage) + m] = ("B", m)  # backward runs in reverse
        for t in range(slots):
            kind, m = busy.get(t, (None, None))
            color = {"F": DATA, "B": TRAINABLE}.get(kind, IDLE)
            ax.add_patch(Rectangle((t, stages - 1 - stage), 1, 1, facecolor=color, edgecolor="#555555",
                                   hatch=None if kind else "//", linewidth=0.8))
            if kind:
                ax.text(t + 0.5, stages - 0.5 - stage, f"{kind}{m + 1}", ha="center", va="center", fontsize=9)
    bubble = (stages - 1) / (micro_batches + stages - 1)
    ax.set(xlim=(0, slots), ylim=(0, stages), xlabel="time (one slot = one micro-batch through one stage)",
           title=f"Pipeline (GPipe), {stages} stages, {micro_batches} micro-batches: hatched = idle; "
                 f"bubble = (stages-1)/(micro-batches+stages-1) = {bubble:.0%}")
    ax.set_yticks([s + 0.5 for s in range(stages)], [f"stage {stages - 1 - s}\n(device {stages - 1 - s})"
                                                     for s in range(stages)])
    ax.set_xticks(range(0, slots + 1, 2))
    ax.title.set_fontsize(11)
    legend = [Rectangle((0, 0), 1, 1, facecolor=DATA, edgecolor="#555555"),
              Rectangle((0, 0), 1, 1, facecolor=TRAINABLE, edgecolor="#555555"),
              Rectangle((0, 0), 1, 1, facecolor=IDLE, edgecolor="#555555", hatch="//")]
    ax.legend(legend, ["forward Fm", "backward Bm", "idle (bubble)"], loc="upper center",
              bbox_to_anchor=(0.5, -0.2), ncols=3, fontsize=9, frameon=False)
    return save(fig, path)


DIAGRAMS = {"ddp": ("ddp_data_flow.png", ddp_data_flow), "lora": ("lora_adapter.png", lora_adapter),
            "pipeline": ("pipeline_bubbles.png", pipeline_bubbles)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=DIAGRAMS, help="draw only these")
    p.add_argument("--out", type=Path, default=OUT, help="folder for the PNG files")
    args = p.parse_args(argv)
    for name in args.only or DIAGRAMS:
        file, draw = DIAGRAMS[name]
        path = draw(args.out / file)
        print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {path.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
