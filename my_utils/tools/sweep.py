"""A LoRA sweep over a grid of settings: one fresh process per cell, each writing its own results folder, then
tables, plots and sentences computed from those folders.

    python -m my_utils sweep --preset tiny --grid rank=1,4,16,64 alpha=32 --output-dir runs/sweeps/tiny
    python -m my_utils sweep --preset tiny --grid rank=4,64 alpha=32 learning_rate=2e-3,8e-3 \\
        --grid method=full learning_rate=2e-4,8e-4 --jobs 2 --output-dir runs/sweeps/tiny_lr
    python -m my_utils sweep --preset opt-350m --ranks 8 128 256 --output-dir runs/sweeps/opt-350m   # a GPU
    python -m my_utils sweep --spec sweep.json --output-dir runs/sweeps/mine

A sweep is declarative: a spec (a preset, the workflow options every cell shares, and grids) saved as
``sweep.json`` in the sweep folder. A grid maps workflow options to the values they take, and its cells are every
combination (``rank=4,64 learning_rate=2e-3,8e-3`` is four cells); the sweep's cells are those of all its grids,
a cell that two grids share counted once. ``--ranks 8 128 256`` is the grid ``rank=8,128,256`` with the workflow's
default alpha, 2 x rank: the update's scale (alpha / rank) then stays 2, so a larger rank also takes larger steps
and the sweep measures both (notebook 07 takes them apart); ``--grid rank=8,128,256 alpha=16`` holds alpha fixed.

Every cell runs ``python -m my_utils.workflows.lora ...`` in a new process with its own folder (its name says the
cell: ``rank16_alpha32_lr0.004``), so that no memory (allocator caches, a peak counter) carries over from one
cell to the next. Running the sweep again skips every cell whose folder says ``complete``; a folder left by a
failed or interrupted cell is renamed (``rank16_alpha32_lr0.004.failed``) and that cell runs again. With
``--jobs 2`` two one-process cells train at a time on a CPU, each with half of the cores: quicker, and each
cell's peak memory is still its own process's, but a cell's runtime then depends on its neighbour, so compare
runtimes only between cells that ran under the same conditions.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import math
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path, PurePath

from my_utils import JobFailed, UserError
from my_utils.core.adapters import AdapterSpec
from my_utils.run.results import RUNS_ROOT, atomic_write_json, current_status, load_run, read_json, unique_dir

WORKFLOW = "my_utils.workflows.lora"
# Options the sweep gives every cell itself.
SET_BY_SWEEP = ("preset", "output_dir", "num_processes", "resume")
# Grids to run when none are given: ranks at a fixed alpha (the update's scale then falls as 1/rank, so that a
# rank's quality is not its step size), a dense range on the tiny model, the classic assignment's on real models.
DEFAULT_GRIDS = {"tiny": [{"rank": [1, 4, 16, 64], "alpha": [32]}]}
REAL_MODEL_GRIDS = [{"rank": [8, 128, 256], "alpha": [16]}]
# The options every cell shares when none are given: few steps on the tiny model, so that a sweep takes a minute, in
# fp32 (its matrices are too small for bf16 autocast to pay for itself).
DEFAULT_ARGS = {"tiny": {"max_steps": 40, "eval_rows": 100, "logging_steps": 5, "mixed_precision": "no"}}
# Short names of options in a cell's folder name (the others keep theirs).
SHORT_NAMES = {"learning_rate": "lr", "max_steps": "steps", "batch_size": "batch"}
# Environment for a process whose peak resident memory is compared with another's. glibc raises its mmap
# threshold each time a large block is freed, so later large blocks come from a heap that keeps freed memory:
# the peak then depends on the order of frees and moves by 20 MiB between identical runs. A fixed threshold
# returns every large block to the system when freed (identical runs then agree within 1 MiB).
STEADY_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _options() -> dict:
    """The workflow's options, in its order: the command line ``parse_config`` generates from its Config (the
    adapter's fields included), name -> argparse action. A field added to the Config or to ``AdapterSpec`` is an
    option here with no edit."""
    from my_utils.run.config import config_parser
    from my_utils.workflows.lora import DESCRIPTION, Config

    parser = config_parser(Config, prog=WORKFLOW, description=DESCRIPTION)
    return {action.dest: action for action in parser._actions if action.option_strings and action.dest != "help"}


def _flags(options: dict) -> list[str]:
    """Workflow command-line options: ``{"max_steps": 0}`` is ``--max-steps 0`` (every value passes, 0 included),
    True a bare switch (``--rslora``), a list several values (``--targets c_attn c_fc``); False and None leave the
    option out, so that the workflow's default applies."""
    flags = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, *map(str, value)] if isinstance(value, (list, tuple)) else [flag, str(value)]
    return flags


def _workflow_config(options: dict):
    """The workflow's Config for ``options``, read by the workflow's own parser (its types and choices); the
    parser's one-line complaint becomes a UserError."""
    from my_utils.workflows.lora import parse_args

    complaint = io.StringIO()
    try:
        with contextlib.redirect_stderr(complaint):
            return parse_args(_flags(options))
    except SystemExit:
        reason = complaint.getvalue().strip().split(": error: ", 1)[-1]
        raise UserError(f"The LoRA workflow rejects {' '.join(_flags(options))}: {reason}") from None


def _option_values(cfg) -> dict:
    """The workflow's Config as option -> value (a nested dataclass's fields, e.g. the adapter's, at the top level,
    as they are on the command line)."""
    values = {}
    for key, value in asdict(cfg).items():
        values.update(value if isinstance(value, dict) else {key: value})
    return values


def _canonical(key: str, value, options: dict):
    """``value`` as the workflow reads it (1e-3 and 0.001 are one value; a list of modules stays a list)."""
    if key in SET_BY_SWEEP:
        raise UserError(f"The sweep sets --{key.replace('_', '-')} itself; remove it from the grid and the args.")
    if key not in options:
        raise UserError(f"The LoRA workflow has no option --{key.replace('_', '-')}; "
                        "see python -m my_utils.workflows.lora --help.")
    if options[key].nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise UserError(f"--{key.replace('_', '-')} is a switch: give true or false, not {value!r}.")
        return value
    value = _option_values(_workflow_config({key: value}))[key]
    return list(value) if isinstance(value, tuple) else value


PLAIN_VALUE = re.compile(r"[A-Za-z0-9_.+=-]{1,40}")
LONGEST_NAME = 120  # characters of a cell's folder name; a longer one keeps its start and a hash of the whole


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]


def _name_part(text: str) -> str:
    """A text value as part of a folder name: itself when short and plain (a module name, ``full``), else a readable
    stem and a short hash of the whole value, so that a path never names a folder outside the sweep nor nests
    folders, and two values never share a name."""
    if PLAIN_VALUE.fullmatch(text) and text.strip(".") and not text.startswith("-"):
        return text
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", PurePath(text).stem or text).strip("-")[:24] or "value"
    return f"{stem}-{_short_hash(text)}"


def cell_name(cell: dict) -> str:
    """A cell's folder name, from its options: ``rank16_alpha32_lr0.004``, ``full_lr0.0004``, ``rank4_rslora``,
    ``a-1f2e3d4c`` for a data file ``/data/a.jsonl``; always one folder inside the sweep's."""
    parts = []
    for key, value in cell.items():
        if value is True:
            parts.append(key)
        elif isinstance(value, list):
            parts.append("+".join(_name_part(str(v)) for v in value))
        elif isinstance(value, str):
            parts.append(_name_part(value))
        else:
            parts.append(f"{SHORT_NAMES.get(key, key)}{value:g}")
    name = "_".join(parts) or "default"
    return name if len(name) <= LONGEST_NAME else f"{name[:LONGEST_NAME - 9]}-{_short_hash(name)}"


@dataclass
class SweepSpec:
    """What a sweep runs. Options are the workflow's, without dashes (``{"max_steps": 30}`` is ``--max-steps 30``,
    ``{"rslora": True}`` is ``--rslora``): ``args`` holds those every cell shares, and each grid maps options to the
    values they take (``{"rank": [4, 64], "alpha": [32]}`` is two cells). Every value is checked by the workflow's
    own parser and checks when the spec is made: a bad one stops it with one sentence, before anything runs."""

    preset: str = "tiny"
    grids: list[dict] = field(default_factory=list)
    args: dict = field(default_factory=dict)
    num_processes: int = 1

    def __post_init__(self):
        from my_utils.core.presets import get_preset
        from my_utils.workflows.lora import validate

        get_preset(self.preset)
        options = _options()
        self.args = {key: _canonical(key, value, options) for key, value in self.args.items()}
        self.grids = [self._checked_grid(grid, options) for grid in
                      (self.grids or DEFAULT_GRIDS.get(self.preset, REAL_MODEL_GRIDS))]
        adapters = set()
        for cell in self.cells():
            cfg = _workflow_config({"preset": self.preset, **self.args, **cell})
            validate(cfg)
            if cfg.method == "lora" and cfg.adapter is not None:
                adapters.add((cfg.adapter.targets, cfg.adapter.rank))
        _check_adapters(self.preset, adapters)

    def _checked_grid(self, grid: dict, options: dict) -> dict:
        if not isinstance(grid, dict):
            raise UserError(f"A grid maps options to lists of values, like {{'rank': [4, 16]}}; got {grid!r}.")
        checked = {}
        for key, values in grid.items():
            if key in self.args:
                raise UserError(f"--{key.replace('_', '-')} is both a grid option and a shared arg; keep one.")
            if not isinstance(values, (list, tuple)) or not values:
                raise UserError(f"The grid's {key} takes a non-empty list of values, like [4, 16]; got {values!r}.")
            checked[key] = [_canonical(key, value, options) for value in values]
            repeated = [v for i, v in enumerate(checked[key]) if v in checked[key][:i]]
            if repeated:
                raise UserError(f"The grid gives {key} {repeated[0]!r} twice; list each value once.")
        return checked

    def cells(self) -> list[dict]:
        """Every grid's cells, in order, each once: the options that set a cell apart (in the workflow's order;
        None and False, the workflow's defaults, left out). A cell that runs what an earlier one runs (``seed`` 0
        beside no seed: the workflow's default) is that cell, not a second run of it."""
        order = list(_options())
        cells, runs = {}, set()
        for grid in self.grids:
            for values in itertools.product(*grid.values()):
                cell = {k: v for k, v in sorted(zip(grid, values), key=lambda kv: order.index(kv[0]))
                        if v is not None and v is not False}
                run = repr(_workflow_config({"preset": self.preset, **self.args, **cell}))
                if run in runs:
                    continue
                runs.add(run)
                if cells.setdefault(cell_name(cell), cell) != cell:
                    raise UserError(f"Two cells would share the folder {cell_name(cell)}; make their values differ "
                                    "in the first six digits.")
        return list(cells.values())


def _check_adapters(preset_name: str, adapters: set) -> None:
    """Every (target modules, rank) exists in the preset's architecture and fits its layers (built on the meta
    device: no weights)."""
    from my_utils.core.presets import get_preset

    preset = get_preset(preset_name)
    shipped = preset.offline_config.get("causal")
    if not adapters or not shipped:
        return
    from my_utils.core.devices import meta_model
    from my_utils.core.models import check_lora_targets

    model = meta_model(shipped)
    for targets, rank in sorted(adapters, key=str):
        check_lora_targets(model, targets or preset.lora_targets, rank)


def cell_command(spec: SweepSpec, cell: dict, folder: Path) -> list[str]:
    """The command that trains one cell in a new process (``accelerate launch`` for several processes)."""
    from my_utils.run.launch import accelerate_command

    args = ["--preset", spec.preset, *_flags({**spec.args, **cell}), "--output-dir", str(folder)]
    if spec.num_processes > 1:
        return accelerate_command(WORKFLOW, [*args, "--num-processes", str(spec.num_processes)],
                                  num_processes=spec.num_processes)
    return [sys.executable, "-m", WORKFLOW, *args]


def _status(folder: Path) -> str | None:
    """The cell's run status (``crashed`` for a running one whose process is gone), or None without a run."""
    try:
        return current_status(read_json(folder / "run.json"), folder)
    except (OSError, ValueError):
        return "unreadable" if folder.exists() else None


def _saved_cells(out: Path) -> list[dict]:
    """The cells recorded in ``out/sweep.json``: every cell any run of the sweep in ``out`` asked for."""
    saved = out / "sweep.json"
    return read_json(saved).get("cells", []) if saved.is_file() else []


def _check_same_experiment(spec: SweepSpec, out: Path) -> None:
    """A sweep folder holds one experiment: the same preset, shared args and process count for every cell."""
    saved_file = out / "sweep.json"
    if not saved_file.is_file():
        return
    saved = read_json(saved_file)
    mine = asdict(spec)
    different = [k for k in ("preset", "args", "num_processes") if saved.get(k) != json.loads(json.dumps(mine[k]))]
    if different:
        raise UserError(
            f"The sweep in {out} was run with another {different[0]} ({saved.get(different[0])!r}); "
            "use another --output-dir for a different experiment."
        )


def run_sweep(spec: SweepSpec, out: str | Path, jobs: int = 1, steady_memory: bool = True,
              fresh_processes: bool = True) -> list[dict]:
    """Train every cell of ``spec`` not yet complete in ``out``, each in its own process, ``jobs`` at a time;
    returns ``load_sweep(out)``. ``steady_memory``: run the cells with ``STEADY_MEMORY_ENV``, so that their peak
    memory compares (it costs each process time in system calls; leave it off for cells compared for quality
    only). ``fresh_processes=False``: ``jobs`` worker processes (``my_utils.tools.sweep_worker``) train the cells
    one after another, importing the libraries once instead of once per cell (seconds a cell); each cell's results
    and tensor memory are its own, its process's peak memory (``peak_memory_bytes``) is not. Every cell's output goes to ``output.log`` in its folder; a line per cell says how it ended. A cell that
    fails does not stop the others (JobFailed at the end names them), unless it refused its input (exit code 2):
    the others would refuse it too, so the sweep stops with that cell's sentence. A model that is neither cached
    nor downloadable stops it before any cell starts."""

    from my_utils.core.devices import usable_cores
    from my_utils.run.config import check_positive
    from my_utils.run.launch import check_process_count, is_cpu_only
    from my_utils.run.results import check_outside_runs, hold_folder, release_folder

    out = Path(out).absolute()  # the cells run where the sweep was started, and write here whatever their folder
    check_positive("--jobs", jobs)
    check_process_count(spec.num_processes)
    if not fresh_processes and spec.num_processes > 1:
        raise UserError("Cells of several processes each need a launch of their own; run them in fresh processes.")
    if jobs > 1 and (spec.num_processes > 1 or not is_cpu_only()):
        raise UserError("--jobs above 1 runs one-process cells side by side on a CPU; on GPUs, or with "
                        "--num-processes, run one cell at a time.")
    if jobs > usable_cores():
        cores = usable_cores()
        raise UserError(f"--jobs {jobs} is more than this machine's {cores} cores; use --jobs {cores} or fewer.")
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {out} is a file; name a folder for the sweep.")
    check_outside_runs(out)
    _check_same_experiment(spec, out)
    if not spec.args.get("random_init"):
        from my_utils.core.models import check_available
        from my_utils.core.presets import get_preset

        check_available(get_preset(spec.preset).require("causal"))
    out.mkdir(parents=True, exist_ok=True)
    hold_folder(out, "The sweep folder")  # one sweep per folder at a time, for as long as this one runs
    try:
        return _run_cells(spec, out, jobs, steady_memory, fresh_processes)
    finally:
        release_folder(out)


def _run_cells(spec: SweepSpec, out: Path, jobs: int, steady_memory: bool, fresh_processes: bool) -> list[dict]:
    """``run_sweep``'s work once its checks passed and it holds the sweep folder."""
    from tqdm.auto import tqdm

    from my_utils.core.devices import usable_cores
    from my_utils.run.launch import clean_env
    from my_utils.run.results import redact_secrets

    cells = {cell_name(c): c for c in _saved_cells(out)} | {cell_name(c): c for c in spec.cells()}
    atomic_write_json(out / "sweep.json", redact_secrets({**asdict(spec), "cells": list(cells.values())}))

    todo = []
    for cell in spec.cells():
        folder = out / cell_name(cell)
        status = _status(folder)
        if status == "complete":
            print(f"{folder.name}: complete, skipped", flush=True)
            continue
        if status == "running":
            raise UserError(f"The cell {folder} is still being run by another process; let that sweep finish "
                            "before running this one.")
        if status is not None:
            moved = unique_dir(folder.with_name(f"{folder.name}.{status}"))
            folder.rename(moved)
            print(f"{folder.name}: the earlier run was {status}; kept as {moved.name}, running it again", flush=True)
        todo.append(cell)
    # The children's own progress bars would only fill their logs. Cells side by side share the cores.
    threads = {"OMP_NUM_THREADS": max(1, usable_cores() // jobs)} if jobs > 1 else {}
    env = clean_env(TQDM_DISABLE=1, **threads, **(STEADY_MEMORY_ENV if steady_memory else {}))
    todo_names = [cell_name(c) for c in todo]
    # a process per cell, or per job: a worker trains its share of the cells one after another
    batches = [[c] for c in todo] if fresh_processes else [todo[i::jobs] for i in range(jobs) if todo[i::jobs]]
    running, failed = {}, []
    bar = tqdm(total=len(todo), desc="sweep", unit="cell", file=sys.stdout)
    previous = _stop_on_sigterm()
    try:
        while batches or running:
            while batches and len(running) < jobs:
                batch = batches.pop(0)
                folders = [out / cell_name(c) for c in batch]
                log = out / f"{folders[0].name}{'' if fresh_processes else '.worker'}.log"
                cmd = (cell_command(spec, batch[0], folders[0]) if fresh_processes else
                       [sys.executable, "-m", "my_utils.tools.sweep_worker",
                        *(json.dumps([str(folder), cell_command(spec, c, folder)[3:]])
                          for c, folder in zip(batch, folders))])
                with open(log, "w", encoding="utf-8") as f:
                    proc = _start(cmd, env, f)
                running[proc] = (folders, log, time.perf_counter())
            time.sleep(0.1)
            for proc in [p for p in running if p.poll() is not None]:
                folders, log, started = running.pop(proc)
                for folder in folders:
                    cell_log = out / f"{folder.name}.log"  # a worker moves its cells' logs itself
                    if folder.is_dir() and cell_log.is_file():
                        cell_log.replace(folder / "output.log")
                    bar.update()
                    bar.write(_ended(folder, time.perf_counter() - started))
                    if _status(folder) != "complete" and (folder.is_dir() or proc.returncode != 2):
                        failed.append(folder.name)
                if proc.returncode == 2:
                    refused = next((f for f in (out / f"{folder.name}.log" for folder in folders) if f.is_file()), log)
                    said = [line for line in refused.read_text(encoding="utf-8").splitlines() if ": error: " in line]
                    reason = said[-1].split(": error: ", 1)[1] if said else f"see {refused}"
                    raise UserError(f"The cell {refused.stem} refused its settings, and the sweep stopped: {reason}")
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the cells still training stop too (and record it)
        for proc in running:
            proc.terminate()
            proc.wait()
        bar.close()
        stopped = ", ".join(folder.name for folders, _, _ in running.values() for folder in folders
                            if _status(folder) != "complete")
        raise KeyboardInterrupt(f"{str(e) or 'Ctrl-C'}; {len(running)} cell(s) stopped ({stopped or 'none running'}): run "
                                "the same command to go on where it stopped") from None
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
        bar.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if failed:
        named = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
        raise JobFailed(f"{len(failed)} of {len(todo_names)} cell(s) failed ({named}); each one's output is in its "
                        f"folder's output.log (or {out}/<cell>.log), and the sweep runs them again when run again.")
    return load_sweep(out)


def _stop_on_sigterm():
    """SIGTERM (a scheduler stopping the sweep) raised as KeyboardInterrupt, as Ctrl-C is, so that the running cells
    are stopped and recorded; returns the handler it replaced (None off the main thread, where it changes nothing)."""
    def handler(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:
        return None


def _start(cmd: list[str], env: dict, log):
    """A cell's process, in the folder the sweep was started from (relative paths in its settings mean what they
    meant there), the course importable from anywhere."""
    import os
    import subprocess

    from my_utils.run.results import REPO_ROOT, redact_secrets

    log.write("$ " + " ".join(redact_secrets(cmd)) + "\n")
    log.flush()
    path = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.Popen(cmd, env={**env, "PYTHONPATH": path}, stdout=log, stderr=subprocess.STDOUT)


def _ended(folder: Path, seconds: float) -> str:
    status = _status(folder) or "failed before its folder was made"
    line = f"{folder.name}: {status} after {seconds:.0f} s"
    if status == "complete":
        loss = read_json(folder / "summary.json").get("eval_loss")
        line += "" if loss is None else f", held-out loss {loss:.3f}"
    return line


# What a row says about its cell: the settings in effect (defaults resolved), from summary.json and run.json; the
# adapter's are every field of AdapterSpec.
ADAPTER_SETTINGS = tuple(f.name for f in fields(AdapterSpec) if f.metadata.get("flag") is not False)
SETTINGS = ("method", *ADAPTER_SETTINGS, "learning_rate", "steps", "seed")


def _settings(run: dict) -> dict:
    """A run's settings as it ran: its recorded config, then its summary (the resolved values win), each with
    the adapter's fields at the top level."""
    config, summary = run["run"]["config"], run["summary"]
    return {**config, **(config.get("adapter") or {}), **summary, **(summary.get("adapter") or {})}


def load_sweep(out: str | Path) -> list[dict]:
    """One row per complete cell of the sweep in ``out``, in the sweep's order: the cell, the settings it ran
    with and the figures a sweep compares."""
    out = Path(out)
    rows = []
    for cell in _saved_cells(out):
        folder = out / cell_name(cell)
        if _status(folder) != "complete":
            continue
        run = load_run(folder)
        s = run["summary"]
        settings = _settings(run)
        rows.append({
            "name": folder.name,
            "path": str(folder),
            "cell": cell,
            **{key: settings.get(key) for key in SETTINGS},
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
    from my_utils.core.stats import pooled_noise

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


def _label(row: dict, keys=("rank", "alpha", "rslora", "targets")) -> str:
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


def _varying(rows: list[dict], keys=SETTINGS) -> list[str]:
    """The settings that differ between the LoRA rows among ``rows``."""
    lora = [r for r in rows if r["method"] == "lora"]
    return [k for k in keys if len({json.dumps(r[k]) for r in lora}) > 1]


def _number(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def sweep_table(rows: list[dict]) -> str:
    """Every cell's figures, one line per cell (the folder's name says the cell)."""
    from my_utils.core.memory import format_bytes
    from my_utils.core.tables import text_table

    header = ["cell", "scale", "trainable", "adapter", "peak memory", "runtime", "held-out loss", "final train loss",
              "exact match"]
    table = [[r["name"], _number(update_scale(r), "{:.3g}"), f"{r['trainable_params']:,}",
              format_bytes(r["adapter_bytes"]), format_bytes(r["peak_memory_bytes"]), f"{r['runtime_s']:.1f} s",
              _number(r["eval_loss"], "{:.3f}"), _number(r["train_loss_final"], "{:.3f}"),
              _number(r["exact_match"], "{:.2f}")] for r in rows]
    if all(r["exact_match"] is None for r in rows):  # the generation evaluation was skipped
        header, table = header[:-1], [line[:-1] for line in table]
    return text_table(header, table)


def tradeoffs(rows: list[dict], noise=None) -> list[str]:
    """What a larger rank costs and buys, each sentence computed from ``rows`` (cells that differ only in rank; seeds
    merged by ``seed_means``). ``noise`` (``seed_noise``): the spread between seeds, which a smaller rank's held-out
    loss must stay within to count as good as the best; without it no rank is called as good as another."""
    from my_utils.core.memory import format_bytes

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
        if noise is not None:
            # the smallest rank whose difference from the best the noise cannot tell from zero
            def apart(r):
                return noise.difference(r["eval_loss"], best["eval_loss"], len(r.get("seeds", [0])),
                                        len(best.get("seeds", [0])))

            enough = min((r for r in scored if not apart(r).excludes(0)), key=lambda r: r["rank"])
            sentence += ("; every smaller rank ends measurably higher" if enough is best else
                         f"; rank {enough['rank']} ends within the noise between seeds of it ({apart(enough)}) with "
                         f"{enough['trainable_params'] / best['trainable_params']:.2f}x its trainable parameters")
        sentences.append(sentence + ".")
    return sentences


def plot_costs(rows: list[dict], out: str | Path) -> list[Path]:
    """Two figures in ``out`` for cells that differ only in rank: every rank's loss curve, and each measured figure
    against the rank (parameters and adapter size on log-log axes, the rest from zero, so that ratios read true)."""
    from my_utils.core.memory import MiB
    from my_utils.core.plots import new_figure, save

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
    from my_utils.core.tables import text_table

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
    from my_utils.core.plots import new_figure, save

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
    keys = [k for k in _varying([c[0] for c in curves]) if k != "learning_rate"] or ["rank"]
    return {_label(c[0], keys): c for c in curves}


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
    from my_utils.core.tables import text_table

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
    from my_utils.core.plots import new_figure, save

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
            f"{targets}: {r['eval_loss']:.3f} ({_label(r, ('rank', 'alpha', 'rslora', 'learning_rate'))})"
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


def parse_grid(items: list[str]) -> dict:
    """One ``--grid``: ``["rank=4,16", "targets=c_attn,c_attn+c_fc"]`` is
    ``{"rank": [4, 16], "targets": ["c_attn", ["c_attn", "c_fc"]]}``. Values split at commas, a value with ``+`` is a
    list, the rest read as JSON where they can be (numbers, true/false) and as text otherwise; ``SweepSpec`` then
    reads each as the workflow does."""
    grid = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise UserError(f"--grid takes OPTION=VALUE,VALUE...; got {item!r}.")
        grid[key.replace("-", "_")] = [v.split("+") if "+" in v else _literal(v) for v in values.split(",")]
    return grid


def _literal(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def read_spec(path: Path) -> dict:
    """The JSON object of a ``--spec`` file, its keys checked: one sentence for a file that is missing, not JSON,
    or not a sweep spec."""
    try:
        spec = json.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise UserError(f"Sweep spec {path} does not exist; check the path given to --spec.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"Sweep spec {path} cannot be read ({getattr(e, 'strerror', None) or e}); give a UTF-8 "
                        "JSON file to --spec.") from None
    except json.JSONDecodeError as e:
        raise UserError(f"Sweep spec {path} is not valid JSON (line {e.lineno}: {e.msg}); fix it.") from None
    keys = [f.name for f in fields(SweepSpec)]
    if not isinstance(spec, dict):
        raise UserError(f"Sweep spec {path} holds {type(spec).__name__}, not an object with {', '.join(keys)}.")
    unknown = [key for key in spec if key not in keys]
    if unknown:
        raise UserError(f"Sweep spec {path} has an unknown key {unknown[0]!r}; use {', '.join(keys)}.")
    for key, kind, example in (("preset", str, '"tiny"'), ("args", dict, '{"max_steps": 30}'),
                               ("grids", list, '[{"rank": [4, 16]}]'), ("num_processes", int, "2")):
        if key in spec and (not isinstance(spec[key], kind) or isinstance(spec[key], bool)):
            raise UserError(f"Sweep spec {path} gives {key} as {type(spec[key]).__name__} {json.dumps(spec[key])[:40]};"
                            f" it takes a {kind.__name__}, like {example}.")
    return spec


def parse_args(argv=None) -> tuple[SweepSpec, Path, int]:
    import argparse

    from my_utils.run.config import OneLineParser

    p = OneLineParser(prog="python -m my_utils sweep", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", type=Path, help="a JSON file with preset, grids, args (the options below override it)")
    p.add_argument("--preset", help="tiny (CPU, offline), gpt2, opt-350m (default: tiny)")
    p.add_argument("--grid", nargs="+", action="append", metavar="OPTION=V1,V2",
                   help="one grid of workflow options and their values (repeat --grid for several); default: "
                   "rank=1,4,16,64 alpha=32 on tiny, rank=8,128,256 alpha=16 otherwise")
    p.add_argument("--ranks", type=int, nargs="+", help="the grid rank=R1,R2,... (alpha: the workflow's 2 x rank)")
    p.add_argument("--output-dir", dest="out", type=Path,
                   help="the sweep folder (default: runs/sweeps/<preset>); reuse it to resume")
    p.add_argument("--jobs", type=int, default=1,
                   help="one-process cells trained side by side on a CPU (default 1: one at a time)")
    p.add_argument("--num-processes", type=int, help="processes per cell's run (accelerate launch when > 1)")
    shared = {"max-steps": (int, "optimizer steps per cell"), "batch-size": (int, "per process"),
              "eval-rows": (int, "held-out rows for the loss and exact match"), "max-length": (int, "tokens"),
              "learning-rate": (float, "the workflow's learning rate")}
    for name, (kind, text) in shared.items():
        p.add_argument(f"--{name}", type=kind, help=text)
    p.add_argument("--random-init", action="store_true", help="random weights (offline; no quality)")
    a = p.parse_args(argv)
    spec = read_spec(a.spec) if a.spec else {}
    preset = a.preset or spec.get("preset", "tiny")
    args = {**DEFAULT_ARGS.get(preset, {}), **spec.get("args", {})}
    args.update({k: v for k, v in vars(a).items() if k in {n.replace("-", "_") for n in shared} and v is not None})
    if a.random_init:
        args["random_init"] = True
    grids = [parse_grid(items) for items in a.grid or []] + ([{"rank": a.ranks}] if a.ranks else [])
    spec = SweepSpec(preset=preset, grids=grids or spec.get("grids", []), args=args,
                     num_processes=a.num_processes or spec.get("num_processes", 1))
    return spec, a.out or RUNS_ROOT / "sweeps" / preset, a.jobs


def main(argv=None) -> None:
    spec, out, jobs = parse_args(argv)
    run_sweep(spec, out, jobs)
    print("\n" + report(out))
    print(f"\nsweep folder: {out}")


if __name__ == "__main__":
    from my_utils.run.cli import run_main

    run_main(main, prefix="sweep")
