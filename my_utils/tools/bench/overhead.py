"""``overhead``: the LoRA workflow (``my_utils.workflows.lora``: Trainer, callbacks, recording) against a bare
accelerate + peft loop on the same model, data, batch, batching and optimizer (plain DataLoader, AdamW,
``accelerator.prepare`` / ``backward``): useful (non-padding) tokens per second of training, over the whole training
call and in the steady state after the first steps, >= 0.98. Each figure is the median of the ratios of runs taken
side by side, with its standard error; pairs are added (up to ``MAX_REPEATS``) until that error is at most
``SETTLED``, so that a difference of a few percent is told from the machine's noise.
"""

from __future__ import annotations

from pathlib import Path

from my_utils.run.results import read_json
from my_utils.tools.bench.course import course_args, course_figures
from my_utils.tools.bench.harness import (WARMUP_STEPS, Settings, alternate, bench_env, logging_steps, paired_ratio,
                                          pairs_detail, python_command, ratio_row)

NAME = "overhead"
HELP = "the LoRA workflow against a bare accelerate + peft loop: useful tokens/s of training, >= 0.98"
TARGETS = {"overhead": 0.98}
ORDER = 10
REPEATS = 3  # at least
MAX_REPEATS = 7
SETTLED = 0.01  # the whole training call's median ratio known within a percent: 0.98 told from 1.00


def run(s: Settings, folder: Path):
    """The LoRA workflow against a bare accelerate + peft loop, training time only."""
    batch = s.batch()
    sampling = {}  # the workflow's batching, read from its first run, so that the bare loop batches the same way

    def course(out):
        return python_command("run-course", *course_args(s, out, batch))

    def bare(out):
        strategy = sampling.setdefault("strategy", course_figures(folder / "course_1")["settings"]["sampling"])
        return python_command("run-loop", *s.preset_args(), "--method", "lora", "--local-batch-size", batch,
                              "--steps", s.steps, "--sampling", strategy, "--logging-steps", logging_steps(s.steps),
                              "--output-dir", out)

    def settled(done):
        pairs = [(course_figures(c), read_json(b / "summary.json")) for c, b in zip(done["course"], done["bare"])]
        return paired_ratio(*zip(*pairs))["standard_error"] <= SETTLED

    runs = alternate({"course": course, "bare": bare}, s.repeats_for(NAME), folder, bench_env(s), NAME,
                     settled=None if s.quick or s.repeats else settled, max_repeats=MAX_REPEATS)
    course_runs = [course_figures(p) for p in runs["course"]]
    bare_runs = [read_json(p / "summary.json") for p in runs["bare"]]
    shape = f"{s.preset}, batch {batch}, {sampling['strategy']} batches"
    measured, baseline = "LoRA workflow (Trainer + callbacks)", "bare accelerate + peft loop"
    figures, rows = {}, []
    for window, course_window, bare_window in (
            (f"the whole training call, {s.steps} steps", course_runs, bare_runs),
            (f"steady state: steps {WARMUP_STEPS + 1}-{s.steps}", [r["steady"] for r in course_runs],
             [r["steady"] for r in bare_runs])):
        wall = paired_ratio(course_window, bare_window)
        cpu = paired_ratio(course_window, bare_window, "cpu_tokens_per_s")
        figures[window] = {"wall": wall, "cpu": cpu}
        rows.append(ratio_row(NAME, "useful tokens/s, training", measured, baseline, wall["median"],
                              target=TARGETS["overhead"], cpu_ratio=cpu["median"],
                              detail=f"{shape}, {window}; {pairs_detail(wall['ratios'], wall['standard_error'])}"))
    return {"course": course_runs, "bare": bare_runs, "sampling": sampling["strategy"], "paired": figures}, rows
