"""PEFT methods side by side: each method at its best learning rate, what it costs and what it learns, read from
the results folders of a sweep (``my_utils.tools.sweep``) whose cells name peft adapter configs.

    from my_utils.lessons.peft_methods import best_per_method, method_table, plot_pareto
    best = best_per_method(run_sweep(spec, out, jobs=2))
    print(method_table(best))

A method is a results folder's adapter config (``configs/peft/ia3.json`` -> ``ia3``), or ``full`` for full
fine-tuning, with ``all-linear`` added where its targets say so (``my_utils.tools.peft_results.adapter_file_label``).
The learning rates a method runs at are data kept beside its adapter config (``configs/peft/ia3.training.json``, read
by ``training_params``). Each method's rows differ in the learning rate; its best is the one with the lowest
held-out loss.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from my_utils import UserError
from my_utils.core.adapters import PROMPT_LEARNING
from my_utils.core.memory import format_bytes
from my_utils.core.models import build_causal_lm
from my_utils.core.tables import text_table
from my_utils.run.results import read_json
from my_utils.tools.peft_results import adapter_file_label

TRAINING_PARAMS = ".training.json"  # beside <method>.json, as peft's method_comparison keeps training_params.json


def training_params(folder: str | Path, method: str) -> dict:
    """What a method trains with, kept beside its adapter config: ``<folder>/<method>.training.json`` (``full``
    has one with no adapter config), its ``learning_rates`` three or more increasing rates, the best of a wider
    search among the inner ones, so that a sweep over them finds its best bracketed."""
    path = Path(folder) / f"{method}{TRAINING_PARAMS}"
    if not path.is_file():
        raise UserError(f"{method} has no training parameters: write {path} with its learning_rates.")
    params = read_json(path)
    rates = params.get("learning_rates")
    if (not isinstance(rates, list) or len(rates) < 3 or not all(isinstance(r, (int, float)) and r > 0 for r in rates)
            or sorted(set(rates)) != rates):
        raise UserError(f"{path}: learning_rates must be three or more increasing positive rates, so that a best "
                        f"one can lie between two others; got {rates!r}.")
    return params


def with_figures(row: dict) -> dict:
    """A sweep row with what this lesson also reads from the run's summary.json: forgetting, exact match before,
    seconds per step, each part of the tensor memory (process 0's) and the peft method."""
    summary = read_json(Path(row["path"]) / "summary.json")
    return {**row, "label": adapter_file_label(row), "peft_type": row["peft_type"] or "FULL",
            "step_s": summary["runtime_s"] / summary["steps"],
            "eval_loss_before": summary["eval_loss_before"],
            "exact_match_before": summary["exact_match_before"],
            "forgetting_before": summary.get("forgetting_loss_before"),
            "forgetting_after": summary.get("forgetting_loss_after"),
            "memory_parts": summary["memory"][0]["breakdown"]}


def best_per_method(rows: list[dict]) -> list[dict]:
    """One row per method, in the order the methods first appear: the rate with the lowest held-out loss, with
    ``rates`` (every rate tried, and its held-out loss), ``at_edge`` (the best is the lowest or highest rate
    tried, so a better one may lie beyond) and ``bracket`` (the rates either side of the best: the optimum lies
    between them; None at an end)."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(adapter_file_label(row), []).append(row)
    best = []
    for group in groups.values():
        group = sorted(group, key=lambda r: r["learning_rate"])
        top = min(group, key=lambda r: r["eval_loss"])
        i = group.index(top)
        at_edge = len(group) > 1 and i in (0, len(group) - 1)
        best.append({**with_figures(top), "rates": [(r["learning_rate"], r["eval_loss"]) for r in group],
                     "at_edge": at_edge, "bracket": None if at_edge or len(group) == 1 else
                     (group[i - 1]["learning_rate"], group[i + 1]["learning_rate"])})
    return best


def merge_gap(row: dict, preset) -> float | None:
    """Load the run's adapter onto the base model, merge it into the weights (peft's ``merge_and_unload``) and
    return the largest logit difference on a fixed batch; None for a method that learns virtual tokens, which has
    no weights to merge into."""
    import torch
    from peft import PeftModel

    if row["peft_type"] in PROMPT_LEARNING or row["method"] == "full":
        return None
    with _quiet_loading():
        model = PeftModel.from_pretrained(build_causal_lm(preset), Path(row["path"]) / "adapter").eval()
    batch = torch.arange(3, 3 + 2 * 24).reshape(2, 24) % model.config.vocab_size
    with torch.no_grad():
        adapted = model(input_ids=batch).logits
        merged = model.merge_and_unload()(input_ids=batch).logits
    return float((adapted - merged).abs().max())


@contextlib.contextmanager
def _quiet_loading():
    """transformers' "Loading weights" progress bar off while a model loads (a lesson loads one per method)."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def method_table(best: list[dict]) -> str:
    """Each method at its best rate: trainable parameters, adapter file, rate, held-out loss and exact match,
    forgetting (the loss on pretraining-style rows, after minus before), seconds per step, trainable state
    (gradients and optimizer) and whether it merged."""
    rows = []
    for r in best:
        forgetting = (f"{r['forgetting_after'] - r['forgetting_before']:+.3f}"
                      if r["forgetting_after"] is not None else "-")
        merged = "-" if r["method"] == "full" else r.get("merge_gap", "-")
        rows.append([r["label"], f"{r['trainable_params']:,}",
                     format_bytes(r["adapter_bytes"]) if r["adapter_bytes"] else "-",
                     f"{r['learning_rate']:g}" + (" (an end)" if r["at_edge"] else ""),
                     f"{r['eval_loss']:.3f}", f"{r['exact_match']:.2f}", forgetting, f"{1000 * r['step_s']:.0f} ms",
                     format_bytes(r["memory_parts"]["gradients"] + r["memory_parts"]["optimizer_states"]),
                     "no" if merged is None else "-" if merged == "-" else f"yes ({merged:.0e})"])
    return text_table(["method", "trainable", "adapter", "best lr", "held-out loss", "exact match", "forgetting",
                       "step", "grads+optim", "merges"], rows)


def plot_pareto(best: list[dict], out: str | Path) -> Path:
    """Held-out loss against trainable parameters and against seconds per step, one point per method, the
    Pareto front (no other method both cheaper and better) drawn through: ``<out>/pareto.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, label in ((axes[0], "trainable_params", "trainable parameters"),
                           (axes[1], "step_s", "seconds per training step")):
        points = sorted(best, key=lambda r: r[key])
        for r in points:
            ax.scatter(r[key], r["eval_loss"], color="tab:red" if r["method"] == "full" else "tab:blue")
            ax.annotate(r["label"], (r[key], r["eval_loss"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        front, lowest = [], float("inf")
        for r in points:
            if r["eval_loss"] < lowest:
                front.append(r)
                lowest = r["eval_loss"]
        ax.step([r[key] for r in front], [r["eval_loss"] for r in front], where="post", color="gray", alpha=0.6)
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out loss (lower is better)")
    fig.suptitle("PEFT methods at their best learning rate: quality against cost (gray: the Pareto front)")
    fig.tight_layout()
    path = Path(out) / "pareto.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pareto_front(best: list[dict], key: str) -> list[str]:
    """The methods no other method beats on both ``key`` (a cost) and held-out loss, cheapest first."""
    front, lowest = [], float("inf")
    for r in sorted(best, key=lambda r: (r[key], r["eval_loss"])):
        if r["eval_loss"] < lowest:
            front.append(r["label"])
            lowest = r["eval_loss"]
    return front


