"""The main job: run the whole series on the tiny preset by executing every notebook into a new results
folder ``runs/run_<n>_<device>_x<count>/``, then print the comparison table.

    python -m my_utils demo                             # all notebooks
    python -m my_utils demo --only 00 04                # some of them
    python -m my_utils demo --preset gpt2 --processes 4 # on a machine with 4 GPUs

The folder holds each executed notebook (with its outputs) and every experiment's results folder. A lesson's
settings are in its cell tagged ``parameters`` (papermill's convention); ``--preset`` and ``--processes`` set
them the way ``papermill -p PRESET gpt2`` would, in a cell after it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from my_utils import UserError
from my_utils.core.devices import device_kind
from my_utils.core.paths import REPO_ROOT
from my_utils.core.presets import get_preset
from my_utils.run.config import OneLineParser, check_positive
from my_utils.run.launch import check_process_count, max_processes
from my_utils.run.results import Run, next_run_root
from my_utils.tools.cluster import stop_recorded
from my_utils.tools.compare import load_runs, overview

NOTEBOOKS = REPO_ROOT / "notebooks"
# Lessons that mostly wait (for a scheduler, a rendezvous timeout, a requeue), each run at the same time as a lesson
# whose claims hold no timings, so the two share the cores: 14 beside 07 saves about two minutes of the demo.
BESIDE = {"14_cluster.ipynb": "07_rank_sweep.ipynb"}


def notebooks(only=None) -> list[Path]:
    found = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if only:
        found = [nb for nb in found if nb.name[:2] in only]
        if not found:
            raise UserError(f"No notebook matches {' '.join(only)}; use two-digit numbers such as 00 04.")
    return found


def declared_parameters(nb) -> list[str]:
    """The names a notebook's cell tagged ``parameters`` assigns (none without such a cell)."""
    import ast

    cells = [c for c in nb.cells if c.cell_type == "code" and "parameters" in c.metadata.get("tags", [])]
    return [target.id for cell in cells for node in ast.parse(cell.source).body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)]


def inject_parameters(nb, values: dict) -> list[str]:
    """Set those of ``values`` that the notebook declares, as papermill does: a cell tagged
    ``injected-parameters`` right after its ``parameters`` cell. Returns the names set."""
    import nbformat

    names = [name for name in values if name in declared_parameters(nb)]
    if names:
        at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
        cell = nbformat.v4.new_code_cell("# Parameters set by the demo\n" + "\n".join(
            f"{name} = {values[name]!r}" for name in names))
        cell.metadata["tags"] = ["injected-parameters"]
        nb.cells.insert(at + 1, cell)
    return names


def execute_notebook(path: Path, out_path: Path, run_root: Path, timeout: int = 1200,
                     parameters: dict | None = None, then: list[str] = ()) -> float:
    """Execute one notebook with COURSE_RUN_ROOT set and ``parameters`` injected (``inject_parameters``), save it
    with its outputs; returns seconds taken. ``then``: code cells run after the last one, in the same kernel (the
    tests perturb a lesson's figures there and run its checks again). A failing cell raises, after the partly
    executed notebook is saved for inspection; a lesson that stops itself as skipped (LessonSkipped: what it needs
    cannot run here) raises LessonSkippedHere with its reason."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from traitlets.config import Config

    nb = nbformat.read(path, as_version=4)
    inject_parameters(nb, parameters or {})
    nb.cells += [nbformat.v4.new_code_cell(code) for code in then]
    # The kernel is a new process, given its own environment (two lessons may run at once, see BESIDE): the run
    # root, and this checkout importable there even without `pip install -e .`.
    env = {**os.environ, "COURSE_RUN_ROOT": str(run_root),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    try:
        # The kernel talks to this process over local sockets (IPC), not TCP ports open to the machine: nothing to
        # eavesdrop on, and the kernel has no reason to warn about it.
        with tempfile.TemporaryDirectory() as sockets:
            kernel = Config({"KernelManager": {"transport": "ipc", "ip": str(Path(sockets) / "kernel")}})
            try:
                NotebookClient(nb, timeout=timeout, kernel_name="python3", config=kernel,
                               resources={"metadata": {"path": str(NOTEBOOKS)}}).execute(env=env)
            except CellExecutionError as e:
                if e.ename == "LessonSkipped":
                    raise LessonSkippedHere(e.evalue) from None
                raise
    finally:
        nbformat.write(nb, out_path)
    return time.perf_counter() - started


class LessonSkippedHere(Exception):
    """A notebook stopped by ``my_utils.lessons.cluster.LessonSkipped`` (what it needs cannot run on this machine;
    matched by name, as the kernel reports it):
    ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def main(argv=None) -> Path:
    from tqdm import tqdm

    p = OneLineParser(prog="python -m my_utils demo", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", help="two-digit numbers of the notebooks to run (default: all)")
    p.add_argument("--preset", default="tiny",
                   help="the model of every lesson that declares PRESET (default: tiny; real presets want GPUs)")
    p.add_argument("--processes", type=int,
                   help="processes of every lesson that declares PROCESSES (default: each lesson's own, 2 where the "
                        "machine has them; at most the GPUs, or the CPU cores without GPUs)")
    args = p.parse_args(argv)
    get_preset(args.preset)
    parameters = {"PRESET": args.preset}
    if args.processes is not None:
        check_positive("--processes", args.processes)
        check_process_count(args.processes, option="--processes")
        parameters["PROCESSES"] = args.processes

    selected = notebooks(args.only)
    root = next_run_root(device_kind(), parameters.get("PROCESSES", min(2, max_processes())))
    root.mkdir(parents=True)
    record = Run.create(root / "demo", config={"notebooks": [nb.name for nb in selected], **parameters})
    print(f"Running {len(selected)} notebook(s) on the {args.preset} preset into {root.relative_to(REPO_ROOT)}/",
          flush=True)
    import nbformat

    timings, taken, skipped = {}, {}, {}
    for nb in selected:  # what each lesson takes of the settings asked for; one line for what it leaves
        taken[nb.name] = [name for name in parameters if name in declared_parameters(nbformat.read(nb, as_version=4))]
        left = [f"{name}={parameters[name]}" for name in parameters if name not in taken[nb.name]
                and (name != "PRESET" or args.preset != "tiny")]
        if left:
            print(f"note: {nb.stem} declares no {', '.join(n.split('=')[0] for n in left)}: it runs as written, "
                  f"without {', '.join(left)}", flush=True)
    record.update(parameters_taken=taken)
    started = time.perf_counter()
    beside = {partner: waiting for waiting, partner in BESIDE.items()
              if any(nb.name == partner for nb in selected) and any(nb.name == waiting for nb in selected)}

    def run(nb):
        started_nb = time.perf_counter()
        try:
            timings[nb.name] = execute_notebook(nb, root / nb.name, root, parameters=parameters)
        except LessonSkippedHere as e:
            timings[nb.name], skipped[nb.stem] = time.perf_counter() - started_nb, e.reason
            bar.write(f"{nb.stem} skipped: {e.reason}")

    try:
        with ThreadPoolExecutor(max_workers=1) as background:  # on a failure, waits for the lesson beside to end
            for nb in (bar := tqdm(selected, unit="notebook", file=sys.stdout)):
                if nb.name in beside.values():
                    continue  # started beside its partner, below
                waiting = next((w for w in selected if w.name == beside.get(nb.name)), None)
                bar.set_description(nb.stem + (f" beside {waiting.stem}" if waiting else ""))
                running = background.submit(run, waiting) if waiting else None
                run(nb)
                if running:
                    nb = waiting  # named if it fails
                    running.result()
    except BaseException as e:
        record.fail(f"{type(e).__name__} in {nb.name}: {str(e)[-500:]}")
        print(f"\n{nb.name} failed; the partly executed notebook is in {root / nb.name}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        stop_recorded(root)  # a lesson that failed midway may have left its cluster running
    wall = time.perf_counter() - started
    record.finish({"notebook_seconds": timings, "wall_seconds": wall,
                   "skipped": skipped})
    if load_runs(root)[0]:  # a lesson without runs of its own (00) has no table to show
        print("\n" + overview(root, root=root))
    for lesson, reason in skipped.items():
        print(f"skipped: {lesson}: {reason}")
    print(f"\nDone: {len(selected)} notebook(s) in {wall:.0f} s. Results: {root.relative_to(REPO_ROOT)}/")
    return root
