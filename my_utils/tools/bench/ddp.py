"""``ddp``: the LoRA workflow on 2 processes x 1 thread against 1 process x 1 thread, same global batch, beside a
bare accelerate + peft DDP loop (``run-loop`` under ``accelerate launch``: plain DataLoader, AdamW, the same model,
loss and batches) scaled the same way. Useful tokens/s of training, over the whole training call and in the steady
state after the first steps. Targets: the workflow's scaling >= 1.8, and >= 0.95 of the bare loop's (what the
course adds to DDP costs at most 5% of its speed-up). With randomly drawn batches a step may wait in the all-reduce
for the rank whose batch is padded longer. Two ways of giving every rank equal work are measured the same way:
``--group-by-length`` (the ranks of a step take batches of similar lengths: the same examples per step as the
default, so it tells whether unequal work is what holds the speed-up back) and ``--packing`` (rows of max_length
tokens: a fixed token budget per rank, and about three times the tokens per step on the tiny data, over which each
step's fixed costs spread): target >= 1.85.

Every configuration alternates with the others; each figure is the median of the ratios of runs taken side by side
(run i on 2 processes over run i on 1), with its standard error. Repeats are added (up to ``MAX_REPEATS``) until the
equal-work figure is known within ``SETTLED``: on a 2-core machine single runs move by 10%, more than the
differences measured here. ``ddp_lesson`` measures the DDP lesson's full fine-tuning.
"""

from __future__ import annotations

from pathlib import Path

from my_utils.core.presets import get_preset
from my_utils.run.launch import accelerate_command
from my_utils.run.results import read_json
from my_utils.tools.bench.course import course_args, course_figures
from my_utils.tools.bench.harness import (WARMUP_STEPS, Settings, bench_env, logging_steps, pairs_detail,
                                          process_scaling, ratio_row, scaling_ratios)
from my_utils.tools.bench.loop import over_ranks

NAME = "ddp"
HELP = ("the LoRA workflow on 2 processes x 1 thread against 1 x 1, same global batch, beside a bare DDP loop "
        "scaled the same way, the workflow with --group-by-length and with --packing (equal work per rank): useful "
        "tokens/s, >= 1.8, >= 0.95 of the bare loop's scaling, >= 1.85 packed")
TARGETS = {"ddp": 1.8, "ddp_over_bare": 0.95, "ddp_equal_work": 1.85}
ORDER = 30
REPEATS = 3  # at least
MAX_REPEATS = 6
SETTLED = 0.02  # the equal-work speed-up over the whole call known within 0.02: 1.85 told from 1.80


def run(s: Settings, folder: Path):
    """The LoRA workflow and a bare DDP loop, each on 2 processes x 1 thread against 1 process x 1 thread."""
    global_batch = 2 * s.batch()

    def course(processes, out):
        return accelerate_command("my_utils", ["bench", "run-course", *course_args(
            s, out, global_batch // processes, num_processes=processes)], num_processes=processes)

    def bare(processes, out):  # the workflow's default batching (random) and the precision it is given
        return accelerate_command("my_utils", ["bench", "run-loop", *s.preset_args(), "--method", "lora",
                                               "--local-batch-size", global_batch // processes, "--steps", s.steps,
                                               "--logging-steps", logging_steps(s.steps),
                                               "--mixed-precision", "bf16" if s.bf16 else "no", "--output-dir", out],
                                  num_processes=processes)

    def grouped(processes, out):  # the ranks of a step take neighbouring batches of a length-sorted order
        return [*course(processes, out), "--group-by-length"]

    def packed(processes, out):  # rows of max_length tokens: every rank's micro-batch holds about as many tokens
        return [*course(processes, out), "--packing"]

    def settled(scaling):
        return scaling["packed"]["standard_error"] <= SETTLED

    scaling = process_scaling(folder, {"course": (course, _rates(course_figures)), "bare": (bare, _rates(bare_figures)),
                                       "grouped": (grouped, _rates(course_figures)),
                                       "packed": (packed, _rates(course_figures))},
                              s.repeats_for(NAME), bench_env(s, threads=1), NAME,
                              settled=None if s.quick or s.repeats else settled, max_repeats=MAX_REPEATS)
    for result in scaling.values():  # the same from the steady-state windows
        result["steady"] = scaling_ratios(result["x2"], result["x1"], "steady_rate", "steady_cpu_rate")
    course_run, bare_run, grouped_run, packed_run = (scaling[k] for k in ("course", "bare", "grouped", "packed"))
    shape = f"global batch {global_batch}"
    two, one = "2 processes x 1 thread", "1 process x 1 thread"
    rows = []
    for window, pick in ((f"the whole training call, {s.steps} steps", lambda r: r),
                         (f"steady state: steps {WARMUP_STEPS + 1}-{s.steps}", lambda r: r["steady"])):
        course_w, bare_w, grouped_w, packed_w = (pick(r) for r in (course_run, bare_run, grouped_run, packed_run))

        def detail(w):
            return f"{shape}, {window}; {pairs_detail(w['ratios'], w['standard_error'])}"

        rows += [
            ratio_row(NAME, "useful tokens/s, training", f"LoRA workflow, {two}", one, course_w["ratio"],
                      target=TARGETS["ddp"], cpu_ratio=course_w["cpu_time_ratio"], detail=detail(course_w),
                      if_missed="each step pays fixed costs that do not shrink with the batch (the Trainer's "
                                "bookkeeping, collectives over gloo), and 2 processes share 2 cores with the rest of "
                                "the machine"),
            ratio_row(NAME, "useful tokens/s, training", f"bare DDP loop, {two}", one, bare_w["ratio"],
                      cpu_ratio=bare_w["cpu_time_ratio"], detail=detail(bare_w)),
            ratio_row(NAME, "useful tokens/s, training", f"LoRA workflow --group-by-length, {two}", f"the same, {one}",
                      grouped_w["ratio"], cpu_ratio=grouped_w["cpu_time_ratio"], detail=detail(grouped_w)),
            ratio_row(NAME, "useful tokens/s, training", f"LoRA workflow --packing, {two}", f"the same, {one}",
                      packed_w["ratio"], target=TARGETS["ddp_equal_work"], cpu_ratio=packed_w["cpu_time_ratio"],
                      detail=f"{global_batch} rows of up to {get_preset(s.preset).max_length} tokens per step; "
                             + detail(packed_w),
                      if_missed="2 processes share 2 cores with the rest of the machine, and each step still pays "
                                "its fixed costs (the Trainer's bookkeeping, two collectives over gloo) in full"),
            ratio_row(NAME, "2-process speed-up", "LoRA workflow's", "bare DDP loop's",
                      course_w["ratio"] / bare_w["ratio"], target=TARGETS["ddp_over_bare"],
                      cpu_ratio=course_w["cpu_time_ratio"] / bare_w["cpu_time_ratio"],
                      detail=f"{shape}, {window}; medians of paired ratios"),
        ]
    return scaling, rows


def bare_figures(out: Path) -> dict:
    """A bare loop run's figures over its ranks (``run-loop`` records every rank's)."""
    summary = read_json(out / "summary.json")
    return {**over_ranks(summary["ranks"]), "steady": over_ranks([r["steady"] for r in summary["ranks"]]),
            "world_size": summary["world_size"], "losses": summary["losses"]}


def _rates(figures):
    """``figures`` with the rates ``process_scaling`` compares: useful tokens/s, whole and steady."""

    def read(out):
        found = figures(out)
        return {**found, "rate": found["tokens_per_s"], "cpu_rate": found["cpu_tokens_per_s"],
                "steady_rate": found["steady"]["tokens_per_s"], "steady_cpu_rate": found["steady"]["cpu_tokens_per_s"]}

    return read
