"""Running a sweep's cells: fresh processes or worker processes, side by side, skipping the complete ones."""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from my_utils import JobFailed, UserError
from my_utils.core.devices import usable_cores
from my_utils.core.models import check_available
from my_utils.core.paths import REPO_ROOT
from my_utils.core.presets import get_preset
from my_utils.core.progress import Progress
from my_utils.run.config import check_positive
from my_utils.run.divergence import diverged
from my_utils.run.launch import check_process_count, clean_env, is_cpu_only
from my_utils.run.locks import hold_folder, release_folder
from my_utils.run.redaction import hash_secrets, redact_secrets
from my_utils.run.results import atomic_write_json, check_outside_runs, read_json, unique_dir
from my_utils.tools.sweep.results import cell_status, load_sweep, saved_cells
from my_utils.tools.sweep.spec import SweepSpec, cell_command, cell_name


# Environment for a process whose peak resident memory is compared with another's. glibc raises its mmap
# threshold each time a large block is freed, so later large blocks come from a heap that keeps freed memory:
# the peak then depends on the order of frees and moves by 20 MiB between identical runs. A fixed threshold
# returns every large block to the system when freed (identical runs then agree within 1 MiB).
STEADY_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _check_same_experiment(spec: SweepSpec, out: Path) -> None:
    """A sweep folder holds one experiment: the same preset, shared args and process count for every cell."""
    saved_file = out / "sweep.json"
    if not saved_file.is_file():
        return
    saved = read_json(saved_file)
    mine = hash_secrets(asdict(spec))  # as sweep.json records it
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
    fails or diverges does not stop the others (JobFailed at the end names them), unless it refused its input (exit
    code 2): the others would refuse it too, so the sweep stops with that cell's sentence. A model that is neither cached
    nor downloadable stops it before any cell starts."""
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
        check_available(get_preset(spec.preset).require("causal"))
    out.mkdir(parents=True, exist_ok=True)
    hold_folder(out, "The sweep folder")  # one sweep per folder at a time, for as long as this one runs
    try:
        return _run_cells(spec, out, jobs, steady_memory, fresh_processes)
    finally:
        release_folder(out)


def _run_cells(spec: SweepSpec, out: Path, jobs: int, steady_memory: bool, fresh_processes: bool) -> list[dict]:
    """``run_sweep``'s work once its checks passed and it holds the sweep folder."""
    cells = {cell_name(c): c for c in saved_cells(out)} | {cell_name(c): c for c in spec.cells()}
    atomic_write_json(out / "sweep.json", hash_secrets({**asdict(spec), "cells": list(cells.values())}))

    todo, skipped = [], 0
    for cell in spec.cells():
        folder = out / cell_name(cell)
        status = cell_status(folder)
        if status == "complete":
            skipped += 1
            continue
        if status == "running":
            raise UserError(f"The cell {folder} is still being run by another process; let that sweep finish "
                            "before running this one.")
        if status is not None:
            moved = unique_dir(folder.with_name(f"{folder.name}.{status}"))
            folder.rename(moved)
            print(f"{folder.name}: the earlier run was {status}; kept as {moved.name}, running it again", flush=True)
        todo.append(cell)
    if skipped:  # one line, with a count: the folders name the cells
        print(f"{skipped} of {len(spec.cells())} cells already complete in {out.name}, skipped; {len(todo)} to run",
              flush=True)
    # The children's own progress bars would only fill their logs. Cells side by side share the cores.
    threads = {"OMP_NUM_THREADS": max(1, usable_cores() // jobs)} if jobs > 1 else {}
    env = clean_env(TQDM_DISABLE=1, **threads, **(STEADY_MEMORY_ENV if steady_memory else {}))
    todo_names = [cell_name(c) for c in todo]
    # a process per cell, or per job: a worker trains its share of the cells one after another
    batches = [[c] for c in todo] if fresh_processes else [todo[i::jobs] for i in range(jobs) if todo[i::jobs]]
    running, failed = {}, []
    bar = Progress(len(todo), "sweep", unit="cells")
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
                    if cell_status(folder) != "complete" and (folder.is_dir() or proc.returncode != 2):
                        failed.append(folder.name)
                if proc.returncode == 2 and not all(diverged(folder) for folder in folders):
                    refused = next((f for f in (out / f"{folder.name}.log" for folder in folders) if f.is_file()), log)
                    said = [line for line in refused.read_text(encoding="utf-8").splitlines() if ": error: " in line]
                    reason = said[-1].split(": error: ", 1)[1] if said else f"see {refused}"
                    raise UserError(f"The cell {refused.stem} refused its settings, and the sweep stopped: {reason}")
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the cells still training stop too (and record it)
        for proc in running:
            proc.terminate()
            proc.wait()
        stopped = ", ".join(folder.name for folders, _, _ in running.values() for folder in folders
                            if cell_status(folder) != "complete")
        raise KeyboardInterrupt(f"{str(e) or 'Ctrl-C'}; {len(running)} cell(s) stopped ({stopped or 'none running'}): run "
                                "the same command to go on where it stopped") from None
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
        bar.close(failed=bool(failed) or sys.exc_info()[0] is not None)
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

    log.write("$ " + " ".join(redact_secrets(cmd)) + "\n")
    log.flush()
    path = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.Popen(cmd, env={**env, "PYTHONPATH": path}, stdout=log, stderr=subprocess.STDOUT)


def _ended(folder: Path, seconds: float) -> str:
    status = cell_status(folder) or "failed before its folder was made"
    line = f"{folder.name}: {status} after {seconds:.0f} s"
    if status == "failed" and diverged(folder):  # the sentence that says at which step and what to lower
        line += f" ({read_json(folder / 'run.json')['error'].split(': ', 1)[1]})"
    if status == "complete":
        loss = read_json(folder / "summary.json").get("eval_loss")
        line += "" if loss is None else f", held-out loss {loss:.3f}"
    return line


# What a row says about its cell: the settings in effect (defaults resolved), from summary.json and run.json; the
