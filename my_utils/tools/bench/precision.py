"""``precision``: the LoRA workflow in bf16 mixed precision against fp32, one process each (alternated): useful
tokens/s of training. Its target checks the default: ``--mixed-precision auto`` picks bf16 where it trains faster
(``my_utils.core.devices.fast_bf16``: a GPU with bf16, a CPU with AMX), so the ratio must be >= 1 where auto picks
bf16 and <= 1 where it picks fp32. On a CPU with AVX-512 BF16 alone, bf16 is native but slower.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from my_utils.core.devices import fast_bf16
from my_utils.tools.bench.course import course_args, course_figures
from my_utils.tools.bench.harness import Settings, alternate, bench_env, python_command, ratio_row, throughput_ratio

NAME = "precision"
HELP = ("the LoRA workflow in bf16 mixed precision against fp32: useful tokens/s, >= 1 where auto picks bf16, <= 1 "
        "where it picks fp32")
TARGETS = {"precision": 1.0}
ORDER = 15
REPEATS = 2


def run(s: Settings, folder: Path):
    """The LoRA workflow in bf16 against fp32, training time only."""
    batch = s.batch()

    def workflow(bf16):
        return lambda out: python_command("run-course", *course_args(replace(s, bf16=bf16), out, batch))

    runs = alternate({"bf16": workflow(True), "fp32": workflow(False)}, s.repeats_for(NAME), folder, bench_env(s),
                     NAME)
    found = {name: [course_figures(p) for p in paths] for name, paths in runs.items()}
    wall, cpu = throughput_ratio(found["bf16"], found["fp32"])
    auto = "bf16" if fast_bf16() else "fp32"
    rows = [ratio_row(NAME, "useful tokens/s, training", "LoRA workflow, bf16 autocast", "fp32", wall,
                      target=TARGETS["precision"], at_most=auto == "fp32", cpu_ratio=cpu,
                      detail=f"{s.preset}, batch {batch}, {s.steps} steps; auto picks {auto} here")]
    return {**found, "auto": auto}, rows
