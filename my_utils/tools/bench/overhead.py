"""``overhead``: the LoRA workflow (``my_utils.workflows.lora``: Trainer, callbacks, recording) against a bare
accelerate + peft loop on the same model, data, batch, batching and optimizer (plain DataLoader, AdamW,
``accelerator.prepare`` / ``backward``): useful (non-padding) tokens per second of training, over the whole training
call and in the steady state after the first steps, >= 0.98.
"""

from __future__ import annotations

from pathlib import Path

from my_utils.run.results import read_json
from my_utils.tools.bench.course import course_args, course_figures
from my_utils.tools.bench.harness import (WARMUP_STEPS, Settings, alternate, bench_env, logging_steps, python_command,
                                          ratio_row, throughput_ratio)

NAME = "overhead"
HELP = "the LoRA workflow against a bare accelerate + peft loop: useful tokens/s of training, >= 0.98"
TARGETS = {"overhead": 0.98}
ORDER = 10
REPEATS = 3


def run(s: Settings, folder: Path):
    """The LoRA workflow against a bare accelerate + peft loop, training time only."""
    batch = s.batch()
    sampling = {}  # the workflow's batching, read from its first run, so that the bare loop batches the same way

    def course(out):
        return python_command("run-course", *course_args(s, out, batch))

    def bare(out):
        strategy = sampling.setdefault("strategy", course_figures(folder / "course_1")["settings"]["sampling"])
        return python_command("run-loop", *s.preset_args(), "--method", "lora", "--batch-size", batch,
                              "--steps", s.steps, "--sampling", strategy, "--logging-steps", logging_steps(s.steps),
                              "--output-dir", out)

    runs = alternate({"course": course, "bare": bare}, s.repeats_for(NAME), folder, bench_env(s), NAME)
    course_runs = [course_figures(p) for p in runs["course"]]
    bare_runs = [read_json(p / "summary.json") for p in runs["bare"]]
    wall, cpu = throughput_ratio(course_runs, bare_runs)
    steady_wall, steady_cpu = throughput_ratio([r["steady"] for r in course_runs], [r["steady"] for r in bare_runs])
    shape = f"{s.preset}, batch {batch}, {sampling['strategy']} batches"
    measured, baseline = "LoRA workflow (Trainer + callbacks)", "bare accelerate + peft loop"
    rows = [ratio_row(NAME, "useful tokens/s, training", measured, baseline, wall, target=TARGETS["overhead"],
                      cpu_ratio=cpu, detail=f"{shape}, the whole training call, {s.steps} steps"),
            ratio_row(NAME, "useful tokens/s, training", measured, baseline, steady_wall, target=TARGETS["overhead"],
                      cpu_ratio=steady_cpu, detail=f"{shape}, steady state: steps {WARMUP_STEPS + 1}-{s.steps}")]
    return {"course": course_runs, "bare": bare_runs, "sampling": sampling["strategy"]}, rows
