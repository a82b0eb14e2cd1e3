"""``python -m my_utils <command>``: demo, compare, plan, env, sweep, bench, gpucheck, cluster. ``--help`` lists
them; ``<command> --help`` explains one.

    python -m my_utils compare runs/run_1_cpu_x2 --output-dir comparison/
    python -m my_utils plan --preset opt-350m --method qlora --device T4
"""

from __future__ import annotations

import argparse
import sys

from my_utils.run.cli import run_main
from my_utils.run.config import OneLineParser


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {
        "demo": ("run every notebook on the tiny preset into a new results folder", "my_utils.tools.demo"),
        "compare": ("tables and plots from results folders", "my_utils.tools.compare"),
        "plan": ("predict a training run's peak memory per device, and whether it fits", "my_utils.tools.planner"),
        "env": ("devices, versions and the accelerate config in use", "my_utils.tools.env"),
        "sweep": ("a grid of LoRA runs (rank, alpha, learning rate, targets...), one fresh process per cell; finished "
                  "cells are skipped", "my_utils.lessons.rank_sweep"),
        "bench": ("benchmarks of the course's defaults against the usual alternatives, as ratios", "my_utils.tools.bench"),
        "gpucheck": ("the course on one CUDA GPU in one command (tests, series, QLoRA, planner, MFU), into one results "
                     "folder", "my_utils.tools.gpucheck"),
        "cluster": ("a throwaway SLURM cluster of emulated nodes on this machine: up, down, status",
                    "my_utils.tools.cluster"),
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        parser = OneLineParser(prog="python -m my_utils",
                               description="The course's command line. Commands:\n" + "\n".join(
                                   f"  {name:<9} {text}" for name, (text, _) in commands.items()),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("command", choices=commands)
        parser.parse_args(argv[:1])
    from importlib import import_module

    module = import_module(commands[argv[0]][1])
    run_main(lambda: module.main(argv[1:]), prefix=f"my_utils {argv[0]}")


if __name__ == "__main__":
    from my_utils.run.cli import run_as_script

    run_as_script(main)  # a benchmark's measured run trains over gloo, whose teardown may abort at exit
