"""A sweep's results read back: one row per complete cell, seeds averaged, and the table of them."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

from my_utils.core.adapters import AdapterSpec
from my_utils.core.memory import format_bytes
from my_utils.core.records import row_of
from my_utils.core.stats import pooled_noise
from my_utils.core.tables import text_table
from my_utils.run.locks import current_status
from my_utils.run.results import load_run, read_json
from my_utils.tools.sweep.spec import cell_name


def cell_status(folder: Path) -> str | None:
    """The cell's run status (``crashed`` for a running one whose process is gone), or None without a run."""
    try:
        return current_status(read_json(folder / "run.json"), folder)
    except (OSError, ValueError):
        return "unreadable" if folder.exists() else None


def saved_cells(out: Path) -> list[dict]:
    """The cells recorded in ``out/sweep.json``: every cell any run of the sweep in ``out`` asked for."""
    saved = out / "sweep.json"
    return read_json(saved).get("cells", []) if saved.is_file() else []


# What a row says about its cell: the settings in effect (defaults resolved), from summary.json and run.json; the
# adapter's are every field of AdapterSpec, read from peft's recorded config (``my_utils.core.records``).
ADAPTER_SETTINGS = tuple(f.name for f in fields(AdapterSpec) if f.metadata.get("flag") is not False)
SETTINGS = ("method", *ADAPTER_SETTINGS, "learning_rate", "steps", "seed")


def load_sweep(out: str | Path) -> list[dict]:
    """One row per complete cell of the sweep in ``out``, in the sweep's order: the cell, the settings it ran
    with and the figures a sweep compares."""
    out = Path(out)
    rows = []
    for cell in saved_cells(out):
        folder = out / cell_name(cell)
        if cell_status(folder) != "complete":
            continue
        run = load_run(folder)
        s = run["summary"]
        settings = row_of(run["run"], s)  # the recorded config, the resolved values of the summary over it
        rows.append({
            "name": folder.name,
            "path": str(folder),
            "cell": cell,
            **{key: settings.get(key) for key in SETTINGS},
            "peft_type": settings["peft_type"],
            "pid": run["run"].get("pid"),
            "ppid": run["run"].get("ppid"),
            "runtime_s": s["runtime_s"],
            "samples_per_s": s["samples_per_s"],
            "peak_memory_bytes": s["peak_memory_bytes"],
            "trainable_params": s["trainable_params"],
            "adapter_bytes": s["adapter_bytes"],
            "eval_loss": s.get("eval_loss"),
            "train_loss_final": s.get("train_loss_final"),
            "exact_match": s.get("exact_match_after"),
            "loss_curve": [(m["step"], m["loss"]) for m in run["metrics"] if "loss" in m and "step" in m],
        })
    return rows


def seed_means(rows: list[dict]) -> list[dict]:
    """One row per setting, its seeds merged: the first seed's row (costs, curve) with the held-out loss averaged
    over the seeds, which ``eval_losses`` keeps beside ``seeds``. Rows of one seed pass through as they are."""
    groups = {}
    for r in rows:
        groups.setdefault(json.dumps([r[k] for k in SETTINGS if k != "seed"]), []).append(r)
    merged = []
    for group in groups.values():
        group = sorted(group, key=lambda r: r["seed"])
        losses = [r["eval_loss"] for r in group]
        merged.append({**group[0], "seeds": [r["seed"] for r in group], "eval_losses": losses,
                       "eval_loss": sum(losses) / len(losses) if None not in losses else None})
    return merged


def seed_noise(rows: list[dict]):
    """The held-out loss's spread between seeds, pooled over every setting that ran two seeds or more (a
    ``my_utils.core.stats.Noise``), or None where none did: then no difference is called noise."""
    groups = [r["eval_losses"] for r in seed_means(rows) if len(r["eval_losses"]) > 1]
    return pooled_noise(groups) if groups else None


def select(rows: list[dict], **settings) -> list[dict]:
    """The rows whose settings (``SETTINGS``, as the runs recorded them) are ``settings``:
    ``select(rows, method="lora", alpha=32, learning_rate=4e-3)``."""
    def same(have, want):
        if isinstance(want, float) and isinstance(have, (int, float)):
            return math.isclose(have, want, rel_tol=1e-6)
        return have == (list(want) if isinstance(want, tuple) else want)

    return [r for r in rows if all(same(r[key], value) for key, value in settings.items())]


def update_scale(row: dict) -> float | None:
    """The factor LoRA multiplies its update B A by: alpha / r, or alpha / sqrt(r) with rsLoRA (None for full
    fine-tuning)."""
    if row["method"] != "lora":
        return None
    return row["alpha"] / (math.sqrt(row["rank"]) if row["rslora"] else row["rank"])


def row_label(row: dict, keys=("rank", "alpha", "rslora", "targets")) -> str:
    """A row's settings in words, those named in ``keys`` (the ones that tell the compared rows apart)."""
    if row["method"] != "lora":
        return f"full fine-tuning, lr {row['learning_rate']:g}" if "learning_rate" in keys else "full fine-tuning"
    words = {"rank": f"rank {row['rank']}", "alpha": f"alpha {row['alpha']:g}",
             "rslora": "rsLoRA" if row["rslora"] else "", "targets": "+".join(row["targets"]),
             "learning_rate": f"lr {row['learning_rate']:g}", "steps": f"{row['steps']} steps",
             "seed": f"seed {row['seed']}"}
    for key in keys:  # any other setting (an adapter field added later): its name and value
        if key not in words:
            words[key] = key if row[key] is True else "" if row[key] in (False, None) else f"{key} {row[key]}"
    return ", ".join(words[k] for k in keys if words[k]) or "LoRA"


def varying(rows: list[dict], keys=SETTINGS) -> list[str]:
    """The settings that differ between the LoRA rows among ``rows``."""
    lora = [r for r in rows if r["method"] == "lora"]
    return [k for k in keys if len({json.dumps(r[k]) for r in lora}) > 1]


def number_text(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def sweep_table(rows: list[dict]) -> str:
    """Every cell's figures, one line per cell (the folder's name says the cell)."""
    header = ["cell", "scale", "trainable", "adapter", "peak memory", "runtime", "held-out loss", "final train loss",
              "exact match"]
    table = [[r["name"], number_text(update_scale(r), "{:.3g}"), f"{r['trainable_params']:,}",
              format_bytes(r["adapter_bytes"]), format_bytes(r["peak_memory_bytes"]), f"{r['runtime_s']:.1f} s",
              number_text(r["eval_loss"], "{:.3f}"), number_text(r["train_loss_final"], "{:.3f}"),
              number_text(r["exact_match"], "{:.2f}")] for r in rows]
    if all(r["exact_match"] is None for r in rows):  # the generation evaluation was skipped
        header, table = header[:-1], [line[:-1] for line in table]
    return text_table(header, table)
