"""``ddp_lesson``: the DDP lesson's workflow (``my_utils.workflows.ddp``: full fine-tuning in raw PyTorch DDP, under
``torchrun``) on 2 processes x 1 thread against 1 process x 1 thread, on the same global batch of 32 blocks of 128
tokens: samples/s, >= 1.7. Unlike ``ddp`` (LoRA, whose all-reduce carries only the adapters), every step
all-reduces the gradients of all the weights (8 MB for the tiny model, over gloo on a CPU): on two idle cores that
is still small next to a step's compute.

Its workflow has no mixed precision and reads no data file: both runs are fp32, on the preset's own data.
"""

from __future__ import annotations

import sys
from pathlib import Path

from my_utils.run.results import read_json
from my_utils.tools.bench.harness import WARMUP_STEPS, Settings, bench_env, pairs_detail, process_scaling, ratio_row

NAME = "ddp_lesson"
HELP = ("the DDP lesson's workflow (torchrun, full fine-tuning) on 2 processes x 1 thread against 1 x 1, same "
        "global batch: samples/s, >= 1.7")
TARGETS = {"ddp_lesson": 1.7}
ORDER = 35
REPEATS = 2
GLOBAL_BATCH, MAX_LENGTH = 32, 128
# Steps per run, at most: each is a full fine-tuning step of 32 blocks (about a second on one thread), and 10 timed
# steps after the warm-up already settle samples/s.
STEPS = 12


def run(s: Settings, folder: Path):
    """The DDP lesson's workflow on 2 processes x 1 thread against 1 process x 1 thread, same global batch."""
    steps = min(s.steps, STEPS)

    def command(processes, out):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
                "-m", "my_utils.workflows.ddp", *map(str, [
                    "--preset", s.preset, *(["--random-init"] if s.random_init else []),
                    "--local-batch-size", GLOBAL_BATCH // processes, "--max-length", MAX_LENGTH, "--max-steps", steps,
                    "--untimed-steps", WARMUP_STEPS, "--logging-steps", steps, "--num-processes", processes,
                    "--output-dir", out])]

    result = process_scaling(folder, {"lesson": (command, run_figures)}, s.repeats_for(NAME),
                             bench_env(s, threads=1), NAME)["lesson"]
    rows = [ratio_row(NAME, "samples/s, training", "DDP lesson (torchrun), 2 processes x 1 thread",
                      "1 process x 1 thread", result["ratio"], target=TARGETS["ddp_lesson"],
                      cpu_ratio=result["cpu_time_ratio"],
                      detail=f"full fine-tuning, global batch {GLOBAL_BATCH} x {MAX_LENGTH} tokens, {steps} steps; "
                             f"{pairs_detail(result['ratios'], result['standard_error'])}")]
    return result, rows


def run_figures(out: Path) -> dict:
    """One run's samples/s, and samples per CPU-second of its busiest process (gloo threads included)."""
    summary = read_json(out / "summary.json")
    if summary["threads_per_process"] != 1:
        raise RuntimeError(f"{out} ran {summary['threads_per_process']} threads per process; the comparison is of "
                           "1 thread each.")
    samples = summary["timed_steps"] * summary["global_batch_size"]
    return {"world_size": summary["world_size"], "rate": summary["samples_per_s"],
            "cpu_rate": samples / max(summary["cpu_seconds_per_rank"])}
