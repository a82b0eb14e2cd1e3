"""Compare results folders: tables (text or markdown) and plots, built only from complete runs.

    python -m my_utils compare runs/run_1_cpu_x2                    # tables in the terminal
    python -m my_utils compare runs/run_1_cpu_x2 --markdown         # markdown tables, for the README
    python -m my_utils compare runs/run_1_cpu_x2 runs/run_2_cuda_x4 --output-dir comparison/   # + PNG plots

Only folders whose run.json says ``complete`` and that have a summary.json enter a table; the others (running,
failed, interrupted, unreadable, no summary, no training figures) are listed by name with their status. Runs
whose library versions or git commit differ from the others are marked, because their figures are not strictly
comparable.

Speedup: runs that differ only in how their global batch is split (the number of processes, the batch per process
and micro-batch, the layout) form a group: same workflow, hardware, configuration, steps and folder, and the same
global batch (processes x batch per process x accumulation). Each run's samples/s is divided by the group's
1-process samples/s and set against the ideal (the number of processes). Pairs of runs of other process counts
that differ in more are left out, listed in the table "Not a speedup", and counted in one line.
"""

from __future__ import annotations

import json
import os
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from my_utils import UserError
from my_utils.core import plots
from my_utils.core.memory import format_bytes, peak_bytes
from my_utils.core.records import adapter_of, global_batch_of, label_of, local_batch_of, lora_settings, process_of
from my_utils.core.tables import TERMINAL_WIDTH, markdown_table, text_table
from my_utils.run.config import OneLineParser
from my_utils.run.results import atomic_write_json, atomic_write_text, check_outside_runs, find_run_dirs, load_run
from my_utils.tools.peft_results import peft_results

# Configuration keys that do not make two runs different experiments: how the global batch is split over processes
# (their number, the batch each takes, its accumulation, the layout) is what a speedup varies, the global batch
# itself being compared instead; the others say where a run is kept and how long a collective waits.
# (Checkpointing, resuming and the threads per process change the speed: runs that differ in them are not one
# experiment.)
NOT_EXPERIMENT_KEYS = frozenset({"num_processes", "local_batch_size", "global_batch_size", "batch_size", "grad_accum",
                                 "parallel", "output_dir", "resume", "timeout_s"})
# A summary with none of these is not a training run (e.g. the demo's own record of notebook timings).
TRAINING_KEYS = ("steps", "samples_per_s", "train_loss_final", "peak_memory_bytes")
FOLDED_ROWS = 20  # markdown tables longer than this are folded (<details>)
TEXT_ROWS = 40  # terminal tables longer than this are named in one line and printed with --verbose
DETAIL_TABLES = ("Not a speedup",)  # counted in the "not compared" line; printed with --verbose
NAME_COLUMNS = {"Speedup": (0, 1), "Not a speedup": (0, 2)}  # the columns of names a narrow terminal shortens
VERSIONS_MARK = "†"
COMMIT_MARK = "‡"
SHARED_MARK = "§"


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]
    caption: str = ""
    notes: tuple = ()  # (columns, note): a part of the caption, shown only where one of those columns is shown


@dataclass
class Comparison:
    """Everything ``compare`` reports: the complete runs with their labels, the tables, the speedup groups
    (label -> [(processes, speedup)]), the runs left out with their reason, notes on provenance, and the pairs of
    process counts that are no speedup (run, other run, how they differ)."""

    runs: list[dict]
    labels: dict[str, str]
    tables: list[Table]
    speedup_groups: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    left_out: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unpaired: list[tuple[str, str, str]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- loading


# The figures the tables read from a summary (numbers, or absent), and the records they read from run.json.
NUMBER_KEYS = ("steps", "samples_per_s", "samples_per_cpu_s", "tokens_per_s", "train_loss_first", "train_loss_final",
               "eval_loss", "eval_loss_before", "runtime_s", "world_size", "trainable_params", "total_params",
               "peak_memory_bytes", "learning_rate", "grad_accum", "global_batch_size", "local_batch_size",
               "effective_batch", "batch_size_per_process",
               "adapter_bytes", "exact_match_before", "exact_match_after", "similarity_before", "similarity_after",
               "accuracy_before", "accuracy_after")
RECORD_KINDS = {"status": str, "config": dict, "versions": dict, "devices": list, "commit": str, "world_size": int}


def malformed(run: dict) -> str | None:
    """What in a loaded run is not as a course run writes it (a field of another type: a folder written by hand or
    by another program), in a few words; None when the tables can read it."""
    for key, kind in RECORD_KINDS.items():
        value = run["run"].get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            return f"run.json's {key} is {type(value).__name__}, not {kind.__name__}"
    summary = run["summary"] if isinstance(run["summary"], dict) else {}
    for key in NUMBER_KEYS:
        value = summary.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"summary.json's {key} is {type(value).__name__}, not a number"
    memory = summary.get("memory")
    if memory is not None and (not isinstance(memory, list) or not all(
            isinstance(entry, dict) and all(isinstance(entry.get(k, {}), dict) for k in ("end", "breakdown"))
            for entry in memory)):
        return "summary.json's memory is not a list of per-rank records"
    return None


def load_runs(*paths) -> tuple[list[dict], list[dict]]:
    """(complete runs, other runs) found at or below ``paths``; each other run carries ``reason``."""
    complete, other = [], []
    for d in find_run_dirs(*paths):
        try:
            run = load_run(d)
            problem = malformed(run)
            if problem:
                raise ValueError(problem)
        except (OSError, ValueError) as e:  # a run.json or summary.json that is not a JSON object, or not a run's
            other.append({"path": str(d), "run": {}, "summary": None, "metrics": [],
                          "reason": f"unreadable: {e.strerror if isinstance(e, OSError) else e}"})
            continue
        status = run["run"].get("status")
        summary = run["summary"] if isinstance(run["summary"], dict) else {}
        if status == "complete" and any(k in summary for k in TRAINING_KEYS):
            complete.append(run)
        else:
            run["reason"] = (str(status or "no status") if status != "complete" else
                             "complete, but no summary.json" if not summary else "complete, no training figures")
            other.append(run)
    return complete, other


def run_labels(runs: list[dict], root: Path | str | None = None) -> dict[str, str]:
    """Short names for runs: paths relative to ``root``, or to the folder all of them share."""
    paths = [Path(r["path"]).resolve() for r in runs]
    if root is None and paths:
        root = Path(os.path.commonpath([p.parent for p in paths]))
    labels = {}
    for run, p in zip(runs, paths):
        try:
            labels[run["path"]] = p.relative_to(Path(root).resolve()).as_posix() if root else str(p)
        except ValueError:
            labels[run["path"]] = run["path"]
    return labels


# ---------------------------------------------------------------------------------------------- provenance


def _versions_key(run: dict) -> str:
    return json.dumps(run["run"].get("versions") or {}, sort_keys=True)


def provenance_marks(runs: list[dict], labels: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Marks for runs whose library versions or commit differ from the most common ones, and notes saying how."""
    marks = {r["path"]: "" for r in runs}
    notes = []
    if not runs:
        return marks, notes
    common_versions = Counter(_versions_key(r) for r in runs).most_common(1)[0][0]
    common_commit = Counter(r["run"].get("commit") for r in runs).most_common(1)[0][0]
    reference = json.loads(common_versions)
    differences: dict[str, list[str]] = {}  # one note per difference, naming the runs that have it
    for r in runs:
        if _versions_key(r) != common_versions:
            marks[r["path"]] += VERSIONS_MARK
            mine = r["run"].get("versions") or {}
            diff = ", ".join(f"{k} {mine.get(k)} (others {reference.get(k)})"
                             for k in sorted(set(mine) | set(reference)) if mine.get(k) != reference.get(k))
            differences.setdefault(f"{VERSIONS_MARK} other library versions: {diff}", []).append(labels[r["path"]])
        if r["run"].get("commit") != common_commit:
            marks[r["path"]] += COMMIT_MARK
            differences.setdefault(f"{COMMIT_MARK} other commit {str(r['run'].get('commit'))[:10]} (others "
                                   f"{str(common_commit)[:10]})", []).append(labels[r["path"]])
    # a sweep's cells that shared a worker process (run_sweep(fresh_processes=False)): one pid on one host
    processes = Counter((r["run"].get("host"), r["run"].get("pid")) for r in runs)
    for r in runs:
        if r["run"].get("pid") is not None and processes[(r["run"].get("host"), r["run"].get("pid"))] > 1:
            marks[r["path"]] += SHARED_MARK
            differences.setdefault(f"{SHARED_MARK} trained in a process shared with other runs: its peak memory is "
                                   "that process's so far, not its own", []).append(labels[r["path"]])
    notes = [f"{difference}: {name_runs(names)}" for difference, names in differences.items()]
    dirty = [labels[r["path"]] for r in runs if r["run"].get("dirty")]
    if dirty:
        notes.append(f"made with uncommitted changes: {name_runs(dirty)}")
    return marks, notes


def name_runs(names: list[str], shown: int = 3) -> str:
    """Runs named in a note: all of them when few, else their count, the folder they share and the first few."""
    if len(names) <= shown:
        return ", ".join(names)
    shared = os.path.commonpath(names) if all("/" in n for n in names) else ""
    where = f" under {shared}/" if shared else ""
    return f"{len(names)} runs{where} ({', '.join(names[:shown])}, ...)"


# ---------------------------------------------------------------------------------------------- grouping


def hardware(run: dict) -> str:
    """The device a run trained on, as named in run.json: the first GPU, else the CPU."""
    devices = run["run"].get("devices") or []
    gpus = [d.get("name") for d in devices if d.get("kind") == "cuda"]
    cpus = [d.get("name") for d in devices if d.get("kind") == "cpu"]
    return (gpus or cpus or ["unknown"])[0]


def experiment_settings(run: dict) -> dict:
    """What must match for two runs to differ only in how their global batch is split: the workflow, method,
    hardware, configuration, global batch, steps, threads per process, whether it was resumed, and the folder that
    holds them (one lesson's or benchmark's runs: a benchmark's 1-process repeats of another kind are not another
    group's baseline)."""
    config = {k: v for k, v in (run["run"].get("config") or {}).items() if k not in NOT_EXPERIMENT_KEYS}
    s = run["summary"]
    return {"workflow": s.get("workflow"), "method": label_of(run["run"], s), "hardware": hardware(run),
            "global batch": global_batch(run), "steps": s.get("steps"),
            "threads per process": run["run"].get("threads_per_process"), "resumed": bool(run["run"].get("resumes")),
            "folder": str(Path(run["path"]).parent), **config}


def global_batch(run: dict) -> int | None:
    """Examples per optimizer step over all processes (``global_batch_of``); None where the records do not say."""
    return global_batch_of(run["run"], run["summary"])


def experiment_key(run: dict) -> str:
    return json.dumps(experiment_settings(run), sort_keys=True, default=str)


def short(value, width: int = 24) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def unpaired(runs: list[dict], groups) -> list[tuple[dict, dict, str]]:
    """Pairs of runs of other process counts in one folder that form no speedup because they differ in more: (run,
    other, the settings that differ), each pair once. Runs that are in a group are not listed again."""
    grouped = {r["path"] for _, members, _ in groups for r in members}
    timed = [r for r in runs if r["summary"].get("samples_per_s") and r["path"] not in grouped]
    pairs, seen = [], set()
    for r in timed:  # each run against the first of another process count in its folder
        mine = experiment_settings(r)
        other = next((o for o in timed if world_size(o) != world_size(r)
                      and experiment_settings(o)["folder"] == mine["folder"]), None)
        if other is None or frozenset((r["path"], other["path"])) in seen:
            continue
        seen.add(frozenset((r["path"], other["path"])))
        theirs = experiment_settings(other)
        differ = [k for k in sorted(set(mine) | set(theirs), key=str) if mine.get(k) != theirs.get(k)]
        if differ == ["threads per process"]:
            why = (f"threads per process {mine[differ[0]]} against {theirs[differ[0]]}: run both with the same "
                   "OMP_NUM_THREADS")
        else:
            why = "; ".join(f"{k} {short(mine.get(k))} against {short(theirs.get(k))}" for k in differ[:3])
        pairs.append((r, other, why))
    return pairs


def world_size(run: dict) -> int:
    return int(run["summary"].get("world_size") or run["run"].get("world_size") or 1)


def describe(run: dict) -> str:
    """A short name for a group of runs: workflow, preset, method and LoRA rank."""
    s = run["summary"]
    parts = [s.get("workflow"), s.get("preset"), label_of(run["run"], s)]
    lora_rank = lora_settings(adapter_of(run["run"]))["rank"]
    if lora_rank:
        parts.append(f"r{lora_rank}")
    parts.append(hardware(run).split(" @ ")[0])
    return " ".join(dict.fromkeys(str(p) for p in parts if p))  # "lora tiny lora" -> "lora tiny"


def speedup_groups(runs: list[dict]) -> list[tuple[str, list[dict], float | None]]:
    """Groups of runs that differ only in how their global batch is split (two process counts at least):
    (name, runs sorted by processes, mean samples/s of the group's 1-process runs or None)."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        if r["summary"].get("samples_per_s"):
            groups.setdefault(experiment_key(r), []).append(r)
    result, names = [], Counter()
    for members in groups.values():
        if len({world_size(r) for r in members}) < 2:
            continue
        members.sort(key=world_size)
        name = f"{Path(members[0]['path']).parent.name}: {describe(members[0])}"
        names[name] += 1
        if names[name] > 1:
            name = f"{name} #{names[name]}"
        singles = [r["summary"]["samples_per_s"] for r in members if world_size(r) == 1]
        result.append((name, members, sum(singles) / len(singles) if singles else None))
    return result


# ---------------------------------------------------------------------------------------------- tables


def _num(value, fmt: str = "{:.3g}") -> str:
    return "-" if value is None else fmt.format(value)


def _count(n) -> str:
    """A parameter count in three figures: 2.05M, 1.1B (``-`` for none)."""
    if not isinstance(n, (int, float)):
        return "-"
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _arrow(before, after, fmt: str = "{:.3f}") -> str:
    if before is None and after is None:
        return "-"
    return f"{_num(before, fmt)} -> {_num(after, fmt)}"


def _drop_empty_columns(table: Table) -> Table:
    """Leave out columns that no run fills (other workflows report other figures)."""
    keep = [i for i in range(len(table.header)) if i == 0 or any(r[i] != "-" for r in table.rows)]
    header = [table.header[i] for i in keep]
    caption = "; ".join([table.caption] * bool(table.caption)
                        + [note for columns, note in table.notes if note and set(columns) & set(header)])
    return Table(table.title, header, [[r[i] for i in keep] for r in table.rows], caption)


def runs_table(runs, name) -> Table:
    rows = []
    for r in runs:
        s = r["summary"]
        steps = s.get("steps") if isinstance(s.get("steps"), int) else None  # a benchmark may keep a table there
        resumed = s.get("resumed_from_step")  # its runtime and rates are those of the steps after it
        rows.append([name(r), str(s.get("workflow") or "-").rsplit(".", 1)[-1], str(label_of(r["run"], s) or "-"),
                     str(world_size(r)), _num(steps, "{}") + (f" (from {resumed})" if resumed else ""),
                     _num(s.get("runtime_s"), "{:.1f} s"),
                     _num(s.get("samples_per_s"), "{:.1f}"), _num(s.get("tokens_per_s"), "{:,.0f}"),
                     format_bytes(s.get("peak_memory_bytes")), _num(s.get("trainable_params"), "{:,}"),
                     _count(s.get("total_params"))])
    resumed = any("(from" in row[4] for row in rows)
    return Table("Runs", ["run", "workflow", "method", "procs", "steps", "runtime", "samples/s", "tokens/s",
                          "peak/device", "trainable", "params"], rows,
                 "steps (from k): a resumed run, whose runtime and rates are those of its steps after k" * resumed)


def speedup_table(groups, name) -> Table:
    rows = []
    for group, members, base in groups:
        for r in members:
            s, n = r["summary"], world_size(r)
            speedup = s["samples_per_s"] / base if base else None
            rows.append([group, name(r), str(n), _num(global_batch(r), "{}"), f"{s['samples_per_s']:.1f}",
                         _num(speedup, "{:.2f}x"), _num(speedup / n if speedup else None, "{:.0%}")])
    return Table("Speedup", ["group", "run", "procs", "global batch", "samples/s", "speedup", "efficiency"], rows,
                 "the runs of a group differ only in how the global batch is split; speedup = samples/s / samples/s "
                 "of the group's 1-process run; efficiency = speedup / procs, the ideal speedup")


def unpaired_table(pairs, name) -> Table:
    return Table("Not a speedup", ["run", "procs", "against", "procs", "they differ in"],
                 [[name(r), str(world_size(r)), name(o), str(world_size(o)), why] for r, o, why in pairs],
                 "runs of other process counts in one folder that differ in more than how the global batch is split")


def left_out_table(left_out) -> Table:
    return Table("Left out", ["run", "why"], [[label, reason] for label, reason in left_out],
                 "runs that are not complete, or have no training figures")


def memory_table(runs, name) -> Table:
    rows = []
    for r in runs:
        for entry in r["summary"].get("memory") or []:
            end = entry.get("end") or {}
            first = entry.get("first_step") or {}
            cuda = end.get("peak_allocated") is not None
            parts = entry.get("breakdown") or {}
            rows.append([name(r), str(world_size(r)), str(process_of(entry)), str(end.get("device", "-")),
                         "peak allocated" if cuda else "peak RSS", format_bytes(peak_bytes(end)),
                         format_bytes(peak_bytes(first)) if first else "-", format_bytes(end.get("peak_reserved")),
                         *(format_bytes(parts.get(k)) for k in ("weights", "gradients", "optimizer_states",
                                                                "saved_activations"))])
    measures = {row[4] for row in rows}
    caption = "; ".join(["CUDA: peak allocated by tensors"] * ("peak allocated" in measures)
                        + ["CPU: peak resident memory of the process (includes Python and torch)"] * ("peak RSS" in measures))
    return Table("Memory per device", ["run", "procs", "rank", "device", "measure", "peak", "step 1",
                                       "reserved", "weights", "gradients", "optimizer", "activations"],
                 rows, caption, ((("step 1",), "step 1: the peak after the first step"),
                                 (("reserved",), "reserved: CUDA's peak reserved"),
                                 (("weights", "gradients", "optimizer", "activations"), "the parts are measured from the "
                                  "tensors (activations: what autograd kept for backward in the first step)")))


def batch_table(runs, name) -> Table:
    rows = []
    for r in runs:
        s = r["summary"]
        rows.append([name(r), str(world_size(r)), _num(local_batch_of(s), "{}"),
                     _num(s.get("grad_accum"), "{}"), _num(global_batch(r), "{}"),
                     str(s.get("lr_scaling") or "-"), _num(s.get("learning_rate"), "{:.2e}")])
    return Table("Batch and learning rate", ["run", "procs", "batch/process", "grad accum", "global batch",
                                             "lr scaling", "learning rate"], rows,
                 "global batch = batch/process x grad accum x processes")


def quality_table(runs, name) -> Table:
    rows = []
    for r in runs:
        s = r["summary"]
        rows.append([name(r), _arrow(s.get("train_loss_first"), s.get("train_loss_final")),
                     _num(s.get("eval_loss"), "{:.3f}"),
                     _arrow(s.get("exact_match_before"), s.get("exact_match_after"), "{:.2f}"),
                     _arrow(s.get("similarity_before"), s.get("similarity_after"), "{:.2f}"),
                     _arrow(s.get("accuracy_before"), s.get("accuracy_after"), "{:.2f}"),
                     format_bytes(s.get("adapter_bytes"))])
    scorers = sorted({r["summary"]["similarity_scorer"] for r in runs if r["summary"].get("similarity_scorer")})
    return Table("Quality", ["run", "train loss", "eval loss", "exact match", "similarity", "accuracy", "adapter"],
                 rows, notes=((("train loss",), "train loss a -> b: first -> final"),
                              (("exact match", "similarity", "accuracy"), "scores a -> b: before -> after training"),
                              (("similarity",), f"similarity: {'; '.join(scorers)}" if scorers else "")))


def compare(*paths, root: Path | str | None = None) -> Comparison:
    """Load every results folder at or below ``paths`` and build the comparison tables."""
    complete, other = load_runs(*paths)
    labels = run_labels(complete + other, root)
    marks, notes = provenance_marks(complete, labels)
    name = lambda r: labels[r["path"]] + marks[r["path"]]  # noqa: E731
    groups = speedup_groups(complete)
    tables = [runs_table(complete, name)]
    if groups:
        tables.append(speedup_table(groups, name))
    pairs = unpaired(complete, groups)
    left_out = [(labels[r["path"]], r["reason"]) for r in other]
    tables += [memory_table(complete, name), batch_table(complete, name), quality_table(complete, name),
               unpaired_table(pairs, name), left_out_table(left_out)]
    tables = [_drop_empty_columns(t) for t in tables if t.rows or t.title == "Runs"]
    speedups = {g: [(world_size(r), r["summary"]["samples_per_s"] / base) for r in members]
                for g, members, base in groups if base}
    missing_base = [g for g, _, base in groups if not base]
    if missing_base:
        notes.append(f"no 1-process run to measure speedup against in: {', '.join(missing_base)}")
    return Comparison(complete, labels, tables, speedups, left_out, notes,
                      [(labels[r["path"]], labels[o["path"]], why) for r, o, why in pairs])


# ---------------------------------------------------------------------------------------------- rendering


def render(comparison: Comparison, markdown: bool = False, images: dict[str, str] | None = None,
           verbose: bool = False) -> str:
    """The comparison as text (terminal) or markdown (README), with ``images`` (title -> file) in markdown. As text
    and not ``verbose``, a report: the detail tables (``DETAIL_TABLES``) and those longer than ``TEXT_ROWS`` rows
    are named in one line instead (comparison.txt has them all)."""
    parts, folded = [], []
    for t in comparison.tables:
        if not markdown and not verbose and (t.title in DETAIL_TABLES or len(t.rows) > TEXT_ROWS):
            folded.append(f"{t.title} ({len(t.rows)} rows)")
        elif markdown:
            table = markdown_table(t.header, t.rows) + (f"\n\n{textwrap.fill(t.caption, TERMINAL_WIDTH)}"
                                                        if t.caption else "")
            if len(t.rows) > FOLDED_ROWS:  # a page stays readable: a long table opens on a click
                table = f"<details><summary>{len(t.rows)} rows</summary>\n\n{table}\n\n</details>"
            parts.append(f"### {t.title}\n\n{table}")
        else:
            caption = "\n" + textwrap.fill(f"({t.caption})", TERMINAL_WIDTH) if t.caption else ""
            parts.append(f"{t.title}\n{text_table(t.header, t.rows, names=NAME_COLUMNS.get(t.title, (0,)))}{caption}")
    if images:
        parts.append("\n".join(f"![{title}]({file})" if markdown else f"{title}: {file}"
                                for title, file in images.items()))
    lines = comparison.notes + ([left_out_line(comparison)] if comparison.left_out or comparison.unpaired else [])
    if folded:
        lines.append(f"not shown: {', '.join(folded)}; --verbose prints them, and --output-dir writes them to "
                     "comparison.txt")
    if lines:
        parts.append("\n".join(textwrap.fill(x, TERMINAL_WIDTH, initial_indent="- ", subsequent_indent="  ",
                                             break_on_hyphens=False) for x in lines) if markdown else "\n".join(
            textwrap.fill(x, TERMINAL_WIDTH, subsequent_indent="  ", break_on_hyphens=False) for x in lines))
    return "\n\n".join(parts)


def left_out_line(comparison: Comparison) -> str:
    """One line for everything the tables leave out of a comparison, counted by reason."""
    parts = []
    if comparison.unpaired:
        parts.append(f"{len(comparison.unpaired)} pair(s) of process counts that differ in more than the split of "
                     "the batch (table Not a speedup)")
    if comparison.left_out:
        reasons = Counter(reason for _, reason in comparison.left_out)
        parts.append(f"{len(comparison.left_out)} run(s) not complete or without training figures ("
                     + ", ".join(f"{reason}: {n}" for reason, n in reasons.items()) + "; table Left out)")
    return "not compared: " + "; ".join(parts)


def overview(*paths, root: Path | str | None = None, markdown: bool = False) -> str:
    """Every table for the complete runs under ``paths``, and the list of the runs left out."""
    return render(compare(*paths, root=root), markdown=markdown)


def write_outputs(comparison: Comparison, out: Path | str) -> dict[str, Path]:
    """Write the plots (PNG) and the tables (comparison.md, comparison.txt) into ``out``, and each LoRA-workflow run
    in the layout of peft's method comparison (``method_comparison/<run>.json``); returns the files."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    if any(sum("loss" in m for m in r["metrics"]) > 1 for r in comparison.runs):  # a curve needs two points
        files["Loss curves"] = plots.loss_curves(comparison.runs, comparison.labels, out / "loss_curves.png")
    if any(r["summary"].get("memory") for r in comparison.runs):
        files["Peak memory per device"] = plots.memory_bars(comparison.runs, comparison.labels, out / "memory.png")
    if comparison.speedup_groups:
        files["Speedup against the ideal"] = plots.speedup(comparison.speedup_groups, out / "speedup.png")
    images = {title: p.name for title, p in files.items()}
    trained = [r for r in comparison.runs if r["summary"].get("workflow") == "lora"
               and (r["summary"].get("memory") or [{}])[0].get("breakdown")]  # what the layout's memory needs
    if trained:  # beside peft's published method comparison, in its layout
        files["peft"] = out / "method_comparison"
        files["peft"].mkdir(exist_ok=True)
        for r in trained:
            atomic_write_json(files["peft"] / f"{comparison.labels[r['path']].replace('/', '--')}.json",
                              peft_results(r["path"]))
    atomic_write_text(out / "comparison.md", render(comparison, markdown=True, images=images) + "\n")
    atomic_write_text(out / "comparison.txt", render(comparison, images=images, verbose=True) + "\n")
    return {**files, "markdown": out / "comparison.md", "text": out / "comparison.txt"}


def check_comparison_dir(out: str) -> Path:
    """``--output-dir`` of compare: a folder (new, or one without a comparison yet) outside every results folder."""
    if not out.strip():
        raise UserError("--output-dir is empty; name a folder for the comparison.")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UserError(f"--output-dir {path} is a file; name a folder for the comparison.")
    if (path / "comparison.md").exists():
        raise UserError(f"{path} already holds a comparison, which is never overwritten; choose another --output-dir "
                        "or delete it.")
    check_outside_runs(path)
    return path


def main(argv=None) -> None:
    import argparse

    p = OneLineParser(prog="python -m my_utils compare", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="results folders, or folders that contain them")
    p.add_argument("--markdown", action="store_true", help="print markdown tables (for the README)")
    p.add_argument("--verbose", action="store_true", help=f"print every table whole (tables over {TEXT_ROWS} rows, "
                   "and the pairs that are not a speedup, are otherwise named in one line)")
    p.add_argument("--output-dir", dest="out", help="folder to write comparison.md, comparison.txt and the PNG plots into")
    args = p.parse_args(argv)
    missing = [x for x in args.paths if not Path(x).exists()]
    if missing:
        raise UserError(f"{missing[0]} does not exist; pass results folders such as runs/run_1_cpu_x2.")
    if args.out is not None:
        check_comparison_dir(args.out)  # before the runs are read
    comparison = compare(*args.paths)
    if not comparison.runs and not comparison.left_out:
        raise UserError(f"No results folder (a folder with run.json) under {' '.join(args.paths)}; "
                        "pass the folder a run wrote.")
    if not comparison.runs:
        print(f"No complete training run under {' '.join(args.paths)} to compare; what is there:\n")
        print(render(Comparison([], comparison.labels, [left_out_table(comparison.left_out)]), markdown=args.markdown))
        return
    files = write_outputs(comparison, check_comparison_dir(args.out)) if args.out is not None else {}
    images = {t: str(f) for t, f in files.items() if f.suffix == ".png"}
    print(render(comparison, markdown=args.markdown, images=images, verbose=args.verbose))
