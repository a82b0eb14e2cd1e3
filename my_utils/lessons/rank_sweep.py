"""What a sweep's rows say (lesson 07's analysis): the cost and gain of rank, the scaling rules, the learning-rate
curves, where the adapters go; as sentences, tables and plots, and the report a sweep prints: ``main`` is
``python -m my_utils sweep`` (run the sweep's cells, then the report)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from my_utils import UserError
from my_utils.core.memory import MiB, format_bytes
from my_utils.core.plots import new_figure, save
from my_utils.core.tables import text_table
from my_utils.tools.sweep.cli import parse_args
from my_utils.tools.sweep.results import (SETTINGS, load_sweep, row_label, seed_means, seed_noise, sweep_table,
                                          update_scale, varying)
from my_utils.tools.sweep.running import run_sweep


def tradeoffs(rows: list[dict], noise=None, margin: float | None = None) -> list[str]:
    """What a larger rank costs and buys, each sentence computed from ``rows`` (cells that differ only in rank; seeds
    merged by ``seed_means``). ``noise`` (``seed_noise``): the spread between seeds, which gives each smaller rank's
    difference from the best its interval. A smaller rank is called as good as the best only within a stated
    ``margin`` of held-out loss (its interval inside +-margin: an equivalence); an interval that neither excludes 0
    nor fits a margin is said to be undecided, not "no difference"."""
    rows = sorted(rows, key=lambda r: r["rank"])
    if len(rows) < 2:
        return ["Only one rank finished; a trade-off needs at least two."]
    small, large = rows[0], rows[-1]
    a, b = f"rank {small['rank']}", f"rank {large['rank']}"
    sentence = (f"{b} trains {large['trainable_params'] / small['trainable_params']:.1f}x more parameters than {a} "
                f"({large['trainable_params']:,} vs {small['trainable_params']:,})")
    if small["eval_loss"] is not None and large["eval_loss"] is not None:
        sentence += (f" for a held-out loss of {large['eval_loss']:.3f} against {small['eval_loss']:.3f}")
    sentences = [sentence + "."]
    sentences += [
        f"The adapter file of {b} is {large['adapter_bytes'] / small['adapter_bytes']:.1f}x larger "
        f"({format_bytes(large['adapter_bytes'])} vs {format_bytes(small['adapter_bytes'])}): the cost of storing "
        "and shipping one adapter per task.",
        f"Peak memory {'grows' if large['peak_memory_bytes'] >= small['peak_memory_bytes'] else 'changes'} by "
        f"{format_bytes(large['peak_memory_bytes'] - small['peak_memory_bytes'])} "
        f"({100 * (large['peak_memory_bytes'] / small['peak_memory_bytes'] - 1):+.1f}%) from {a} to {b}: the "
        "adapter's weights, gradients and optimizer states; the frozen base model and activations dominate.",
        f"Training took {large['runtime_s'] / small['runtime_s']:.2f}x as long at {b} as at {a} "
        f"({large['runtime_s']:.1f} s vs {small['runtime_s']:.1f} s, {large['samples_per_s']:.1f} vs "
        f"{small['samples_per_s']:.1f} samples/s).",
    ]
    scored = [r for r in rows if r["eval_loss"] is not None]
    if scored:
        best = min(scored, key=lambda r: (r["eval_loss"], r["rank"]))
        sentence = f"Lowest held-out loss: rank {best['rank']} ({best['eval_loss']:.3f})"
        smaller = [r for r in scored if r["rank"] < best["rank"]]
        if noise is not None and smaller:
            def apart(r):  # r's held-out loss minus the best's, with its interval from the seeds' noise
                return noise.difference(r["eval_loss"], best["eval_loss"], len(r.get("seeds", [0])),
                                        len(best.get("seeds", [0])))

            level = [r for r in smaller if margin is not None and apart(r).inside(-margin, margin)]
            open_ = [r for r in smaller if not apart(r).excludes(0)]
            if level:
                r = level[0]
                sentence += (f"; rank {r['rank']} ends within {margin:g} of it ({apart(r)}, inside +-{margin:g}) with "
                             f"{r['trainable_params'] / best['trainable_params']:.2f}x its trainable parameters")
            elif open_:
                r = open_[0]
                sentence += (f"; rank {r['rank']} ends {apart(r)} higher: these seeds neither separate it from the "
                             "best nor bound the difference" + (f" within {margin:g}" if margin is not None else
                                                                 " (no margin stated)"))
            else:
                sentence += "; every smaller rank ends measurably higher"
        sentences.append(sentence + ".")
    return sentences


def plot_costs(rows: list[dict], out: str | Path) -> list[Path]:
    """Two figures in ``out`` for cells that differ only in rank: every rank's loss curve, and each measured figure
    against the rank (parameters and adapter size on log-log axes, the rest from zero, so that ratios read true)."""
    out = Path(out)
    rows = sorted(rows, key=lambda r: r["rank"])
    fig = new_figure(7, 4)
    ax = fig.add_subplot()
    for r in rows:
        if r["loss_curve"]:
            ax.plot(*zip(*r["loss_curve"]), marker=".", label=f"rank {r['rank']}")
    ax.set(xlabel="optimizer step", ylabel="training loss", title="loss curve per LoRA rank")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize="small")
    paths = [save(fig, out / "loss_curves.png")]

    fig = new_figure(10, 6)
    # (row key, title, unit, log scale): parameters and adapter size grow linearly with the rank, a straight line of
    # slope 1 on log-log axes
    panels = [("trainable_params", "trainable parameters", 1, True), ("adapter_bytes", "adapter file (MiB)", MiB, True),
              ("peak_memory_bytes", "peak memory (MiB)", MiB, False), ("runtime_s", "training time (s)", 1, False),
              ("samples_per_s", "samples/s", 1, False), ("eval_loss", "held-out loss after training", 1, False)]
    ranks = [r["rank"] for r in rows]
    for ax, (key, title, unit, log) in zip(fig.subplots(2, 3).flat, panels):
        ax.plot(ranks, [r[key] / unit if r[key] is not None else float("nan") for r in rows], marker="o")
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.set_xticks(ranks, [str(k) for k in ranks])
        ax.set(xlabel="LoRA rank", title=title)
        ax.grid(alpha=0.3)
    paths.append(save(fig, out / "rank_costs.png"))
    return paths


def scaling_rules(alpha: float, rs_alpha: float) -> dict:
    """Three ways to scale LoRA's update B A as the rank r changes: alpha fixed (peft's alpha / r), rsLoRA (alpha /
    sqrt(r)) and alpha = 2r (the workflow's default: 2 at every rank). Each maps a rank to the scale."""
    return {f"alpha {alpha:g} (scale {alpha:g}/r)": lambda r: alpha / r,
            f"rsLoRA, alpha {rs_alpha:g} (scale {rs_alpha:g}/sqrt(r))": lambda r: rs_alpha / math.sqrt(r),
            "alpha = 2r (scale 2)": lambda r: 2.0}


def scaling_lines(rows: list[dict], rules: dict) -> dict[str, list[dict]]:
    """For each rule of ``scaling_rules``, the LoRA rows (by rank) whose update scale is the rule's at their rank.
    Pass rows that differ only in rank and scaling: where two rules give one scale, they share a run."""
    lines = {}
    for label, rule in rules.items():
        found = {r["rank"]: r for r in rows if r["method"] == "lora" and math.isclose(update_scale(r), rule(r["rank"]))}
        lines[label] = [found[k] for k in sorted(found)]
    return lines


def scaling_table(lines: dict[str, list[dict]]) -> str:
    """Held-out loss (and the update's scale) at every rank, one column per scaling rule."""
    ranks = sorted({r["rank"] for line in lines.values() for r in line})
    table = []
    for rank in ranks:
        cells = []
        for line in lines.values():
            row = next((r for r in line if r["rank"] == rank), None)
            cells.append("-" if row is None else f"{row['eval_loss']:.3f} (x{update_scale(row):.3g})")
        table.append([str(rank), *cells])
    return text_table(["rank", *lines], table)


def scaling_findings(lines: dict[str, list[dict]]) -> list[str]:
    """How far apart the smallest and the largest rank end under each scaling rule, and which rule spreads them most."""
    gaps = {label: (line[0], line[-1]) for label, line in lines.items() if len(line) >= 2}
    if not gaps:
        return ["No scaling rule has two ranks; nothing to compare."]
    spread = {label: small["eval_loss"] - large["eval_loss"] for label, (small, large) in gaps.items()}
    sentences = [f"{label}: rank {small['rank']} ends at held-out loss {small['eval_loss']:.3f} and rank "
                 f"{large['rank']} at {large['eval_loss']:.3f} ({abs(spread[label]):.3f} "
                 f"{'lower' if spread[label] > 0 else 'higher'} at the larger rank)."
                 for label, (small, large) in gaps.items()]
    wide, narrow = max(spread, key=lambda k: abs(spread[k])), min(spread, key=lambda k: abs(spread[k]))
    if wide != narrow and spread[narrow]:
        sentences.append(f"The difference the rank makes is {abs(spread[wide] / spread[narrow]):.1f}x larger with "
                         f"{wide} than with {narrow}: at each rank the cells differ only in the scale.")
    return sentences


def plot_scaling(lines: dict[str, list[dict]], out: str | Path) -> Path:
    """Held-out loss against the rank, one line per scaling rule (the loss axis from zero)."""
    fig = new_figure(7, 4)
    ax = fig.add_subplot()
    for label, line in lines.items():
        ax.plot([r["rank"] for r in line], [r["eval_loss"] for r in line], marker="o", label=label)
    ranks = sorted({r["rank"] for line in lines.values() for r in line})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, [str(k) for k in ranks])
    ax.set_ylim(bottom=0)
    ax.set(xlabel="LoRA rank", ylabel="held-out loss after training", title="the same ranks under three scaling rules")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="lower left")
    return save(fig, Path(out) / "scaling.png")


def learning_rate_curves(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows that differ only in the learning rate, grouped (three rates at least) and sorted by rate; each label
    says what sets its group apart (``full fine-tuning``, ``rank 16``)."""
    groups = {}
    for r in rows:
        groups.setdefault(json.dumps([r[k] for k in SETTINGS if k != "learning_rate"]), []).append(r)
    curves = [sorted(g, key=lambda r: r["learning_rate"]) for g in groups.values() if len(g) >= 3]
    keys = [k for k in varying([c[0] for c in curves]) if k != "learning_rate"] or ["rank"]
    return {row_label(c[0], keys): c for c in curves}


def best_rate(curve: list[dict]) -> tuple[float, dict, bool]:
    """Where a curve's held-out loss is lowest: the rate at the vertex of the parabola (in log rate) through the
    best rate tried and its two neighbours, finer than the grid's steps and less moved by one noisy point; the best
    row; and whether it lies inside the rates tried (at an end the best may lie beyond: that end's rate is given)."""
    i = min(range(len(curve)), key=lambda k: curve[k]["eval_loss"])
    best = curve[i]
    if i in (0, len(curve) - 1):
        return best["learning_rate"], best, False
    (x0, y0), (x1, y1), (x2, y2) = [(math.log(r["learning_rate"]), r["eval_loss"]) for r in curve[i - 1:i + 2]]
    den = (x1 - x0) * (y1 - y2) - (x1 - x2) * (y1 - y0)
    if den == 0:  # three equal losses: no curvature to place a vertex
        return best["learning_rate"], best, True
    return math.exp(x1 - 0.5 * ((x1 - x0) ** 2 * (y1 - y2) - (x1 - x2) ** 2 * (y1 - y0)) / den), best, True


def learning_rate_table(curves: dict[str, list[dict]]) -> str:
    """Held-out loss at every rate tried (the lowest of each line starred) and the interpolated best rate."""
    rates = sorted({r["learning_rate"] for curve in curves.values() for r in curve})
    table = []
    for label, curve in curves.items():
        rate, best, inside = best_rate(curve)
        by_rate = {r["learning_rate"]: r for r in curve}
        table.append([label, *(("-" if x not in by_rate else f"{by_rate[x]['eval_loss']:.3f}"
                                + ("*" if by_rate[x] is best else "")) for x in rates),
                      f"{rate:.2g}" + ("" if inside else " (an end)")])
    return text_table(["held-out loss at lr", *(f"{x:g}" for x in rates), "best lr"], table)


def learning_rate_findings(curves: dict[str, list[dict]], published_ratio: float = 10) -> list[str]:
    """Each line's best rate; how far LoRA's best rate moves with the rank; and LoRA's best rate against full
    fine-tuning's, beside the published ``published_ratio`` ("LoRA Without Regret", Thinking Machines, 2025)."""
    bests = {label: best_rate(curve) for label, curve in curves.items()}
    sentences = [f"{label}: best rate about {rate:.2g} (lowest held-out loss {row['eval_loss']:.3f}, at "
                 f"{row['learning_rate']:g})" + ("" if inside else ", at an end of the rates tried: the best may lie "
                                                 "beyond") + "."
                 for label, (rate, row, inside) in bests.items()]
    lora = {label: b for label, b in bests.items() if b[1]["method"] == "lora"}
    full = [b for b in bests.values() if b[1]["method"] != "lora"]
    if len(lora) >= 2:
        rates = [rate for rate, _, _ in lora.values()]
        sentences.append(f"From {' to '.join(lora)}, LoRA's best rate moves by a factor of "
                         f"{max(rates) / min(rates):.1f} (published, with alpha fixed: hardly at all).")
    if full and lora:
        ratios = [rate / full[0][0] for rate, _, _ in lora.values()]
        low, high = min(ratios), max(ratios)
        verdict = ("within a factor of 2 of it" if published_ratio / 2 <= low and high <= 2 * published_ratio
                   else "smaller" if high < published_ratio else "larger" if low > published_ratio else "around it")
        sentences.append(f"LoRA's best rate is {low:.1f}x to {high:.1f}x full fine-tuning's ({full[0][0]:.2g}); the "
                         f"published factor is about {published_ratio:g}x, and this one is {verdict}.")
    return sentences


def plot_learning_rates(curves: dict[str, list[dict]], out: str | Path) -> Path:
    """Held-out loss against the learning rate, one line per group (full fine-tuning dashed), each best rate marked
    by a dotted line; the loss axis from zero."""
    fig = new_figure(7, 4)
    ax = fig.add_subplot()
    for label, curve in curves.items():
        rate, _, _ = best_rate(curve)
        (line,) = ax.plot([r["learning_rate"] for r in curve], [r["eval_loss"] for r in curve], marker="o",
                          linestyle="--" if curve[0]["method"] != "lora" else "-", label=f"{label} (best {rate:.2g})")
        ax.axvline(rate, color=line.get_color(), linestyle=":", alpha=0.7)
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set(xlabel="learning rate", ylabel="held-out loss after training", title="learning rate against method and rank")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left")
    return save(fig, Path(out) / "learning_rates.png")


def targets_findings(rows: list[dict]) -> list[str]:
    """Cells with as many trainable parameters and the same rate but other target modules, compared; then the
    lowest held-out loss each set of targets reached anywhere in ``rows``."""
    lora = [r for r in rows if r["method"] == "lora" and r["eval_loss"] is not None]
    sentences = []
    matched = {}
    for r in lora:
        matched.setdefault((r["trainable_params"], r["learning_rate"]), {}).setdefault("+".join(r["targets"]), r)
    for (params, rate), by_targets in matched.items():
        if len(by_targets) > 1:
            sentences.append(f"At {params:,} trainable parameters and lr {rate:g}: " + "; ".join(
                f"{targets} at rank {r['rank']} reaches held-out loss {r['eval_loss']:.3f}"
                for targets, r in sorted(by_targets.items(), key=lambda t: t[1]["eval_loss"])) + ".")
    best = {}
    for r in sorted(lora, key=lambda r: r["eval_loss"]):
        best.setdefault("+".join(r["targets"]), r)
    if len(best) > 1:
        sentences.append("Lowest held-out loss anywhere in the grid: " + "; ".join(
            f"{targets}: {r['eval_loss']:.3f} ({row_label(r, ('rank', 'alpha', 'rslora', 'learning_rate'))})"
            for targets, r in best.items()) + ".")
    return sentences


def rank_ladder(rows: list[dict]) -> list[dict]:
    """The largest group of LoRA rows that differ only in rank, by rank: the rows whose costs ``tradeoffs`` compares."""
    groups = {}
    for r in rows:
        if r["method"] == "lora":
            groups.setdefault(json.dumps([r[k] for k in SETTINGS if k != "rank"]), []).append(r)
    return sorted(max(groups.values(), key=len, default=[]), key=lambda r: r["rank"])


def report(out: str | Path) -> str:
    """The sweep's table and sentences as text (also written to ``out/report.md``); draws the plots."""
    cells = load_sweep(out)
    if not cells:
        raise UserError(f"No complete cell in {out}; run the sweep first.")
    rows = seed_means(cells)
    ladder, curves = rank_ladder(rows), learning_rate_curves(rows)
    parts = [sweep_table(cells)]
    if len(ladder) >= 2:
        plot_costs(ladder, out)
        parts.append("\n".join(f"- {s}" for s in tradeoffs(ladder, seed_noise(cells))))
    if curves:
        plot_learning_rates(curves, out)
        parts += [learning_rate_table(curves), "\n".join(f"- {s}" for s in learning_rate_findings(curves))]
    found = targets_findings(rows)
    if found:
        parts.append("\n".join(f"- {s}" for s in found))
    text = "\n\n".join(parts)
    (Path(out) / "report.md").write_text(text + "\n", encoding="utf-8")
    return text


def main(argv=None) -> None:
    """``python -m my_utils sweep``: run the cells the command line asks for, then print the report."""
    spec, out, jobs = parse_args(argv)
    run_sweep(spec, out, jobs)
    print("\n" + report(out))
    print(f"\nsweep folder: {out}")
