"""Lesson 11's full-vs-LoRA x one-device/DDP/pipeline table and its plot, built from results folders only.

    python -m my_utils.lessons.classification runs/notebooks/11_classification
    python -m my_utils.lessons.classification runs/classification --markdown

Only complete runs of the classification workflow enter the table; each row says which folder it came from.
"""

from __future__ import annotations

from pathlib import Path

from my_utils import UserError
from my_utils.core.memory import MiB, format_bytes
from my_utils.core.plots import new_figure, save
from my_utils.core.tables import markdown_table, text_table
from my_utils.run.config import OneLineParser
from my_utils.run.results import find_run_dirs, load_run

PARALLEL_ORDER = ("none", "ddp", "pipeline")
METHOD_ORDER = ("full", "lora")


def classification_runs(*paths) -> list[dict]:
    """The complete classification runs at or below ``paths``, ordered by method, parallel mode and seed: one dict
    per run with its folder, its seed (from run.json's config; None where it has none) and its summary."""
    found = []
    for folder in find_run_dirs(*paths):
        run = load_run(folder)
        summary = run["summary"]
        if run["run"].get("status") == "complete" and summary and summary.get("workflow") == "classification":
            found.append({"path": str(folder), "seed": run["run"].get("config", {}).get("seed"), **summary})
    return sorted(found, key=lambda r: (METHOD_ORDER.index(r["method"]), PARALLEL_ORDER.index(r["parallel"]),
                                        r["seed"] or 0))


def table_rows(runs: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["method", "parallel", "seed", "processes", "eval acc before -> after", "peak memory per process",
              "weights+grads+optimizer per process", "train time", "samples/s", "trainable params", "folder"]

    def per_process(values):
        return " / ".join(format_bytes(v) for v in values) if values else "-"

    rows = [[r["method"], r["parallel"], "-" if r["seed"] is None else str(r["seed"]), str(r["world_size"]),
             f"{r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}", per_process(r["peak_memory_per_rank"]),
             per_process(r.get("model_state_per_rank")),
             f"{r['runtime_s']:.1f} s", f"{r['samples_per_s']:.0f}", f"{r['trainable_params']:,}",
             Path(r["path"]).name] for r in runs]
    return header, rows


def classification_table(*paths, markdown: bool = False) -> str:
    """The table, as text or markdown, of every complete classification run under ``paths``."""
    runs = classification_runs(*paths)
    if not runs:
        raise UserError(f"No complete classification run under {', '.join(map(str, paths))}; run "
                        "`python -m my_utils.workflows.classification` first.")
    return (markdown_table if markdown else text_table)(*table_rows(runs))


def plot_classification(runs: list[dict], path) -> Path:
    """Eval accuracy against steps for every run, and chance (left), and what each process holds of the model: weights,
    gradients and optimizer states (right; the peak memory adds the runtime and the activations to it)."""
    fig = new_figure(11, 4)
    curves, memory = fig.subplots(1, 2)
    names = [f"{r['method']} / {r['parallel']}" for r in runs]
    for r, name in zip(runs, names):
        steps, scores = zip(*r["eval_curve"])
        curves.plot(steps, scores, marker="o", label=name, linestyle="--" if r["method"] == "lora" else "-")
    curves.axhline(1 / runs[0]["num_labels"], color="grey", linestyle=":", label="chance")
    curves.set(xlabel="optimizer step", ylabel="eval accuracy", title="accuracy while training")
    curves.grid(alpha=0.3)
    curves.legend(fontsize="small")
    for i, r in enumerate(runs):
        parts = [m["breakdown"] for m in r["memory"]]
        width = 0.8 / len(parts)
        for j, part in enumerate(parts):
            x, bottom = i - 0.4 + width * (j + 0.5), 0.0
            for key, color in (("weights", "C0"), ("gradients", "C1"), ("optimizer_states", "C2")):
                memory.bar(x, part[key] / MiB, width * 0.9, bottom=bottom, color=color, label=key.replace("_", " "),
                           edgecolor="white", hatch="//" if j else None)
                bottom += part[key] / MiB
    memory.set_xticks(range(len(runs)), names, rotation=20, ha="right", fontsize="small")
    memory.set(ylabel="MiB", title="held by each process (hatched: second process)")
    memory.grid(axis="y", alpha=0.3)
    unique = {}
    for handle, label in zip(*memory.get_legend_handles_labels()):
        unique.setdefault(label, handle)  # one entry per kind, unhatched
    memory.legend(unique.values(), unique.keys(), fontsize="small")
    return save(fig, path)


def main(argv=None) -> None:
    import argparse

    p = OneLineParser(prog="python -m my_utils.lessons.classification", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="results folders, or folders that contain them")
    p.add_argument("--markdown", action="store_true", help="a markdown table")
    args = p.parse_args(argv)
    print(classification_table(*args.paths, markdown=args.markdown))


if __name__ == "__main__":
    from my_utils.run.cli import run_main

    run_main(main, prefix="my_utils.lessons.classification")
