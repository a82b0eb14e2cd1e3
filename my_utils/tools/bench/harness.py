"""The harness every benchmark shares: the settings, measured runs in fresh processes (alternated and logged), ratios
of medians as table rows, one results folder per benchmark, and finding the benchmarks.

A benchmark is a module of this package that declares (``overhead.py`` is an example to copy):

    NAME = "overhead"             # its name on the command line and its results folder's
    HELP = "..."                  # its line in ``python -m my_utils bench --help``: what against what, the target
    TARGETS = {"overhead": 0.98}  # the targets its rows are checked against
    ORDER = 10                    # its place in a run of every benchmark and in the tables
    REPEATS = 3                   # (optional) runs of each configuration by default
    WORKERS = {"run-x": x_main}   # (optional) commands it runs in fresh processes: python -m my_utils bench run-x
    def run(s: Settings, folder: Path) -> tuple[dict, list[dict]]: ...   # its figures and its ratio rows

Nothing else names it: adding a benchmark is adding its file. A module without NAME may still offer WORKERS to
several benchmarks (``course.py``, ``loop.py``).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import asdict, dataclass
from functools import cache
from importlib import import_module
from pathlib import Path
from statistics import median

from my_utils.core.devices import device_inventory
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.presets import get_preset
from my_utils.core.tables import text_table
from my_utils.run.launch import check_process_count, clean_env, run_logged
from my_utils.run.lifecycle import recorded
from my_utils.run.locks import current_status
from my_utils.run.results import Run, check_new_run_dir, read_json
from my_utils.tools.sweep import STEADY_MEMORY_ENV

BENCH_ROOT = RUNS_ROOT / "bench"
WARMUP_STEPS = 2  # steps before the steady-state window (first-step allocations, caches)
DECLARED = ("NAME", "HELP", "TARGETS", "ORDER", "run")


# ---------------------------------------------------------------------------------------------------------------
# Finding the benchmarks


def _modules() -> list:
    """Every module of this package, imported (each is light: heavy imports live inside functions)."""
    import pkgutil

    return [import_module(f"{__package__}.{m.name}") for m in pkgutil.iter_modules([str(Path(__file__).parent)])]


@cache
def benchmarks() -> dict:
    """The benchmark modules (those that declare NAME) by name, in their ORDER."""
    found = {}
    for module in sorted((m for m in _modules() if hasattr(m, "NAME")), key=lambda m: getattr(m, "ORDER", 0)):
        missing = [a for a in DECLARED if not hasattr(module, a)]
        if missing:
            raise RuntimeError(f"Benchmark module {module.__name__} declares NAME but not {', '.join(missing)}.")
        if module.NAME in found:
            raise RuntimeError(f"Two benchmark modules are named {module.NAME!r}: {found[module.NAME].__name__} "
                               f"and {module.__name__}.")
        found[module.NAME] = module
    return found


@cache
def workers() -> dict:
    """The commands behind the measured runs (``python -m my_utils bench run-...``), from every module."""
    return {name: main for m in _modules() for name, main in getattr(m, "WORKERS", {}).items()}


# ---------------------------------------------------------------------------------------------------------------
# Settings


@dataclass
class Settings:
    preset: str = "tiny"  # the model and data of every training benchmark
    random_init: bool = False
    data_file: str | None = None
    memory_preset: str = "gpt2"  # the architecture of the memory benchmark (random weights)
    qlora_preset: str = "opt-350m"  # the architecture of the 4-bit weights measurement
    batch_size: int | None = None  # per process; default: the preset's
    steps: int = 40  # optimizer steps per training run
    repeats: int | None = None  # runs of each configuration; default per benchmark (its REPEATS)
    threads: int = 1  # intra-op threads per process on a CPU
    memory_batch_size: int = 4
    memory_max_length: int = 256
    bf16: bool = False  # bf16 mixed precision (by default where it trains faster than fp32: fast_bf16)
    quick: bool = False
    output_root: str = str(BENCH_ROOT)

    def repeats_for(self, name: str) -> int:
        return self.repeats or (1 if self.quick else benchmarks()[name].REPEATS)

    def batch(self) -> int:
        """Examples per process: --local-batch-size, else the preset's."""
        return self.batch_size or get_preset(self.preset).batch_size

    def preset_args(self) -> list[str]:
        """The model and data options every training command shares."""
        return ["--preset", self.preset, *(["--random-init"] if self.random_init else []),
                *(["--data-file", self.data_file] if self.data_file else [])]


def quick_settings(s: Settings) -> Settings:
    """A smoke run: few steps, one repeat, the tiny model everywhere."""
    return Settings(**{**asdict(s), "steps": min(s.steps, 2 * WARMUP_STEPS + 2), "memory_preset": "tiny",
                       "qlora_preset": "tiny", "memory_max_length": min(s.memory_max_length, 64)})


def logging_steps(steps: int) -> int:
    return max(1, steps // 8)


# ---------------------------------------------------------------------------------------------------------------
# Measured runs, each in a fresh process


def bench_env(s: Settings, threads: int | None = None) -> dict:
    """The environment of every measured process: offline as configured, ``threads`` intra-op threads, one
    precision for every run (the LoRA workflow and the bare loop both read ACCELERATE_MIXED_PRECISION)."""
    threads = threads or s.threads
    return clean_env(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false",
                     ACCELERATE_MIXED_PRECISION="bf16" if s.bf16 else "no", **STEADY_MEMORY_ENV)


def python_command(*args) -> list[str]:
    """A worker's command line: ``python -m my_utils bench run-... args``."""
    return [sys.executable, "-m", "my_utils", "bench", *map(str, args)]


def alternate(variants: dict, repeats: int, folder: Path, env: dict, desc: str, settled=None,
              max_repeats: int | None = None) -> dict[str, list[Path]]:
    """Run every variant ``repeats`` times, alternating (A B, then B A, ...), each in a fresh process; then, if
    ``settled(done)`` is given, more repeats until it returns True or ``max_repeats`` are done.

    ``variants`` maps a name to ``command(out_dir) -> list[str]``; run i of a variant writes ``folder/<name>_<i>``
    and logs to ``folder/<name>_<i>.log``. Returns each variant's results folders, in order.
    """
    from tqdm.auto import tqdm

    done = {name: [] for name in variants}
    names = list(variants)
    repeat = 0
    with tqdm(total=repeats * len(names), desc=desc, unit="run", file=sys.stdout) as bar:
        while repeat < repeats or (settled and repeat < (max_repeats or repeats) and not settled(done)):
            repeat += 1
            if repeat > repeats:
                bar.total = repeat * len(names)
            for name in names if repeat % 2 else reversed(names):
                bar.set_postfix_str(f"{name} {repeat}")
                out = folder / f"{name}_{repeat}"
                run_logged(variants[name](out), folder / f"{name}_{repeat}.log", env)
                done[name].append(out)
                bar.update()
    return done


def process_scaling(folder: Path, workflows: dict, repeats: int, env: dict, desc: str, settled=None,
                    max_repeats: int | None = None) -> dict:
    """Alternate 1-process and 2-process runs of each workflow: ``workflows`` maps a name to ``(command, figures)``,
    where ``command(processes, out)`` builds a run's command line and ``figures(out)`` reads from its results folder
    the ``world_size`` its workers saw, its ``rate`` (samples/s, tokens/s...) and ``cpu_rate`` (the same per
    CPU-second of its busiest process). Every run of every workflow alternates with the others, so that a change
    of load hits them all; ``settled(scaling)``, given, adds repeats (up to ``max_repeats``) until it returns True.
    Returns, per workflow, both configurations' figures and ``scaling_ratios`` of their runs (2 processes over 1).
    Run i of workflow w on n processes writes ``folder/w_xn_i``."""
    check_process_count(2)
    variants = {f"{name}_x{n}": (lambda out, c=command, n=n: c(n, out))
                for name, (command, _) in workflows.items() for n in (1, 2)}

    def scaling_of(runs):
        scaling = {}
        for name, (_, figures) in workflows.items():
            found = {n: [figures(p) for p in runs[f"{name}_x{n}"]] for n in (1, 2)}
            for n, results in found.items():
                if any(r["world_size"] != n for r in results):
                    raise RuntimeError(f"A run launched with {n} process(es) saw another world size; see its "
                                       "run.json.")
            scaling[name] = {"x1": found[1], "x2": found[2], **scaling_ratios(found[2], found[1])}
        return scaling

    runs = alternate(variants, repeats, folder, env, desc, settled=settled and (lambda done: settled(scaling_of(done))),
                     max_repeats=max_repeats)
    return scaling_of(runs)


def scaling_ratios(measured: list[dict], baseline: list[dict], rate: str = "rate", cpu_rate: str = "cpu_rate") -> dict:
    """The speed-up of ``measured`` runs over ``baseline`` runs taken side by side: ``ratio``, the median of the
    pairs' ratios (``paired_ratio``), its ``standard_error`` and the ``ratios``; ``cpu_time_ratio``, the same from
    CPU time."""
    wall = paired_ratio(measured, baseline, rate)
    return {"ratio": wall["median"], "standard_error": wall["standard_error"], "ratios": wall["ratios"],
            "cpu_time_ratio": paired_ratio(measured, baseline, cpu_rate)["median"]}


def recorded_run(output_dir: str, config: dict, body, main: bool = True) -> None:
    """A worker's results folder: create it, run ``body`` and write its figures as summary.json (failed or
    interrupted else). With several processes, each runs ``body`` and only the ``main`` one records."""
    run = Run.create(check_new_run_dir(output_dir), config=config) if main else None
    with recorded(run):
        figures = body()
        if run is not None:
            run.finish(figures)


# ---------------------------------------------------------------------------------------------------------------
# Ratios and the table


def throughput_ratio(measured: list[dict], baseline: list[dict], rate: str = "tokens_per_s",
                     cpu_rate: str = "cpu_tokens_per_s") -> tuple[float, float]:
    """(wall-clock, CPU-time) ratio of the median rates (useful tokens/s by default) of two lists of runs."""
    wall = median(r[rate] for r in measured) / median(r[rate] for r in baseline)
    cpu = median(r[cpu_rate] for r in measured) / median(r[cpu_rate] for r in baseline)
    return wall, cpu


def paired_ratio(measured: list[dict], baseline: list[dict], rate: str = "tokens_per_s") -> dict:
    """The ratio of each pair of runs taken side by side (run i of each configuration: a change of load hits both),
    their median, and the median's standard error (from their median absolute deviation, robust to one disturbed
    pair)."""
    ratios = [m[rate] / b[rate] for m, b in zip(measured, baseline)]
    middle = median(ratios)
    deviation = median(abs(r - middle) for r in ratios)
    # 1.4826 x MAD estimates a normal spread's standard deviation; the median's standard error is 1.2533 x that / sqrt(n)
    return {"ratios": ratios, "median": middle, "standard_error": 1.2533 * 1.4826 * deviation / len(ratios) ** 0.5}


def pairs_detail(ratios: list, standard_error: float) -> str:
    """How a paired figure was made, for a row's detail."""
    return f"median of {len(ratios)} pairs, standard error {standard_error:.3f}"


def ratio_row(benchmark: str, figure: str, measured: str, baseline: str, ratio: float, *, target: float | None = None,
              at_most: bool = False, cpu_ratio: float | None = None, detail: str = "", if_missed: str = "") -> dict:
    """One line of the results table: ``measured`` / ``baseline`` of ``figure``, and whether it meets the target;
    ``if_missed``: why the target can be missed where it is (said beside a MISSED, in words a reader gets at once)."""
    met = None if target is None else (ratio <= target if at_most else ratio >= target)
    return {"benchmark": benchmark, "figure": figure, "measured": measured, "baseline": baseline, "ratio": ratio,
            "cpu_time_ratio": cpu_ratio, "target": None if target is None else f"{'<=' if at_most else '>='} {target}",
            "met": met, "detail": detail, "if_missed": if_missed}


def verdict(row: dict) -> str:
    """The target and whether the ratio met it, in words: "met: at most 0.5", "MISSED: above 0.5 (why)"."""
    if row["target"] is None:
        return "-"
    at_most = row["target"].startswith("<=")
    bound = row["target"].split()[-1]
    if row["met"]:
        return f"met: {'at most' if at_most else 'at least'} {bound}"
    why = row.get("if_missed")
    return f"MISSED: {'above' if at_most else 'below'} {bound}" + (f" ({why})" if why else "")


def render_table(rows: list[dict], markdown: bool = False) -> str:
    """The ratio rows for a page (markdown: a list, an item per row wrapped within 118 characters, the figures in bold
    first), or for a terminal as a table of the figures, each row's what-against-what on an indented line below it."""
    import textwrap

    def cells(r):
        return [r["benchmark"], f"{r['ratio']:.3f}", "-" if r["cpu_time_ratio"] is None else f"{r['cpu_time_ratio']:.3f}",
                verdict(r)]

    def what(r):
        return f"{r['measured']} against {r['baseline']}: {r['figure']}" + (f" ({r['detail']})" if r["detail"] else "")

    header = ["benchmark", "ratio", "CPU-time est.", "target"]
    if markdown:
        items = []
        for r in rows:
            cpu = "" if r["cpu_time_ratio"] is None else f" (CPU-time estimate {r['cpu_time_ratio']:.3f})"
            target = "" if r["target"] is None else f", target {verdict(r)}"
            items += textwrap.wrap(f"**{r['benchmark']} {r['ratio']:.3f}**{cpu}{target}: {what(r)}", 118,
                                   initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False)
        return "\n".join(items)
    lines = text_table(header, [cells(r) for r in rows]).splitlines()
    out = lines[:2]
    for line, r in zip(lines[2:], rows):
        out += [line, *textwrap.wrap(what(r), 156, initial_indent="    ", subsequent_indent="      ")]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------------
# One benchmark, one results folder


def abandoned(folder: Path, name: str) -> str | None:
    """The status of ``folder`` if it is benchmark ``name``'s results folder left unfinished by a bench that was
    stopped (``crashed``: killed; ``interrupted``: Ctrl-C, SIGTERM) and that no process writes any more (a killed
    bench's measured runs may outlive it); else None."""
    try:
        info = read_json(folder / "run.json")
        inside = [(p.parent, read_json(p)) for p in folder.rglob("run.json") if p.parent != folder]
    except (OSError, ValueError):
        return None
    status = current_status(info, folder)
    if info.get("benchmark") != name or status not in ("crashed", "interrupted"):
        return None
    return None if any(current_status(run, path) == "running" for path, run in inside) else status


def benchmark_folder(root: Path, name: str) -> Path:
    """The folder for a new run of benchmark ``name``: ``root/name``, else ``name_2``, ``name_3``... as for every
    results folder, except that one a stopped bench left unfinished is replaced (with a note) rather than kept
    beside it."""
    candidate, n = root / name, 1
    while candidate.exists():
        status = abandoned(candidate, name)
        if status:
            print(f"note: replacing {candidate}, left unfinished by a bench that was stopped ({status})", flush=True)
            shutil.rmtree(candidate)
            break
        n += 1
        candidate = root / f"{name}_{n}"
    return candidate


def run_benchmark(name: str, s: Settings, argv: list[str]) -> tuple[Path, list[dict]]:
    """Run one benchmark into a new results folder; returns the folder and its ratio rows."""
    folder = benchmark_folder(Path(s.output_root), name)
    record = Run.create(folder, config=asdict(s), command=["python", "-m", "my_utils", "bench", *argv],
                        benchmark=name, load_average_before=os.getloadavg(), devices=device_inventory(),
                        holds_runs=True)  # its measurements are results folders of their own, inside it
    with recorded(record):
        result, rows = benchmarks()[name].run(s, folder)
        if {"benchmark", "ratios"} & result.keys():  # they would replace the table's rows in summary.json
            raise RuntimeError(f"Benchmark {name!r} returned figures named 'benchmark' or 'ratios'; nest them.")
        record.update(load_average_after=os.getloadavg())
        record.finish({"benchmark": name, "ratios": rows, **result})
    return folder, rows

