"""DDP scaling on a CPU: 2 processes x 1 thread against 1 process x 1 thread, on the same global batch.

    python bench/ddp_scaling.py                       # tiny preset, global batch 32 x 128 tokens, 2 repeats
    python bench/ddp_scaling.py --repeats 3 --steps 16

Both configurations run the DDP lesson's workflow (``my_utils.workflows.ddp``) under ``torchrun`` in fresh
processes, one intra-op thread per process, alternating ``--repeats`` times so that a load change on the machine
hits both (``my_utils.tools.bench.process_scaling``, which ``python -m my_utils bench ddp`` uses for the LoRA workflow).
The results folder ``runs/bench/ddp_scaling[_n]/`` holds run.json, summary.json (samples/s of every run, the
medians and their ratio, the machine's load average before and after) and each run's own results folder and log.
The ratio printed last is median samples/s with 2 processes / median with 1. On two idle cores it should reach
1.7 or more: the gradient all-reduce (8 MB over gloo) is small next to a step's compute.

On a machine shared with other jobs the wall-clock ratio mostly measures the neighbours; the line before it is an
estimate that they disturb less: the same ratio computed from each run's CPU seconds (the busiest process's,
gloo threads included) instead of wall-clock seconds, i.e. the speedup if every process had a core to itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from my_utils.run.launch import clean_env  # noqa: E402
from my_utils.run.results import RUNS_ROOT, Run, read_json, unique_dir  # noqa: E402
from my_utils.tools.bench import process_scaling  # noqa: E402

TARGET = 1.7


def torchrun_command(processes: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
            "-m", "my_utils.workflows.ddp", *args]


def run_figures(out: Path) -> dict:
    """One run's samples/s, and samples per CPU-second of its busiest process (gloo threads included)."""
    summary = read_json(out / "summary.json")
    assert summary["threads_per_process"] == 1
    samples = summary["timed_steps"] * summary["effective_batch"]
    return {"world_size": summary["world_size"], "rate": summary["samples_per_s"],
            "cpu_rate": samples / max(summary["cpu_seconds_per_rank"])}


def main(argv=None) -> float:
    p = argparse.ArgumentParser(prog="python bench/ddp_scaling.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--global-batch", type=int, default=32, help="blocks per optimizer step, over all processes")
    p.add_argument("--max-length", type=int, default=128, help="tokens per block")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run, warm-up included")
    p.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of samples/s")
    p.add_argument("--repeats", type=int, default=2, help="runs of each configuration, alternated")
    p.add_argument("--output-dir", default=None, help="results folder (default runs/bench/ddp_scaling[_n])")
    args = p.parse_args(argv)
    if args.global_batch % 2:
        p.error("--global-batch must be even: two processes share it")

    root = Path(args.output_dir) if args.output_dir else unique_dir(RUNS_ROOT / "bench" / "ddp_scaling")
    config = vars(args) | {"threads_per_process": 1, "processes": [1, 2]}
    record = Run.create(root, config=config, command=["python", "bench/ddp_scaling.py", *(argv or sys.argv[1:])],
                        load_average_before=os.getloadavg())

    def command(processes, out):
        return torchrun_command(processes, [
            "--preset", args.preset, "--batch-size", str(args.global_batch // processes),
            "--max-length", str(args.max_length), "--max-steps", str(args.steps),
            "--warmup-steps", str(args.warmup_steps), "--log-every", str(args.steps),
            "--num-processes", str(processes), "--output-dir", str(out)])

    try:
        result = process_scaling(root, command, run_figures, args.repeats, clean_env(OMP_NUM_THREADS=1), "ddp")
    except BaseException as e:
        record.fail(f"{type(e).__name__}: {e}")
        raise
    samples_per_s = {n: [r["rate"] for r in result[f"x{n}"]] for n in (1, 2)}
    medians = {n: statistics.median(v) for n, v in samples_per_s.items()}
    ratio, cpu_ratio = result["ratio"], result["cpu_time_ratio"]
    record.update(load_average_after=os.getloadavg())
    record.finish({
        "samples_per_s_1x1": samples_per_s[1],
        "samples_per_s_2x1": samples_per_s[2],
        "median_samples_per_s_1x1": medians[1],
        "median_samples_per_s_2x1": medians[2],
        "tokens_per_s_2x1": medians[2] * args.max_length,
        "ratio_2x1_over_1x1": ratio,
        "cpu_time_ratio_2x1_over_1x1": cpu_ratio,
        "target": TARGET,
        "meets_target": ratio >= TARGET,
    })
    print(f"\n1 process x 1 thread : {medians[1]:.2f} samples/s  {samples_per_s[1]}")
    print(f"2 processes x 1 thread: {medians[2]:.2f} samples/s  {samples_per_s[2]}")
    print(f"CPU-time estimate (samples per CPU-second of the busiest process): {cpu_ratio:.2f}")
    print(f"DDP speedup (samples/s ratio, median of {args.repeats}): {ratio:.2f}  (target {TARGET})")
    print(f"results folder: {root}")
    return ratio


if __name__ == "__main__":
    main()
