"""``ddp``: the LoRA workflow on 2 processes x 1 thread against 1 process x 1 thread, same global batch (each
configuration launched by ``accelerate launch``, alternated): useful tokens/s, >= 1.8. ``ddp_lesson`` measures the
same for the DDP lesson's full fine-tuning.
"""

from __future__ import annotations

from pathlib import Path

from my_utils.tools.bench.course import course_args, course_figures
from my_utils.tools.bench.harness import Settings, bench_env, process_scaling, ratio_row

NAME = "ddp"
HELP = "the LoRA workflow on 2 processes x 1 thread against 1 x 1, same global batch: useful tokens/s, >= 1.8"
TARGETS = {"ddp": 1.8}
ORDER = 30
REPEATS = 2


def run(s: Settings, folder: Path):
    """The LoRA workflow on 2 processes x 1 thread against 1 process x 1 thread, same global batch."""
    from my_utils.run.launch import accelerate_command

    global_batch = 2 * s.batch()

    def command(processes, out):
        return accelerate_command("my_utils", ["bench", "run-course", *course_args(
            s, out, global_batch // processes, num_processes=processes)], num_processes=processes)

    def figures(out):
        found = course_figures(out)
        return {**found, "rate": found["tokens_per_s"], "cpu_rate": found["cpu_tokens_per_s"]}

    result = process_scaling(folder, command, figures, s.repeats_for(NAME), bench_env(s, threads=1), NAME)
    rows = [ratio_row(NAME, "useful tokens/s, training", "LoRA workflow, 2 processes x 1 thread",
                      "1 process x 1 thread", result["ratio"], target=TARGETS["ddp"], cpu_ratio=result["cpu_time_ratio"],
                      detail=f"global batch {global_batch}, {s.steps} steps")]
    return result, rows
