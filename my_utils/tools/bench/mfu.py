"""``mfu``: model FLOPs utilization, the FLOP/s a training loop achieves (``flops.model_flops_per_token``) over the
machine's own matmul peak measured in the same process (a large matmul in the loops' precision), for LoRA and full
fine-tuning loops (``run-loop``'s) on blocks of random tokens (FLOPs do not depend on the values).

    python -m my_utils bench run-mfu --preset tiny --output-dir DIR     # the matmul peak and both loops' MFU
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from statistics import median

from my_utils.core.models import set_threads
from my_utils.run.config import OneLineParser
from my_utils.run.launch import run_logged
from my_utils.run.results import read_json
from my_utils.tools.bench.harness import WARMUP_STEPS, Settings, bench_env, python_command, ratio_row, recorded_run
from my_utils.tools.bench.loop import LoopConfig, bare_loop

NAME = "mfu"
HELP = "model FLOP/s of LoRA and full fine-tuning loops against this machine's measured matmul peak"
TARGETS = {}  # a figure to read, not a claim: the peak is the machine's best case
ORDER = 50


def run(s: Settings, folder: Path):
    """Model FLOPs utilization of LoRA and full fine-tuning against this machine's measured matmul peak."""
    out = folder / "mfu"
    steps = max(s.steps // 2, 4)
    run_logged(python_command("run-mfu", "--preset", s.preset, *(["--random-init"] if s.random_init else []),
                              "--local-batch-size", s.batch(), "--steps", steps,
                              "--output-dir", out), folder / "mfu.log", bench_env(s))
    result = read_json(out / "summary.json")
    peak = result["matmul_peak"]
    rows = []
    for method in ("lora", "full"):
        r = result[method]
        rows.append(ratio_row(NAME, "model FLOP/s", f"{method} training loop", f"matmul peak ({peak['what']})",
                              r["mfu"], cpu_ratio=r["mfu_cpu_time"],
                              detail=f"{r['flops_per_token'] / 1e6:.1f} MFLOP/token"
                                     + (f"; counted as 6N: {r['mfu_if_counted_as_6n']:.3f}" if method == "lora" else "")))
    return result, rows


def mfu_main(argv) -> None:
    """``run-mfu``: the matmul peak, LoRA and full fine-tuning loops on random-token blocks, the peak again."""
    p = OneLineParser(prog="python -m my_utils bench run-mfu", description=mfu_main.__doc__)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--local-batch-size", dest="batch_size", type=int, default=None)
    p.add_argument("--steps", type=int, default=20, help=f"timed steps of each loop (after {WARMUP_STEPS} warm-up steps)")
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)
    recorded_run(args.output_dir, vars(args), lambda: measure_mfu(args))


def measure_mfu(args) -> dict:
    """The matmul peak before and after each loop (their median is the peak), each loop's MFU in its steady state."""
    import torch
    from accelerate import PartialState

    set_threads()
    device = str(PartialState().device)
    dtype = torch.bfloat16 if os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16" else torch.float32
    peaks = [matmul_peak(device, dtype)]
    result = {}
    for method in ("lora", "full"):
        result[method] = bare_loop(LoopConfig(preset=args.preset, method=method, local_batch_size=args.batch_size,
                                              random_tokens=True, steps=args.steps + WARMUP_STEPS,
                                              warmup_steps=WARMUP_STEPS, logging_steps=args.steps + WARMUP_STEPS,
                                              random_init=args.random_init))
        peaks.append(matmul_peak(device, dtype))
    cuda = device.startswith("cuda")
    peak = {"what": f"{peaks[0]['dtype']} {peaks[0]['n']}x{peaks[0]['n']} matmul, "
                    f"{1 if cuda else torch.get_num_threads()} {'GPU' if cuda else 'thread(s)'}",
            "flops_per_s": median(pk["flops_per_s"] for pk in peaks),
            "flops_per_cpu_s": median(pk["flops_per_cpu_s"] for pk in peaks), "measurements": peaks}
    for loop in result.values():  # the steady state: after the warm-up steps
        tokens_per_s, tokens_per_cpu_s = loop["steady"]["tokens_per_s"], loop["steady"]["cpu_tokens_per_s"]
        loop["model_flops_per_s"] = tokens_per_s * loop["flops_per_token"]
        loop["mfu"] = loop["model_flops_per_s"] / peak["flops_per_s"]
        loop["mfu_cpu_time"] = tokens_per_cpu_s * loop["flops_per_token"] / peak["flops_per_cpu_s"]
        loop["mfu_if_counted_as_6n"] = tokens_per_s * loop["flops_per_token_as_6n"] / peak["flops_per_s"]
    return {"matmul_peak": peak, **result}


def matmul_peak(device: str, dtype, seconds: float = 1.5) -> dict:
    """FLOP/s of a large square matmul on ``device`` (n = 2048 on a CPU, 8192 on a GPU), timed in windows of a
    few matmuls for about ``seconds``: the median window (``flops_per_s``, comparable with a training loop's
    average) and the best one, in wall-clock and in this process's CPU time."""
    import torch

    cuda = device.startswith("cuda")
    n = 8192 if cuda else 2048
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    per_window = 20 if cuda else 3

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    torch.matmul(a, b)
    sync()
    wall, cpu = [], []
    deadline = time.perf_counter() + seconds
    while len(wall) < 3 or time.perf_counter() < deadline:
        t, c = time.perf_counter(), time.process_time()
        for _ in range(per_window):
            torch.matmul(a, b)
        sync()
        wall.append(2 * n**3 * per_window / (time.perf_counter() - t))
        cpu.append(2 * n**3 * per_window / max(time.process_time() - c, 1e-9))
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "windows": len(wall), "flops_per_s": median(wall),
            "best_flops_per_s": max(wall), "flops_per_cpu_s": median(cpu)}


WORKERS = {"run-mfu": mfu_main}
