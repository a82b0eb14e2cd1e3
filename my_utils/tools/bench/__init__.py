"""Benchmarks: the course's defaults against the usual alternatives, each figure a ratio to a baseline measured in
the same run (absolute times on a shared machine drift; a ratio of runs taken side by side drifts much less).

    python -m my_utils bench                   # every benchmark: about 10 minutes on 2 idle CPU cores (qlora's
                                               # full fine-tuning step of opt-350m needs about 7 GB of RAM)
    python -m my_utils bench overhead trainer  # some of them
    python -m my_utils bench --quick           # a smoke run: a few steps, one repeat, the tiny model everywhere;
                                               # still 6 to 7 minutes on 2 CPU cores (dozens of fresh processes)
    python -m my_utils bench --preset gpt2 --random-init   # a GPU: bf16 where native (the training benchmarks
                                               # read the preset's tokenizer and data: online, or cached)

Each benchmark writes ``runs/bench/<name>[_n]/`` (run.json; summary.json with every measurement and the ratios;
one folder and one log per measured run) and the command prints a table of ratios, each named with its baseline.

How runs are measured: every run is a fresh process (no allocator cache, thread pool or peak counter carries
over); configurations alternate (A B, then B A) ``--repeats`` times so that a change of load hits both; a ratio is
of medians. On a CPU each process uses ``--threads`` intra-op threads (1 by default). Beside each wall-clock ratio
the table shows the same ratio computed from CPU seconds (of the busiest process, for several processes): what
the ratio would be if every process had its cores to itself, an estimate that neighbours disturb less.

Each benchmark is one module of this package, my_utils/tools/bench/<name>.py, whose docstring gives the details;
the harness (harness.py) finds them, so that a new benchmark is a new file. The measured runs are commands of the
same command line, each usable alone and each writing a results folder (``python -m my_utils bench run-... -h``).
"""

from __future__ import annotations

import argparse
import sys
import time
import textwrap
from dataclasses import fields
from pathlib import Path

from my_utils import UserError
from my_utils.core.data import INSTRUCTION_COLUMNS, read_jsonl
from my_utils.core.devices import fast_bf16, usable_cores
from my_utils.core.presets import get_preset
from my_utils.run.config import OneLineParser, check_positive
from my_utils.run.results import check_outside_runs
from my_utils.tools.bench.flops import model_flops_per_token
from my_utils.tools.bench.harness import (BENCH_ROOT, WARMUP_STEPS, Settings, benchmarks, process_scaling,
                                          quick_settings, ratio_row, render_table, run_benchmark, workers)

__all__ = ["BENCHMARKS", "REPEATS", "Settings", "main", "model_flops_per_token", "parse_args", "process_scaling",
           "ratio_row", "render_table"]

BENCHMARKS = tuple(benchmarks())  # in their ORDER: a run of every benchmark, and the tables
REPEATS = {name: m.REPEATS for name, m in benchmarks().items() if hasattr(m, "REPEATS")}


def listing() -> str:
    """The benchmarks and the measured runs' commands, a line each, for ``--help``."""

    def lines(title, entries):
        width = max(len(name) for name, _ in entries)
        return [title] + [textwrap.fill(text, 118, initial_indent=f"  {name:<{width}}  ",
                                        subsequent_indent=" " * (width + 4), break_on_hyphens=False) for name, text in entries]

    def summary(doc):  # a docstring's first sentence, without its "``run-x``: " prefix
        return " ".join(doc.split()).split(": ", 1)[-1].split(". ")[0].rstrip(".")

    return "\n".join([*lines("benchmarks:", [(name, m.HELP) for name, m in benchmarks().items()]), "",
                      *lines("measured runs:", [(name, summary(w.__doc__)) for name, w in workers().items()])])


def parse_args(argv=None) -> tuple[list[str], Settings]:
    args = _parser().parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        raise UserError(f"Unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHMARKS)}.")
    for name in ("steps", "threads", "memory_batch_size", "memory_max_length", "repeats", "batch_size"):
        if getattr(args, name) is not None:
            check_positive(f"--{name.replace('_', '-')}", getattr(args, name))

    if args.threads > usable_cores():
        raise UserError(f"--threads {args.threads} is more than this machine's {usable_cores()} cores; use "
                        f"--threads {usable_cores()} or fewer.")
    if args.data_file is not None:  # before any measured run starts
        read_jsonl(args.data_file, INSTRUCTION_COLUMNS)
    if args.steps <= 2 * WARMUP_STEPS:
        raise UserError(f"--steps {args.steps} leaves too few steps after the {WARMUP_STEPS} warm-up steps; "
                        f"use --steps {2 * WARMUP_STEPS + 1} or more.")
    bf16 = fast_bf16() if args.precision == "auto" else args.precision == "bf16"
    for name in (args.preset, args.memory_preset, args.qlora_preset):
        get_preset(name).require("causal")
    if not args.output_root.strip() or Path(args.output_root).is_file():
        raise UserError(f"--output-root {args.output_root!r} is not a folder; name the folder for the results.")
    check_outside_runs(args.output_root)
    settings = Settings(**{f.name: getattr(args, f.name) for f in fields(Settings) if hasattr(args, f.name)}, bf16=bf16)
    return list(dict.fromkeys(args.names or BENCHMARKS)), (quick_settings(settings) if args.quick else settings)


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m my_utils bench", description=__doc__, epilog=listing(),
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default all): {', '.join(BENCHMARKS)}")
    defaults = Settings()
    p.add_argument("--quick", action="store_true", help="a smoke run: few steps, one repeat, the tiny model (6 to 7 minutes on 2 CPU cores: each "
                   "measured run is a fresh process, and their start-up is most of the time)")
    p.add_argument("--preset", default=defaults.preset,
                   help="model and data of the training benchmarks (memory and qlora build --memory-preset and "
                   "--qlora-preset)")
    p.add_argument("--random-init", action="store_true", help="random weights from the preset's shipped config")
    p.add_argument("--data-file", default=None, help="JSON-lines instruction data instead of the preset's")
    p.add_argument("--memory-preset", default=defaults.memory_preset, help="architecture of the memory benchmark")
    p.add_argument("--qlora-preset", default=defaults.qlora_preset, help="architecture of the 4-bit measurement")
    p.add_argument("--local-batch-size", dest="batch_size", type=int, default=None, help="per process (default: the preset's)")
    p.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps per training run")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"runs of each configuration (default {', '.join(f'{k} {v}' for k, v in REPEATS.items())})")
    p.add_argument("--threads", type=int, default=defaults.threads, help="intra-op threads per process on a CPU")
    p.add_argument("--memory-batch-size", type=int, default=defaults.memory_batch_size,
                   help="batch of the memory benchmark's measured step")
    p.add_argument("--memory-max-length", type=int, default=defaults.memory_max_length,
                   help="tokens per example of the memory benchmark's measured step")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="auto: bf16 mixed precision where it trains faster than fp32 (the LoRA workflow's default: "
                   "GPUs with bf16, CPUs with AMX), else fp32; bf16 measures it anyway")
    p.add_argument("--output-root", default=str(BENCH_ROOT), help="where the results folders go")
    return p


def main(argv=None) -> list[dict] | None:
    """``python -m my_utils bench [NAME ...] [options]``, or a measured run: ``python -m my_utils bench run-...``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in workers():
        return workers()[argv[0]](argv[1:])
    names, settings = parse_args(argv)
    rows, folders = [], []
    started = time.perf_counter()
    for i, name in enumerate(names, start=1):
        print(f"[{i}/{len(names)}] {name} ({time.perf_counter() - started:.0f} s elapsed)", flush=True)
        folder, found = run_benchmark(name, settings, argv)
        rows += found
        folders.append(folder)
        print(f"[{i}/{len(names)}] {name} done: {folder}", flush=True)
    print(f"\n{len(names)} benchmark(s) in {time.perf_counter() - started:.0f} s")
    print("\n" + render_table(rows))
    if "--quick" in argv and any(r["met"] is False for r in rows):
        print("\nMISSED under --quick says nothing: a smoke run of a few steps on the tiny model measures mostly "
              "start-up; the targets are for the full run.")
    print("\nresults folders:\n" + "\n".join(f"  {f}" for f in folders))
    return rows
