"""Benchmarks: the course's defaults against the usual alternatives, each figure a ratio to a baseline measured in
the same run (absolute times on a shared machine drift; a ratio of runs taken side by side drifts much less).

    python -m my_utils bench                   # every benchmark: about 7 minutes on 2 idle CPU cores
    python -m my_utils bench overhead trainer  # some of them
    python -m my_utils bench --quick           # a smoke run: a few steps, one repeat, the tiny model everywhere
    python -m my_utils bench --preset gpt2 --random-init   # a GPU: bf16 where native (overhead, trainer and
                                               # ddp read the preset's tokenizer and data: online, or cached)

Each benchmark writes ``runs/bench/<name>[_n]/`` (run.json; summary.json with every measurement and the ratios;
one folder and one log per measured run) and the command prints a table of ratios, each named with its baseline:

overhead  The LoRA workflow (``my_utils.workflows.lora``: Trainer, callbacks, recording) against a bare
          accelerate + peft loop on the same model, data, batch, batching and optimizer (plain DataLoader, AdamW,
          ``accelerator.prepare`` / ``backward``): useful (non-padding) tokens per second of training, over the
          whole training call and in the steady state after the first steps, >= 0.98.
trainer   The LoRA workflow's defaults, and the same with ``--group-by-length``, against stock trl ``SFTTrainer``
          (SFTConfig defaults but for the model, data, batch, steps, learning rate and schedule, which are the
          same): useful tokens/s, >= 1.25, with the held-out loss after training at most 10 % above stock's and
          (random batches in the same order on both sides) the logged training losses within 10 %.
ddp       The LoRA workflow on 2 processes x 1 thread against 1 process x 1 thread, same global batch
          (``process_scaling``; ``bench/ddp_scaling.py`` runs the same for the DDP lesson): useful tokens/s, >= 1.8.
memory    One training step of the gpt2 architecture (random weights, batch 4 x 256, one fresh process each):
          LoRA's peak against full fine-tuning's, <= 0.5 (peak allocated on CUDA; on a CPU the weights and AdamW
          states plus the RSS rise during the step); the same with gradient checkpointing on both; what
          checkpointing saves (activations kept for backward) and costs (step time); and, through
          ``bench/qlora_memory.py``, 4-bit NF4 weights against bf16 on the opt-350m architecture, <= 0.35.
mfu       Model FLOPs utilization: the FLOP/s a training loop achieves (``model_flops_per_token``, below) over the
          machine's own matmul peak measured in the same process (a large matmul in the loops' precision),
          for LoRA and full fine-tuning loops on blocks of random tokens (FLOPs do not depend on the values).

How runs are measured: every run is a fresh process (no allocator cache, thread pool or peak counter carries
over); configurations alternate (A B, then B A) ``--repeats`` times so that a change of load hits both; a ratio is
of medians. On a CPU each process uses ``--threads`` intra-op threads (1 by default). Beside each wall-clock ratio
the table shows the same ratio computed from CPU seconds (of the busiest process, for several processes): what
the ratio would be if every process had its cores to itself, an estimate that neighbours disturb less.

The pieces that run in fresh processes are commands of this module (usable alone, each writes a results folder):

    python -m my_utils.tools.bench run-course --preset tiny --output-dir DIR ...   # the LoRA workflow, Trainer.train timed
    python -m my_utils.tools.bench run-loop --preset tiny --method lora --output-dir DIR     # the bare loop
    python -m my_utils.tools.bench run-sft --preset tiny --output-dir DIR                    # stock SFTTrainer
    python -m my_utils.tools.bench run-step --preset gpt2 --method full --output-dir DIR     # one measured step
    python -m my_utils.tools.bench run-mfu --preset tiny --output-dir DIR                    # matmul peak and MFU

Model FLOPs (``model_flops_per_token``), per token of a sequence of length s, with N the weights of every
matrix multiplication (linear layers and the output layer; embedding lookups cost nothing), N_a the LoRA
adapters' weights (A and B), L layers of width d:
    forward                    2 N (+ 2 N_a)     a multiply and an add per weight
    backward, input gradients  2 N (+ 2 N_a)     needed by every trainable weight below
    backward, weight gradients 2 N  for full fine-tuning; 2 N_a only for LoRA (the base weights are frozen)
    attention (no weights)     12 L d s          QK^T and AV: 4 L d s forward, twice that backward (PaLM's count,
                                                 no discount for the causal mask)
so full fine-tuning is 6 N + 12 L d s and LoRA 4 N + 6 N_a + 12 L d s; counting LoRA as 6 N adds 2 N that never
run. Autograd also skips the input gradient of the lowest adapted layer when nothing below it
trains; that is under 1/L of N and is not subtracted.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from my_utils import UserError
from my_utils.run.results import REPO_ROOT, RUNS_ROOT, Run, read_json, unique_dir

BENCH_ROOT = RUNS_ROOT / "bench"
BENCHMARKS = ("overhead", "trainer", "ddp", "memory", "mfu")
TARGETS = {"overhead": 0.98, "trainer": 1.25, "ddp": 1.8, "lora_over_full_peak": 0.5, "weights_4bit_over_bf16": 0.35}
LOSS_TOLERANCE = 0.10  # relative difference of losses that counts as "the same trajectory"
REPEATS = {"overhead": 3, "trainer": 2, "ddp": 2}
WARMUP_STEPS = 2  # steps before the steady-state window (first-step allocations, caches)


# ---------------------------------------------------------------------------------------------------------------
# Settings and the plumbing shared by the benchmarks


@dataclass
class Settings:
    preset: str = "tiny"  # the model and data of overhead, trainer, ddp and mfu
    random_init: bool = False
    data_file: str | None = None
    memory_preset: str = "gpt2"  # the architecture of the memory benchmark (random weights)
    qlora_preset: str = "opt-350m"  # the architecture of the 4-bit weights measurement
    batch_size: int | None = None  # per process; default: the preset's
    steps: int = 40  # optimizer steps per training run
    repeats: int | None = None  # runs of each configuration; default per benchmark (REPEATS)
    threads: int = 1  # intra-op threads per process on a CPU
    memory_batch: int = 4
    memory_seq: int = 256
    bf16: bool = False  # bf16 mixed precision (by default where the device computes it natively)
    quick: bool = False
    output_root: str = str(BENCH_ROOT)

    def repeats_for(self, name: str) -> int:
        return self.repeats or (1 if self.quick else REPEATS[name])


def quick_settings(s: Settings) -> Settings:
    """A smoke run: few steps, one repeat, the tiny model everywhere."""
    return Settings(**{**asdict(s), "steps": min(s.steps, 2 * WARMUP_STEPS + 2), "memory_preset": "tiny", "qlora_preset": "tiny",
                       "memory_seq": min(s.memory_seq, 64)})


def bench_env(s: Settings, threads: int | None = None) -> dict:
    """The environment of every measured process: offline as configured, ``threads`` intra-op threads, one
    precision for every run (the LoRA workflow and the bare loop both read ACCELERATE_MIXED_PRECISION)."""
    from my_utils.run.launch import clean_env
    from my_utils.tools.sweep import STEADY_MEMORY_ENV

    threads = threads or s.threads
    return clean_env(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false",
                     ACCELERATE_MIXED_PRECISION="bf16" if s.bf16 else "no", **STEADY_MEMORY_ENV)


def python_command(*args) -> list[str]:
    return [sys.executable, "-m", "my_utils.tools.bench", *map(str, args)]


def run_logged(cmd: list[str], log: Path, env: dict, ok_codes=(0,)) -> None:
    """Run ``cmd`` in a fresh process with its output going to ``log``; raise with the log's end if it fails."""
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        code = subprocess.run(cmd, env=env, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if code not in ok_codes:
        tail = "".join(log.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)[-15:])
        raise RuntimeError(f"a measured run failed (exit code {code}); the end of {log}:\n{tail}")


def alternate(variants: dict, repeats: int, folder: Path, env: dict, desc: str) -> dict[str, list[Path]]:
    """Run every variant ``repeats`` times, alternating (A B, then B A, ...), each in a fresh process.

    ``variants`` maps a name to ``command(out_dir) -> list[str]``; run i of a variant writes ``folder/<name>_<i>``
    and logs to ``folder/<name>_<i>.log``. Returns each variant's results folders, in order.
    """
    from tqdm.auto import tqdm

    done = {name: [] for name in variants}
    names = list(variants)
    with tqdm(total=repeats * len(names), desc=desc, unit="run", file=sys.stdout) as bar:
        for repeat in range(1, repeats + 1):
            for name in names if repeat % 2 else reversed(names):
                bar.set_postfix_str(f"{name} {repeat}/{repeats}")
                out = folder / f"{name}_{repeat}"
                run_logged(variants[name](out), folder / f"{name}_{repeat}.log", env)
                done[name].append(out)
                bar.update()
    return done


def median(values) -> float:
    return statistics.median(values)


def ratio_row(benchmark: str, figure: str, measured: str, baseline: str, ratio: float, *, target: float | None = None,
              at_most: bool = False, cpu_ratio: float | None = None, detail: str = "") -> dict:
    """One line of the results table: ``measured`` / ``baseline`` of ``figure``, and whether it meets the target."""
    met = None if target is None else (ratio <= target if at_most else ratio >= target)
    return {"benchmark": benchmark, "figure": figure, "measured": measured, "baseline": baseline, "ratio": ratio,
            "cpu_time_ratio": cpu_ratio, "target": None if target is None else f"{'<=' if at_most else '>='} {target}",
            "met": met, "detail": detail}


def render_table(rows: list[dict], markdown: bool = False) -> str:
    """The ratio rows as a text table (terminal) or a markdown one (README)."""
    from my_utils.tools.compare import markdown_table, text_table

    def verdict(r):
        return "-" if r["target"] is None else f"{r['target']} {'met' if r['met'] else 'MISSED'}"

    return (markdown_table if markdown else text_table)(
        ["benchmark", "ratio", "CPU-time est.", "target", "measured", "baseline", "figure"],
        [[r["benchmark"], f"{r['ratio']:.3f}", "-" if r["cpu_time_ratio"] is None else f"{r['cpu_time_ratio']:.3f}",
          verdict(r), r["measured"], r["baseline"], r["figure"] + (f" ({r['detail']})" if r["detail"] else "")]
         for r in rows])


def common_args(s: Settings) -> list[str]:
    return ["--preset", s.preset, *(["--random-init"] if s.random_init else []),
            *(["--data-file", s.data_file] if s.data_file else [])]


def course_args(s: Settings, out: Path, batch_size: int, num_processes: int | None = None) -> list[str]:
    """The LoRA workflow's command line: training only is timed, so generation is skipped and the held-out
    set is small (at least one batch per process: the workflow drops incomplete batches)."""
    return [*common_args(s), "--max-steps", s.steps, "--batch-size", batch_size, "--skip-generation-eval",
            "--mixed-precision", "bf16" if s.bf16 else "no",
            "--eval-rows", 64, "--logging-steps", logging_steps(s.steps), "--output-dir", out,
            *(["--num-processes", num_processes] if num_processes else [])]


def logging_steps(steps: int) -> int:
    return max(1, steps // 8)


def preset_batch(s: Settings) -> int:
    from my_utils.core.presets import get_preset

    return s.batch_size or get_preset(s.preset).batch_size


def course_figures(out: Path) -> dict:
    """A LoRA workflow run's training figures: its summary and the per-rank timing written by ``run-course``."""
    summary = read_json(out / "summary.json")
    ranks = [read_json(p) for p in sorted((out / "timing").glob("rank_*.json"))]

    def over_ranks(figures):  # tokens of every rank, per second of the slowest (wall) and busiest (CPU) one
        tokens = sum(f["tokens"] for f in figures)
        return {"tokens": tokens, "padded_tokens": sum(f["padded_tokens"] for f in figures),
                "tokens_per_s": tokens / max(f["runtime_s"] for f in figures),
                "cpu_tokens_per_s": tokens / max(f["cpu_s"] for f in figures)}

    return {**over_ranks(ranks), "steady": over_ranks([r["steady"] for r in ranks]),
            "summary_tokens_per_s": summary["tokens_per_s"], "runtime_s": summary["runtime_s"],
            "world_size": summary["world_size"], "settings": ranks[0]["settings"],
            "losses": [m["loss"] for m in _metrics(out) if "loss" in m], "eval_loss": summary["eval_loss"]}


def _metrics(out: Path) -> list[dict]:
    from my_utils.run.results import load_run

    return load_run(out)["metrics"]


def throughput_ratio(measured: list[dict], baseline: list[dict], rate: str = "tokens_per_s",
                     cpu_rate: str = "cpu_tokens_per_s") -> tuple[float, float]:
    """(wall-clock, CPU-time) ratio of the median rates (useful tokens/s by default) of two lists of runs."""
    wall = median(r[rate] for r in measured) / median(r[rate] for r in baseline)
    cpu = median(r[cpu_rate] for r in measured) / median(r[cpu_rate] for r in baseline)
    return wall, cpu


def useful_fraction(runs: list[dict]) -> float:
    return sum(r["tokens"] for r in runs) / sum(r["padded_tokens"] for r in runs)


# ---------------------------------------------------------------------------------------------------------------
# The benchmarks: each takes the settings and its results folder, returns (summary, ratio rows)


def bench_overhead(s: Settings, folder: Path):
    """The LoRA workflow against a bare accelerate + peft loop, training time only."""
    batch = preset_batch(s)
    sampling = {}  # the workflow's batching, read from its first run, so that the bare loop batches the same way

    def course(out):
        return python_command("run-course", *course_args(s, out, batch))

    def bare(out):
        strategy = sampling.setdefault("strategy", course_figures(folder / "course_1")["settings"]["sampling"])
        return python_command("run-loop", *common_args(s), "--method", "lora", "--batch-size", batch,
                              "--steps", s.steps, "--sampling", strategy, "--logging-steps", logging_steps(s.steps),
                              "--output-dir", out)

    runs = alternate({"course": course, "bare": bare}, s.repeats_for("overhead"), folder, bench_env(s), "overhead")
    course_runs = [course_figures(p) for p in runs["course"]]
    bare_runs = [read_json(p / "summary.json") for p in runs["bare"]]
    wall, cpu = throughput_ratio(course_runs, bare_runs)
    steady_wall, steady_cpu = throughput_ratio([r["steady"] for r in course_runs], [r["steady"] for r in bare_runs])
    shape = f"{s.preset}, batch {batch}, {sampling['strategy']} batches"
    rows = [ratio_row("overhead", "useful tokens/s, training", "LoRA workflow (Trainer + callbacks)",
                      "bare accelerate + peft loop", wall, target=TARGETS["overhead"], cpu_ratio=cpu,
                      detail=f"{shape}, the whole training call, {s.steps} steps"),
            ratio_row("overhead", "useful tokens/s, training", "LoRA workflow (Trainer + callbacks)",
                      "bare accelerate + peft loop", steady_wall, target=TARGETS["overhead"], cpu_ratio=steady_cpu,
                      detail=f"{shape}, steady state: steps {WARMUP_STEPS + 1}-{s.steps}")]
    return {"course": course_runs, "bare": bare_runs, "sampling": sampling["strategy"]}, rows


def bench_trainer(s: Settings, folder: Path):
    """The LoRA workflow's defaults (and with ``--group-by-length``) against stock SFTTrainer on the same data."""
    batch = preset_batch(s)
    variants = {
        "course": lambda out: python_command("run-course", *course_args(s, out, batch)),
        "grouped": lambda out: python_command("run-course", *course_args(s, out, batch), "--group-by-length"),
        "sft": lambda out: python_command("run-sft", *common_args(s), "--batch-size", batch, "--steps", s.steps,
                                          "--logging-steps", logging_steps(s.steps), "--eval-rows", 64,
                                          "--output-dir", out),
    }
    runs = alternate(variants, s.repeats_for("trainer"), folder, bench_env(s), "trainer")
    found = {name: [course_figures(p) for p in runs[name]] for name in ("course", "grouped")}
    found["sft"] = sft_runs = [read_json(p / "summary.json") for p in runs["sft"]]
    held_out = {name: median(r["eval_loss"] for r in rs) for name, rs in found.items()}
    rows = []
    for name, label in (("course", "LoRA workflow defaults"), ("grouped", "LoRA workflow, --group-by-length")):
        wall, cpu = throughput_ratio(found[name], sft_runs)
        differs = ", ".join(f"{k}: {v}" for k, v in sft_runs[0]["stock_settings"].items()
                            if k != "find_unused_parameters" and found[name][0]["settings"].get(k) != v)
        rows += [
            ratio_row("trainer", "useful tokens/s, training", label, "stock trl SFTTrainer", wall,
                      target=TARGETS["trainer"] if name == "course" else None, cpu_ratio=cpu,
                      detail=f"useful/padded tokens {useful_fraction(found[name]):.2f} vs "
                             f"{useful_fraction(sft_runs):.2f}; stock {differs}"),
            ratio_row("trainer", "held-out loss after training", label, "stock trl SFTTrainer",
                      held_out[name] / held_out["sft"], target=1 + LOSS_TOLERANCE, at_most=True,
                      detail=f"{s.steps} steps, 64 held-out rows"),
        ]
    # The same random batches in the same order (both seed their sampler with the seed): the logged losses can be
    # compared window by window. Length-grouped batches cannot: each holds one length, so one kind of task.
    gap = trajectory_gap(found["course"], sft_runs)
    rows.append(ratio_row("trainer", "training loss, every logged window: 1 + largest relative gap",
                          "LoRA workflow defaults", "stock trl SFTTrainer", 1 + gap, target=1 + LOSS_TOLERANCE,
                          at_most=True, detail=f"{len(sft_runs[0]['losses'])} windows of {logging_steps(s.steps)} steps"))
    return {**found, "held_out_loss": held_out, "trajectory_gap": gap}, rows


def trajectory_gap(measured: list[dict], baseline: list[dict]) -> float:
    """The largest relative difference between two runs' logged training losses, window by window (the median
    run's curve of each side, taken point by point)."""
    curves = [[median(points) for points in zip(*(r["losses"] for r in runs))] for runs in (measured, baseline)]
    return max(abs(a / b - 1) for a, b in zip(*curves))


def process_scaling(folder: Path, command, figures, repeats: int, env: dict, desc: str) -> dict:
    """Alternate 1-process and 2-process runs of one workflow: ``command(processes, out)`` builds a run's command
    line, ``figures(out)`` reads from its results folder the ``world_size`` its workers saw, its ``rate``
    (samples/s, tokens/s...) and ``cpu_rate`` (the same per CPU-second of its busiest process). Returns both
    configurations' figures, the ratio of median rates (2 processes over 1) and the same from CPU time."""
    from my_utils.run.launch import check_process_count

    check_process_count(2)
    runs = alternate({"x1": lambda out: command(1, out), "x2": lambda out: command(2, out)}, repeats, folder, env, desc)
    found = {n: [figures(p) for p in runs[f"x{n}"]] for n in (1, 2)}
    for n, results in found.items():
        if any(r["world_size"] != n for r in results):
            raise RuntimeError(f"A run launched with {n} process(es) saw another world size; see its run.json.")
    wall, cpu = throughput_ratio(found[2], found[1], "rate", "cpu_rate")
    return {"x1": found[1], "x2": found[2], "ratio": wall, "cpu_time_ratio": cpu}


def bench_ddp(s: Settings, folder: Path):
    """The LoRA workflow on 2 processes x 1 thread against 1 process x 1 thread, same global batch."""
    from my_utils.run.launch import accelerate_command

    global_batch = 2 * preset_batch(s)

    def command(processes, out):
        return accelerate_command("my_utils.tools.bench", ["run-course", *course_args(
            s, out, global_batch // processes, num_processes=processes)], num_processes=processes)

    def figures(out):
        found = course_figures(out)
        return {**found, "rate": found["tokens_per_s"], "cpu_rate": found["cpu_tokens_per_s"]}

    result = process_scaling(folder, command, figures, s.repeats_for("ddp"), bench_env(s, threads=1), "ddp")
    rows = [ratio_row("ddp", "useful tokens/s, training", "LoRA workflow, 2 processes x 1 thread",
                      "1 process x 1 thread", result["ratio"], target=TARGETS["ddp"], cpu_ratio=result["cpu_time_ratio"],
                      detail=f"global batch {global_batch}, {s.steps} steps")]
    return result, rows


def bench_memory(s: Settings, folder: Path):
    """Peak memory of one training step: LoRA against full fine-tuning, gradient checkpointing on and off; 4-bit
    weights against bf16."""
    from tqdm.auto import tqdm

    from my_utils.core.devices import usable_cores

    env = bench_env(s, threads=usable_cores())  # one process at a time: memory is measured, time is secondary
    configs = {f"{method}{'_ckpt' if ckpt else ''}": (method, ckpt) for ckpt in (False, True) for method in ("full", "lora")}
    steps = {}
    for name, (method, ckpt) in tqdm(configs.items(), desc="memory", unit="run", file=sys.stdout):
        out = folder / name
        run_logged(python_command("run-step", "--preset", s.memory_preset, "--method", method, "--batch", s.memory_batch,
                                  "--seq", s.memory_seq, *(["--gradient-checkpointing"] if ckpt else []),
                                  "--output-dir", out), folder / f"{name}.log", env)
        steps[name] = read_json(out / "summary.json")
    qlora_out = folder / "qlora_weights"
    # exit code 1: a target missed, reported below like the others
    run_logged([sys.executable, str(REPO_ROOT / "bench" / "qlora_memory.py"), "--preset", s.qlora_preset,
                "--weights-only", "--output-dir", str(qlora_out)], folder / "qlora_weights.log", env, ok_codes=(0, 1))
    qlora = read_json(qlora_out / "summary.json")

    shape = f"{s.memory_preset}, batch {s.memory_batch} x {s.memory_seq}"
    peak = {k: v["peak_bytes"] for k, v in steps.items()}
    rows = [
        ratio_row("memory", "peak training memory", "LoRA r=8", "full fine-tuning", peak["lora"] / peak["full"],
                  target=TARGETS["lora_over_full_peak"], at_most=True, detail=f"{shape}, {steps['lora']['peak_what']}"),
        ratio_row("memory", "peak training memory", "LoRA r=8, checkpointed", "full fine-tuning, checkpointed",
                  peak["lora_ckpt"] / peak["full_ckpt"], detail=shape),
        ratio_row("memory", "peak training memory", "LoRA r=8, checkpointed", "full fine-tuning",
                  peak["lora_ckpt"] / peak["full"], detail=shape),
    ]
    for method in ("lora", "full"):
        plain, ckpt = steps[method], steps[f"{method}_ckpt"]
        rows += [
            ratio_row("memory", "activations kept for backward", f"{method}, checkpointed", f"{method}, not checkpointed",
                      ckpt["saved_activation_bytes"] / plain["saved_activation_bytes"], detail=shape),
            ratio_row("memory", "step time", f"{method}, checkpointed", f"{method}, not checkpointed",
                      ckpt["step_s"] / plain["step_s"], cpu_ratio=ckpt["step_cpu_s"] / plain["step_cpu_s"],
                      detail=f"{shape}, one step each"),
        ]
    rows.append(ratio_row("memory", "weights", "4-bit NF4 + double quantization", "bf16",
                          qlora["ratios"]["weights_4bit_over_bf16"], target=TARGETS["weights_4bit_over_bf16"],
                          at_most=True, detail=f"{s.qlora_preset}, bench/qlora_memory.py"))
    return {"steps": steps, "qlora_weights": qlora}, rows


def bench_mfu(s: Settings, folder: Path):
    """Model FLOPs utilization of LoRA and full fine-tuning against this machine's measured matmul peak."""
    out = folder / "mfu"
    steps = max(s.steps // 2, 4)
    run_logged(python_command("run-mfu", "--preset", s.preset, *(["--random-init"] if s.random_init else []),
                              "--batch-size", preset_batch(s), "--steps", steps,
                              "--output-dir", out), folder / "mfu.log", bench_env(s))
    result = read_json(out / "summary.json")
    peak = result["matmul_peak"]
    rows = []
    for method in ("lora", "full"):
        r = result[method]
        rows.append(ratio_row("mfu", "model FLOP/s", f"{method} training loop", f"matmul peak ({peak['what']})",
                              r["mfu"], cpu_ratio=r["mfu_cpu_time"],
                              detail=f"{r['flops_per_token'] / 1e6:.1f} MFLOP/token"
                                     + (f"; counted as 6N: {r['mfu_if_counted_as_6n']:.3f}" if method == "lora" else "")))
    return result, rows


RUNNERS = {"overhead": bench_overhead, "trainer": bench_trainer, "ddp": bench_ddp, "memory": bench_memory,
           "mfu": bench_mfu}


def run_benchmark(name: str, s: Settings, argv: list[str]) -> tuple[Path, list[dict]]:
    """Run one benchmark into a new results folder; returns the folder and its ratio rows."""
    folder = unique_dir(Path(s.output_root) / name)
    record = Run.create(folder, config=asdict(s), command=["python", "-m", "my_utils", "bench", *argv],
                        benchmark=name, load_average_before=os.getloadavg(), devices=_devices())
    try:
        result, rows = RUNNERS[name](s, folder)
    except KeyboardInterrupt as e:
        record.fail(f"interrupted: {e}", status="interrupted")
        raise
    except BaseException as e:
        record.fail(f"{type(e).__name__}: {e}")
        raise
    record.update(load_average_after=os.getloadavg())
    record.finish({"benchmark": name, "ratios": rows, **result})
    return folder, rows


def _devices() -> list[dict]:
    from my_utils.core.devices import device_inventory

    return device_inventory()


# ---------------------------------------------------------------------------------------------------------------
# Measured pieces, each run in a fresh process by the benchmarks above


@dataclass
class LoopConfig:
    preset: str = "tiny"
    method: str = "lora"  # lora | full
    rank: int = 8
    batch_size: int | None = None
    max_length: int | None = None
    steps: int = 40
    warmup_steps: int = 2  # steps before the steady-state window (the whole loop is timed too)
    logging_steps: int = 5
    sampling: str = "random"  # random | group_by_length (the Trainer's names)
    random_tokens: bool = False  # blocks of max_length random tokens (no padding, no tokenizer) instead of data
    learning_rate: float | None = None  # default: the preset's (LoRA), a tenth of it (full), as the workflow
    random_init: bool = False
    data_file: str | None = None
    seed: int = 0


def bare_loop(cfg: LoopConfig) -> dict:
    """A bare accelerate + peft training loop: plain DataLoader, AdamW, the preset's schedule with 5 % warm-up,
    gradient clipping at 1 (the workflow's settings, so that both do the same arithmetic). Returns its figures: the whole
    loop from ``accelerator.prepare`` (as Trainer.train is timed) and the steady state after ``warmup_steps``."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, RandomSampler
    from transformers import get_scheduler
    from transformers.trainer_pt_utils import LengthGroupedSampler

    from my_utils.core.data import load_instructions, padding_collator, tokenize_instructions
    from my_utils.core.models import add_lora, build_causal_lm, load_tokenizer, set_threads
    from my_utils.core.presets import get_preset
    from my_utils.run.callbacks import TokenCounter

    preset = get_preset(cfg.preset)
    set_threads()
    set_seed(cfg.seed)
    accelerator = Accelerator()  # device and mixed precision from the launcher's environment
    batch_size = cfg.batch_size or preset.batch_size
    max_length = cfg.max_length or preset.max_length
    model = build_causal_lm(preset, random_init=cfg.random_init)
    if cfg.random_tokens:  # FLOPs do not depend on the tokens' values: any architecture, offline
        ids = torch.randint(0, model.config.vocab_size, (batch_size * (cfg.steps + 1), max_length),
                            generator=torch.Generator().manual_seed(cfg.seed))
        data = [{"input_ids": x, "labels": x} for x in ids]
        collate = BlockCounter()
    else:
        tokenizer = load_tokenizer(preset)
        rows, _ = load_instructions(preset.instruction_data, eval_rows=1, path=cfg.data_file)
        data = tokenize_instructions(rows, tokenizer, max_length)
        collate = TokenCounter(padding_collator(tokenizer))
    generator = torch.Generator().manual_seed(cfg.seed)
    if cfg.sampling == "group_by_length":
        sampler = LengthGroupedSampler(batch_size, lengths=[len(x["input_ids"]) for x in data], generator=generator)
    else:
        sampler = RandomSampler(data, generator=generator)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, collate_fn=collate, drop_last=True)

    if cfg.method == "lora":
        model = add_lora(model, cfg.rank, targets=preset.lora_targets)
    flops = model_flops_per_token(model, max_length, cfg.method)
    learning_rate = cfg.learning_rate or (preset.learning_rate if cfg.method == "lora" else preset.learning_rate / 10)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=learning_rate,
                                  weight_decay=0.0)
    scheduler = get_scheduler(preset_schedule(preset), optimizer, num_warmup_steps=math.ceil(0.05 * cfg.steps),
                              num_training_steps=cfg.steps)

    def sync():
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize(accelerator.device)

    started, cpu_started = time.perf_counter(), time.process_time()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    batches = _forever(loader)
    losses, window_loss = [], torch.zeros((), device=accelerator.device)
    for step in range(1, cfg.steps + 1):
        if step == cfg.warmup_steps + 1:
            sync()
            # the collator has made this step's batch already (accelerate fetches one ahead), as in the Trainer
            # at the end of the step before: the workflow's window starts at the same point
            window = _window_start(collate)
        batch = next(batches)
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window_loss += loss.detach()
        if step % cfg.logging_steps == 0:
            losses.append(window_loss.item() / cfg.logging_steps)
            window_loss.zero_()
    sync()
    # tokens are counted as the workflow counts them: every batch the collator made (one look-ahead included)
    whole = _window_end({"wall": started, "cpu": cpu_started, "tokens": 0, "padded_tokens": 0}, collate)
    return {
        "method": cfg.method, "batch_size": batch_size, "max_length": max_length, "steps": cfg.steps,
        "warmup_steps": cfg.warmup_steps, "sampling": cfg.sampling, "random_tokens": cfg.random_tokens,
        "mixed_precision": accelerator.mixed_precision, "device": str(accelerator.device),
        "threads": torch.get_num_threads(), "learning_rate": learning_rate,
        **whole, "steady": _window_end(window, collate), "losses": losses, **flops,
    }


class BlockCounter:
    """Stacks blocks of equal length and counts their tokens (the attributes of ``TokenCounter``). Blocks need
    no padding, hence no attention mask, and without a mask the attention takes its causal fast path."""

    def __init__(self):
        self.tokens = self.padded_tokens = 0

    def __call__(self, rows):
        from torch.utils.data import default_collate

        batch = default_collate(rows)
        self.tokens += batch["input_ids"].numel()
        self.padded_tokens = self.tokens
        return batch


def _window_start(counter) -> dict:
    return {"wall": time.perf_counter(), "cpu": time.process_time(), "tokens": counter.tokens,
            "padded_tokens": counter.padded_tokens}


def _window_end(start: dict, counter) -> dict:
    """Seconds, CPU seconds, useful and padded tokens since ``start``, and the rates they make."""
    seconds, cpu_seconds = time.perf_counter() - start["wall"], time.process_time() - start["cpu"]
    tokens, padded = counter.tokens - start["tokens"], counter.padded_tokens - start["padded_tokens"]
    return {"runtime_s": seconds, "cpu_s": cpu_seconds, "tokens": tokens, "padded_tokens": padded,
            "tokens_per_s": tokens / seconds, "cpu_tokens_per_s": tokens / cpu_seconds,
            "processed_tokens_per_s": padded / seconds, "processed_tokens_per_cpu_s": padded / cpu_seconds}


def preset_schedule(preset) -> str:
    """The learning-rate schedule the LoRA workflow uses by default for ``preset``."""
    return getattr(preset, "lr_scheduler", "cosine")


def _forever(loader):
    while True:
        yield from loader


def model_flops_per_token(model, seq_len: int, method: str) -> dict:
    """Training FLOPs per token (see the module's docstring): full 6 N + 12 L d s, LoRA 4 N + 6 N_a + 12 L d s."""
    n, n_adapters = matmul_weights(model)
    config = model.config
    attention = 12 * config.num_hidden_layers * config.hidden_size * seq_len
    if method == "full":
        per_token = 6 * n + attention
    else:
        per_token = 4 * n + 6 * n_adapters + attention
    return {"matmul_weights": n, "adapter_weights": n_adapters, "flops_per_token": per_token,
            "flops_per_token_as_6n": 6 * (n + n_adapters) + attention}


def matmul_weights(model) -> tuple[int, int]:
    """(N, N_a): weights of the matrix multiplications a token goes through (linear layers, GPT-2's Conv1D, the
    output layer, counted once even when tied to the embedding), and those of LoRA adapters among them."""
    import torch
    from transformers.pytorch_utils import Conv1D

    n = n_adapters = 0
    seen = set()
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.Linear, Conv1D)) or id(module.weight) in seen:
            continue
        seen.add(id(module.weight))
        if ".lora_A." in name or ".lora_B." in name:
            n_adapters += module.weight.numel()
        else:
            n += module.weight.numel()
    return n, n_adapters


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


# --- the commands behind the measured runs


def course_main(argv) -> None:
    """``run-course``: the LoRA workflow unchanged (its command line), with Trainer.train's wall and CPU seconds,
    the tokens its collator made and the settings that decide speed written per rank to <output-dir>/timing/."""
    from accelerate import PartialState
    from transformers import Trainer, TrainerCallback

    from my_utils.run.results import atomic_write_json
    from my_utils.workflows import lora

    cfg = lora.parse_args(argv)
    if cfg.output_dir is None:
        raise UserError("run-course needs --output-dir, where it writes each rank's timing.")
    measured = {}
    train = Trainer.train

    class SteadyState(TrainerCallback):
        """Starts the steady-state window at the end of step WARMUP_STEPS (as the bare loop does)."""

        def __init__(self, counter):
            self.counter = counter

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == WARMUP_STEPS:
                measured["window"] = _window_start(self.counter)

    def timed_train(trainer, *args, **kwargs):
        counter = trainer.data_collator
        trainer.add_callback(SteadyState(counter))
        start = _window_start(counter)
        result = train(trainer, *args, **kwargs)
        # the workflow zeroes its counter when training begins: the whole call counts from zero
        measured.update(_window_end({**start, "tokens": 0, "padded_tokens": 0}, counter),
                        steady=_window_end(measured.pop("window"), counter), settings=_speed_settings(trainer.args))
        return result

    Trainer.train = timed_train  # this process only: the workflow's own code runs as it is
    lora.train(cfg)
    rank = PartialState().process_index
    (Path(cfg.output_dir) / "timing").mkdir(exist_ok=True)
    atomic_write_json(Path(cfg.output_dir) / "timing" / f"rank_{rank}.json", {"rank": rank, **measured})


def _speed_settings(args) -> dict:
    """The TrainingArguments that decide speed, under the names the results table uses."""
    return {"sampling": args.train_sampling_strategy, "gradient_checkpointing": bool(args.activation_checkpointing),
            "mixed_precision": "bf16" if args.bf16 else "fp16" if args.fp16 else args.mixed_precision,
            "find_unused_parameters": args.ddp_find_unused_parameters}


def loop_main(argv) -> None:
    """``run-loop``: the bare accelerate + peft loop, into a results folder."""
    p = argparse.ArgumentParser(prog="python -m my_utils.tools.bench run-loop", description=bare_loop.__doc__)
    _add_fields(p, LoopConfig, choices={"method": ("lora", "full"), "sampling": ("random", "group_by_length")})
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)
    cfg = LoopConfig(**{f.name: getattr(args, f.name) for f in fields(LoopConfig)})
    if cfg.steps <= cfg.warmup_steps:
        raise UserError(f"--steps must be above --warmup-steps ({cfg.warmup_steps}): the steady state comes after it.")
    _recorded_run(args.output_dir, asdict(cfg), lambda: bare_loop(cfg))


def sft_main(argv) -> None:
    """``run-sft``: stock trl SFTTrainer (SFTConfig's defaults) on the workflow's model, data, batch, steps and
    learning-rate schedule, with LoRA from the same function; training time and tokens measured as the workflow's."""
    p = argparse.ArgumentParser(prog="python -m my_utils.tools.bench run-sft", description=sft_main.__doc__)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument("--eval-rows", type=int, default=64)
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--data-file", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)
    _recorded_run(args.output_dir, vars(args), lambda: stock_sft(args))


def stock_sft(args) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from my_utils.core.data import format_prompt, load_instructions
    from my_utils.core.models import add_lora, build_causal_lm, load_tokenizer, set_threads
    from my_utils.core.presets import get_preset
    from my_utils.run.callbacks import TokenCounter
    from my_utils.run.launch import is_cpu_only

    preset = get_preset(args.preset)
    set_threads()
    tokenizer = load_tokenizer(preset)
    train_rows, eval_rows = load_instructions(preset.instruction_data, eval_rows=args.eval_rows, seed=args.seed,
                                              path=args.data_file)

    def prompt_completion(rows):  # trl's prompt-completion format: the loss is on the completion only, as ours
        return Dataset.from_list([{"prompt": format_prompt(r), "completion": r["output"]} for r in rows])

    model = add_lora(build_causal_lm(preset, random_init=args.random_init), 8, targets=preset.lora_targets)
    config = SFTConfig(
        output_dir=str(Path(args.output_dir) / "trainer"),
        per_device_train_batch_size=args.batch_size or preset.batch_size,
        per_device_eval_batch_size=args.batch_size or preset.batch_size,
        learning_rate=preset.learning_rate, lr_scheduler_type=preset_schedule(preset), warmup_steps=0.05,
        max_steps=args.steps,
        max_length=preset.max_length, logging_steps=args.logging_steps, save_strategy="no", report_to="none",
        seed=args.seed, use_cpu=is_cpu_only(),
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=prompt_completion(train_rows),
                         eval_dataset=prompt_completion(eval_rows), processing_class=tokenizer)
    counter = trainer.data_collator = TokenCounter(trainer.data_collator)
    started, cpu_started = time.perf_counter(), time.process_time()
    trainer.train()
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    tokens, padded = counter.tokens, counter.padded_tokens  # before the evaluation's batches add to them
    eval_loss = trainer.evaluate().get("eval_loss")
    return {
        "stock_settings": _speed_settings(trainer.args), "runtime_s": seconds, "cpu_s": cpu_seconds,
        "tokens": tokens, "padded_tokens": padded, "tokens_per_s": tokens / seconds, "cpu_tokens_per_s": tokens / cpu_seconds,
        "losses": [r["loss"] for r in trainer.state.log_history if "loss" in r], "eval_loss": eval_loss,
    }


def step_main(argv) -> None:
    """``run-step``: one measured training step (memory and time) in this fresh process, into a results folder."""
    p = argparse.ArgumentParser(prog="python -m my_utils.tools.bench run-step", description=measured_step.__doc__)
    p.add_argument("--preset", default="gpt2", help="architecture, built with random weights from its config")
    p.add_argument("--method", choices=("lora", "full"), default="lora")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)
    _recorded_run(args.output_dir, vars(args), lambda: measured_step(args.preset, args.method, args.batch, args.seq,
                                                                    args.gradient_checkpointing))


def measured_step(preset_name: str, method: str, batch: int, seq: int, gradient_checkpointing: bool) -> dict:
    """One AdamW step of ``batch`` x ``seq`` random tokens after a small warm-up step (so that AdamW's states
    exist, as in every step but the first, and the code the step runs is loaded), with the peak counters reset
    just before it. The peak: on CUDA, peak allocated memory; on a CPU, the weights and AdamW's states (from their
    tensors) plus how far the RSS rose above its level at the start of the step (activations, gradients,
    temporaries), so that neither the libraries' memory nor code loaded on first use counts as training memory.
    bf16 autocast when the benchmark runs in bf16 (by default where the device computes it natively, as the LoRA
    workflow)."""
    import gc
    from contextlib import nullcontext

    import torch

    from my_utils.core.devices import per_rank_device
    from my_utils.core.memory import peak_bytes, reset_peak, snapshot
    from my_utils.core.models import add_lora, build_causal_lm, set_threads
    from my_utils.core.presets import get_preset
    from my_utils.run.callbacks import SavedActivations, gradient_bytes, model_weight_bytes, optimizer_state_bytes

    preset = get_preset(preset_name)
    set_threads()
    torch.manual_seed(0)
    device = per_rank_device()
    before_model = snapshot(device)
    model = build_causal_lm(preset, random_init=True).to(device)
    if gradient_checkpointing:
        model.config.use_cache = False
        model.activation_checkpointing_enable({"use_reentrant": False})  # works with frozen inputs (LoRA)
    if method == "lora":
        model = add_lora(model, 8, targets=preset.lora_targets)
    model.train()
    bf16 = os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16"  # set by ``bench_env``, as for every measured run
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if bf16 else nullcontext()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    vocab = model.config.vocab_size

    def step(ids, saved=None):
        with autocast, saved or nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = gradient_bytes(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return grads

    step(torch.randint(0, vocab, (1, 8), device=device))  # creates AdamW's states
    gc.collect()
    reset_peak(device)
    begin = snapshot(device)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    saved = SavedActivations(model)
    started, cpu_started = time.perf_counter(), time.process_time()
    gradients = step(ids, saved)
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    end = snapshot(device)
    on_cuda = end["peak_allocated"] is not None
    weights, states = model_weight_bytes(model), optimizer_state_bytes(optimizer)
    return {
        "preset": preset_name, "method": method, "batch": batch, "seq": seq,
        "gradient_checkpointing": gradient_checkpointing, "precision": "bf16 autocast" if bf16 else "fp32",
        "threads": torch.get_num_threads(), "device": device,
        "weight_bytes": weights, "gradient_bytes": gradients, "optimizer_state_bytes": states,
        "saved_activation_bytes": saved.bytes,
        "peak_bytes": peak_bytes(end) if on_cuda else weights + states + max(0, end["peak_rss"] - begin["rss"]),
        "peak_what": "peak allocated" if on_cuda else "weights + AdamW states + RSS rise during the step",
        "peak_rss_above_process_before_model": end["peak_rss"] - before_model["rss"],
        "process_before_model": before_model, "begin": begin, "end": end,
        "step_s": seconds, "step_cpu_s": cpu_seconds,
    }


def mfu_main(argv) -> None:
    """``run-mfu``: the matmul peak, LoRA and full fine-tuning loops on random-token blocks, the peak again."""
    p = argparse.ArgumentParser(prog="python -m my_utils.tools.bench run-mfu", description=mfu_main.__doc__)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=20, help=f"timed steps of each loop (after {WARMUP_STEPS} warm-up steps)")
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)
    _recorded_run(args.output_dir, vars(args), lambda: measure_mfu(args))


def measure_mfu(args) -> dict:
    import torch
    from accelerate import PartialState

    from my_utils.core.models import set_threads

    set_threads()
    device = str(PartialState().device)
    bf16 = os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    peaks = [matmul_peak(device, dtype)]
    result = {}
    for method in ("lora", "full"):
        loop = bare_loop(LoopConfig(preset=args.preset, method=method, batch_size=args.batch_size,
                                    random_tokens=True, steps=args.steps + WARMUP_STEPS, warmup_steps=WARMUP_STEPS,
                                    logging_steps=args.steps + WARMUP_STEPS, random_init=args.random_init))
        peaks.append(matmul_peak(device, dtype))
        result[method] = loop
    peak = {"what": f"{peaks[0]['dtype']} {peaks[0]['n']}x{peaks[0]['n']} matmul, "
                    f"{torch.get_num_threads() if not device.startswith('cuda') else 1} "
                    f"{'thread(s)' if not device.startswith('cuda') else 'GPU'}",
            "flops_per_s": median(pk["flops_per_s"] for pk in peaks),
            "flops_per_cpu_s": median(pk["flops_per_cpu_s"] for pk in peaks), "measurements": peaks}
    for loop in result.values():  # the steady state: after the warm-up steps
        tokens_per_s, tokens_per_cpu_s = loop["steady"]["tokens_per_s"], loop["steady"]["cpu_tokens_per_s"]
        loop["model_flops_per_s"] = tokens_per_s * loop["flops_per_token"]
        loop["mfu"] = loop["model_flops_per_s"] / peak["flops_per_s"]
        loop["mfu_cpu_time"] = tokens_per_cpu_s * loop["flops_per_token"] / peak["flops_per_cpu_s"]
        loop["mfu_if_counted_as_6n"] = tokens_per_s * loop["flops_per_token_as_6n"] / peak["flops_per_s"]
    return {"matmul_peak": peak, **result}


def _recorded_run(output_dir: str, config: dict, body) -> None:
    """Create the results folder, run ``body`` and write its figures as summary.json (failed/interrupted else)."""
    from my_utils.run.lifecycle import recorded
    from my_utils.run.results import check_new_run_dir

    run = Run.create(check_new_run_dir(output_dir), config=config)
    with recorded(run):
        run.finish(body())


def _add_fields(parser, cls, choices: dict) -> None:
    """One --option per field of a config dataclass (booleans become flags)."""
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true")
        else:
            kind = type(default) if default is not None else (float if f.name == "learning_rate" else
                                                             int if f.name in ("batch_size", "max_length") else str)
            parser.add_argument(flag, type=kind, default=default, choices=choices.get(f.name))


WORKERS = {"run-course": course_main, "run-loop": loop_main, "run-sft": sft_main, "run-step": step_main,
           "run-mfu": mfu_main}


# ---------------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None) -> tuple[list[str], Settings]:
    from my_utils.core.devices import native_bf16

    p = argparse.ArgumentParser(prog="python -m my_utils bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default all): {', '.join(BENCHMARKS)}")
    defaults = Settings()
    p.add_argument("--quick", action="store_true", help="a smoke run: few steps, one repeat, the tiny model")
    p.add_argument("--preset", default=defaults.preset, help="model and data of overhead, trainer, ddp and mfu")
    p.add_argument("--random-init", action="store_true", help="random weights from the preset's shipped config")
    p.add_argument("--data-file", default=None, help="JSON-lines instruction data instead of the preset's")
    p.add_argument("--memory-preset", default=defaults.memory_preset, help="architecture of the memory benchmark")
    p.add_argument("--qlora-preset", default=defaults.qlora_preset, help="architecture of the 4-bit measurement")
    p.add_argument("--batch-size", type=int, default=None, help="per process (default: the preset's)")
    p.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps per training run")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"runs of each configuration (default {', '.join(f'{k} {v}' for k, v in REPEATS.items())})")
    p.add_argument("--threads", type=int, default=defaults.threads, help="intra-op threads per process on a CPU")
    p.add_argument("--memory-batch", type=int, default=defaults.memory_batch)
    p.add_argument("--memory-seq", type=int, default=defaults.memory_seq)
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="auto: bf16 mixed precision where the device computes it natively (the LoRA workflow's "
                   "default), else fp32")
    p.add_argument("--output-root", default=str(BENCH_ROOT), help="where the results folders go")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        raise UserError(f"Unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHMARKS)}.")
    from my_utils.run.config import check_positive

    for name in ("steps", "threads", "memory_batch", "memory_seq", "repeats", "batch_size"):
        if getattr(args, name) is not None:
            check_positive(f"--{name.replace('_', '-')}", getattr(args, name))
    if args.steps <= 2 * WARMUP_STEPS:
        raise UserError(f"--steps {args.steps} leaves too few steps after the {WARMUP_STEPS} warm-up steps; "
                        f"use --steps {2 * WARMUP_STEPS + 1} or more.")
    if args.precision == "bf16" and not native_bf16():
        raise UserError("This device has no native bf16 arithmetic, so bf16 would only be slower; use --precision "
                        "auto or fp32.")
    bf16 = native_bf16() if args.precision == "auto" else args.precision == "bf16"
    from my_utils.core.presets import get_preset

    for name in (args.preset, args.memory_preset, args.qlora_preset):
        get_preset(name).require("causal")
    settings = Settings(**{f.name: getattr(args, f.name) for f in fields(Settings) if hasattr(args, f.name)}, bf16=bf16)
    return list(dict.fromkeys(args.names or BENCHMARKS)), (quick_settings(settings) if args.quick else settings)


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in WORKERS:
        return WORKERS[argv[0]](argv[1:])
    names, settings = parse_args(argv)
    rows, folders = [], []
    for name in names:
        folder, found = run_benchmark(name, settings, argv)
        rows += found
        folders.append(folder)
        print(f"{name}: {folder}", flush=True)
    print("\n" + render_table(rows))
    print("\nresults folders:\n" + "\n".join(f"  {f}" for f in folders))
    return rows


if __name__ == "__main__":
    from my_utils.run.cli import run_main

    run_main(lambda: main(), prefix="my_utils.tools.bench")
