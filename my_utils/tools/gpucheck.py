"""``python -m my_utils gpucheck``: the course on one CUDA GPU in one command, into one results folder.

    python -m my_utils gpucheck --output-dir runs/reference/gpu_x1   # one GPU: about 5 minutes
    python -m my_utils gpucheck --quick --output-dir /tmp/check      # any machine: tiny sizes, a minute or two
    python -m my_utils gpucheck --dry-run                            # what would run here, and what would be skipped
    python -m my_utils gpucheck --collect runs/reference/gpu_x1      # its figures and checks again, with this code

What it runs, each command a fresh process (its results folder and log inside the check's folder):

    tests      the GPU tests that fit one GPU (pytest -m gpu; those needing 2 GPUs skip themselves)
    series     the single-process workflows on the tiny preset: LoRA (mixed precision left to auto), LoRA in fp16,
               full fine-tuning, 8-bit and 4-bit QLoRA (bitsandbytes' CUDA kernels), classification; the memory
               callbacks' columns, the planner against each run's tensors, QLoRA's quality against LoRA's
    qlora      the opt-350m architecture loaded in 8 and 4 bits: the weights by tensors and by CUDA's allocator
               against the arithmetic, one QLoRA step's trainable state against full fine-tuning's
    planner    one training step of gpt2, smollm2-135m and opt-350m (random weights), LoRA and full, with the chunked
               loss and the plain one: each part against the planner, and CUDA's peak allocated against its total
    mfu        model FLOP/s of LoRA and full fine-tuning loops (gpt2, smollm2-135m; SDPA attention) against the
               matmul peak measured here and the GPU's published bf16 peak; run alone, before everything else

A part that cannot run here (no CUDA, one GPU for a lesson that needs several) is skipped with a one-line reason;
every other command runs, in parallel where it measures memory rather than time. summary.json holds each part's
figures and a list of checks (claim, measured, holds); the command exits 1 if a command failed or a check did
not hold, after writing everything.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from my_utils import UserError
from my_utils.core.devices import cuda_available, device_inventory, fast_bf16, usable_cores
from my_utils.core.memory import format_bytes
from my_utils.core.paths import REPO_ROOT, RUNS_ROOT
from my_utils.core.records import label_of
from my_utils.core.stats import difference, mean_interval
from my_utils.core.tables import markdown_table, text_table
from my_utils.run.config import OneLineParser, check_positive
from my_utils.run.launch import clean_env
from my_utils.run.lifecycle import recorded
from my_utils.run.results import Run, atomic_write_json, check_new_run_dir, git_state, now, read_json, unique_dir
from my_utils.tools.bench.memory import planner_ratios
from my_utils.tools.bench.qlora import TARGETS
from my_utils.tools.planner import compare_with_run, plan, plan_for_run

PARTS = ("tests", "series", "qlora", "planner", "mfu")
# Dense bf16 matrix throughput from the vendor's datasheet, by a name torch reports; the first match counts.
PUBLISHED_BF16_PEAK = (("H200", 989.4e12), ("H100 PCIe", 756.0e12), ("H100 NVL", 835.0e12), ("H100", 989.4e12),
                       ("A100", 312.0e12), ("L40S", 362.05e12), ("L4", 121.0e12), ("A10G", 70.0e12))
PLANNER_TOLERANCE = 0.15  # each part of a step's tensors against the plan, as the memory benchmark checks it
QUALITY_RUNS = ("lora", "qlora_8bit", "qlora_4bit")
EXTRA_SEEDS = (1, 2)  # beside the default seed 0
ONE_GPU_REASON = ("the lessons on several processes (02, 03, 05, 08, 09, 10, 11's DDP and pipeline) need a device per "
                  "process for nccl; on one GPU they run as make test runs them, over gloo on the CPU")


@dataclass
class Job:
    """One command of the check, run as a fresh process into ``<check>/<part>/<name>``."""

    part: str
    name: str
    args: list[str]  # after ``python``; "{out}" stands for the job's results folder
    env: dict = field(default_factory=dict)
    alone: bool = False  # measures time: runs before the others, by itself
    timeout_s: int = 420
    ok_codes: tuple = (0,)  # exit codes of a command that ran to the end (run-qlora: 1 when a target is missed)
    skip: str | None = None  # why it does not run here
    result: dict = field(default_factory=dict)  # status, seconds, returncode, reason


def published_peak(name: str) -> float | None:
    """The GPU's published dense bf16 FLOP/s, or None for a device the table does not know."""
    return next((peak for key, peak in PUBLISHED_BF16_PEAK if key in name), None)


def plan_jobs(cuda: bool, quick: bool, bf16: bool) -> list[Job]:
    """Every command of the check, in order; those that cannot run here carry their ``skip`` reason."""
    workflow = [sys.executable, "-m"]
    bench = [sys.executable, "-m", "my_utils", "bench"]
    short = ["--max-steps", "2", "--eval-rows", "4", "--max-new-tokens", "4"] if quick else []
    precision = {"ACCELERATE_MIXED_PRECISION": "bf16" if bf16 else "no"}
    no_cuda = None if cuda else "no CUDA device here"
    jobs = [Job("tests", "pytest", [*workflow, "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "--junitxml",
                                    "{out}/junit.xml", "tests/test_gpu.py", "tests/test_chunked_loss.py"],
                skip=no_cuda or ("--quick runs no tests" if quick else None))]
    lora = [*workflow, "my_utils.workflows.lora", "--preset", "tiny", *short, "--output-dir", "{out}"]
    levers = None if cuda else "a GPU's figure (lesson 15 measures the levers on a CPU)"
    for name, extra, skip in (("lora", [], None), ("lora_fp16", ["--mixed-precision", "fp16"],
                                                   None if cuda else "fp16 mixed precision needs a GPU"),
                              ("lora_compile", ["--compile"], levers),
                              ("lora_checkpointing", ["--gradient-checkpointing"], levers),
                              ("full", ["--method", "full"], None), ("qlora_8bit", ["--quantize", "8bit"], None),
                              ("qlora_4bit", ["--quantize", "4bit"], None)):
        jobs.append(Job("series", name, lora + extra, skip=skip))
        if name in QUALITY_RUNS:  # QLoRA's quality against LoRA's, with the spread of seeds beside it
            jobs += [Job("series", f"{name}_seed{seed}", lora + extra + ["--seed", str(seed)],
                         skip="--quick runs one seed" if quick else None) for seed in EXTRA_SEEDS]
    jobs.append(Job("series", "classification", [*workflow, "my_utils.workflows.classification", "--preset", "tiny",
                                                 *(["--max-steps", "2", "--eval-rows", "16"] if quick else []),
                                                 "--output-dir", "{out}"]))
    jobs.append(Job("qlora", "opt-350m" if not quick else "tiny",
                    [*bench, "run-qlora", "--preset", "tiny" if quick else "opt-350m", "--output-dir", "{out}"],
                    ok_codes=(0, 1)))
    presets = ("tiny",) if quick else ("gpt2", "smollm2-135m", "opt-350m")
    losses = ("chunked",) if quick else ("chunked", "plain")
    for preset in presets:
        for method in ("lora", "full"):
            for loss in losses:
                jobs.append(Job("planner", f"{preset}_{method}_{loss}",
                                [*bench, "run-step", "--preset", preset, "--method", method,
                                 *(["--local-batch-size", "2", "--max-length", "64"] if quick else []),
                                 *(["--plain-loss"] if loss == "plain" else []), "--output-dir", "{out}"],
                                env=precision))
    for preset in ("tiny",) if quick else ("gpt2", "smollm2-135m"):
        for batch in (4,) if quick else (16, 64):  # a batch that leaves a large GPU mostly idle, and one that less so
            jobs.append(Job("mfu", f"{preset}_b{batch}", [*bench, "run-mfu", "--preset", preset, "--random-init",
                                                          "--local-batch-size", str(batch), "--steps", "4" if quick else "10",
                                                          "--output-dir", "{out}"], env=precision, alone=True))
    return jobs


def run_job(job: Job, folder: Path, env: dict, deadline: float) -> None:
    """Run ``job`` unless its reason to skip, or the time left, says otherwise; records the outcome in
    ``job.result``."""
    if job.skip:
        job.result = {"status": "skipped", "reason": job.skip}
        return
    left = deadline - time.monotonic()
    if left < 10:
        job.result = {"status": "skipped", "reason": "out of time (--budget-s)"}
        return
    out = folder / job.part / job.name
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [a.replace("{out}", str(out)) for a in job.args]
    if job.part == "tests":
        out.mkdir()
    log = folder / job.part / f"{job.name}.log"
    started = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(["python", *cmd[1:]]) + "\n")
        f.flush()
        try:
            code = subprocess.run(cmd, env={**env, **job.env}, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=min(job.timeout_s, left)).returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = round(time.perf_counter() - started, 1)
    if code in job.ok_codes:
        job.result = {"status": "ok", "seconds": seconds}
        return
    tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:] or [""]
    job.result = {"status": "failed", "seconds": seconds, "returncode": code,
                  "reason": "timed out" if code is None else tail[0][-300:]}


def check_something_ran(jobs: list[Job]) -> None:
    """One sentence (UserError) when every command was skipped: a check that ran nothing has checked nothing."""
    if all(job.result["status"] == "skipped" for job in jobs):
        reasons = sorted({job.result["reason"] for job in jobs})
        raise UserError(f"The GPU check ran none of its {len(jobs)} commands ({'; '.join(reasons)}), so it checked "
                        "nothing; raise --budget-s (a command needs 10 s or more to start) or run it where its parts "
                        "can run.")


def run_jobs(jobs: list[Job], folder: Path, parallel: int, budget_s: float, threads: int) -> None:
    """The timing jobs one at a time, first; then the rest, ``parallel`` at a time; a progress bar over all."""
    from tqdm.auto import tqdm

    env = clean_env(HF_HUB_OFFLINE=1, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=threads,
                    PYTHONUNBUFFERED=1)
    deadline = time.monotonic() + budget_s
    with tqdm(total=len(jobs), desc="gpucheck", unit="command", file=sys.stdout) as bar:
        def one(job):
            run_job(job, folder, env, deadline)
            bar.set_postfix_str(f"{job.part}/{job.name} {job.result['status']}")
            bar.update()

        for job in (j for j in jobs if j.alone):
            one(job)
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            list(pool.map(one, [j for j in jobs if not j.alone]))


# ------------------------------------------------------------------------------------------------ the figures


def _summary(folder: Path, job: Job) -> dict | None:
    path = folder / job.part / job.name / "summary.json"
    return read_json(path) if job.result.get("status") == "ok" and path.is_file() else None


def series_figures(run: dict) -> dict:
    """A workflow run's figures (``run``: its run.json and summary.json): its method as tables label it, precision,
    losses and quality, speed, CUDA's memory columns, the planner."""
    summary = run["summary"]
    figures = {"label": label_of(run["run"], summary)} | {key: summary.get(key) for key in (
        "method", "mixed_precision", "steps", "eval_loss_before", "eval_loss", "exact_match_before",
        "exact_match_after", "accuracy_before", "accuracy_after", "train_loss_first", "train_loss_final", "runtime_s", "tokens_per_s",
        "peak_memory_bytes", "quantization", "compiled_graphs") if key in summary}
    memory = summary.get("memory") or []
    columns = ("allocated", "reserved", "peak_allocated", "peak_reserved")
    on_cuda = bool(memory) and memory[0]["end"]["device"].startswith("cuda")  # a CPU has no allocator's columns
    figures["memory_columns_filled"] = None if not on_cuda else all(
        report[moment] is not None and all(report[moment][c] is not None for c in columns)
        for report in memory for moment in ("begin", "first_step", "end") if moment in report)
    if summary.get("workflow") == "lora":
        rows = compare_with_run(run)
        figures["planned_over_measured"] = {row.component: row.ratio for row in rows}
        planned = plan_for_run(run)
        peak = memory[0]["end"]["peak_allocated"] if memory else None
        figures["planned_peak"] = planned.peak
        figures["planned_peak_over_peak_allocated"] = planned.peak / peak if peak else None
    return figures


def step_figures(step: dict) -> dict:
    """A measured step's parts against the planner, and CUDA's peak allocated against the plan's total."""
    p = plan(step["preset"], step["method"], batch_size=step["batch"], max_length=step["seq"],
             device="cuda" if step["device"].startswith("cuda") else "cpu",
             dtype="bf16" if step["precision"].startswith("bf16") else "fp32",
             gradient_checkpointing=step["gradient_checkpointing"], chunked_loss=step["chunked_loss"])
    return {"precision": step["precision"], "batch": [step["batch"], step["seq"]], "peak_what": step["peak_what"],
            "peak_bytes": step["peak_bytes"], "planned_peak": p.peak, "planned_peak_over_peak": p.peak / step["peak_bytes"],
            "planned_over_measured": planner_ratios(step), "step_s": step["step_s"]}


def mfu_figures(result: dict, device_name: str) -> dict:
    published = published_peak(device_name)
    figures = {"matmul_peak": result["matmul_peak"]["flops_per_s"], "matmul_peak_what": result["matmul_peak"]["what"],
               "published_bf16_peak": published}
    for method in ("lora", "full"):
        loop = result[method]
        figures[method] = {"model_flops_per_s": loop["model_flops_per_s"], "mfu": loop["mfu"],
                           "mfu_of_published": loop["model_flops_per_s"] / published if published else None,
                           "tokens_per_s": loop["steady"]["tokens_per_s"], "flops_per_token": loop["flops_per_token"],
                           "attention": loop.get("attention"), "mixed_precision": loop["mixed_precision"],
                           "batch": [loop["batch_size"], loop["max_length"]]}
    return figures


def qlora_figures(result: dict) -> dict:
    figures = {key: result.get(key) for key in ("total_params", "weights_bf16", "weights_8bit", "weights_4bit",
                                                 "weights_8bit_predicted", "weights_4bit_predicted",
                                                 "allocated_8bit", "allocated_4bit", "ratios", "device")}
    for bits in (8, 4):
        if result.get(f"allocated_{bits}bit"):
            figures[f"allocated_over_predicted_{bits}bit"] = (result[f"allocated_{bits}bit"]
                                                              / result[f"weights_{bits}bit_predicted"])
        figures[f"measured_over_predicted_{bits}bit"] = (result[f"weights_{bits}bit"]
                                                         / result[f"weights_{bits}bit_predicted"])
    for step in ("lora", "full"):
        if step in result:
            figures[step] = result[step]
    return figures


def collect(jobs: list[Job], folder: Path, cuda: bool, quick: bool, device_name: str) -> tuple[dict, list[dict]]:
    """Each part's outcome and figures, and the checks of what the course claims on this device."""
    parts = {name: {"commands": {}} for name in PARTS}
    for job in jobs:
        entry = dict(job.result)
        found = _summary(folder, job)
        if found is not None and job.part == "series":  # a workflow run's figures read its run.json too
            found = {"run": read_json(folder / job.part / job.name / "run.json"), "summary": found}
        if found is not None:
            try:
                entry["figures"] = {"series": series_figures, "planner": step_figures, "qlora": qlora_figures,
                                    "mfu": lambda r: mfu_figures(r, device_name)}[job.part](found) \
                    if job.part != "tests" else None
            except Exception as e:  # a figure that cannot be read is a finding, not a crash of the whole check
                entry.update(status="failed", reason=f"its figures could not be read: {type(e).__name__}: {e}")
        if job.part == "tests" and job.result.get("status") in ("ok", "failed"):
            entry["figures"] = junit_counts(folder / "tests" / job.name / "junit.xml")
        parts[job.part]["commands"][job.name] = entry
    if cuda:
        parts["series"]["not run"] = ONE_GPU_REASON
    return parts, checks(parts, cuda, quick)


def junit_counts(path: Path) -> dict | None:
    """Passed, failed and skipped tests, and the failed ones' names, from pytest's JUnit XML."""
    import xml.etree.ElementTree as ET

    if not path.is_file():
        return None
    cases = ET.parse(path).getroot().iter("testcase")
    outcome = {"passed": [], "failed": [], "skipped": []}
    for case in cases:
        kind = "failed" if case.find("failure") is not None or case.find("error") is not None else \
            "skipped" if case.find("skipped") is not None else "passed"
        outcome[kind].append(f"{case.get('classname')}::{case.get('name')}")
    return {"passed": len(outcome["passed"]), "failed": outcome["failed"], "skipped": len(outcome["skipped"])}


def seed_losses(runs: dict) -> dict[str, list[float]]:
    """The held-out losses of each of ``QUALITY_RUNS`` over its seeds (the run and its ``_seed<n>`` copies)."""
    return {name: [f["eval_loss"] for n, f in runs.items() if n == name or n.startswith(f"{name}_seed")]
            for name in QUALITY_RUNS if name in runs}


def checks(parts: dict, cuda: bool, quick: bool) -> list[dict]:
    """What the course claims, each with the figure that shows it and whether it holds here."""
    found = []

    def figures(part, name):
        return (parts[part]["commands"].get(name) or {}).get("figures")

    def check(claim, measured, holds):
        found.append({"claim": claim, "measured": measured, "holds": bool(holds)})

    tests = figures("tests", "pytest")
    if tests:
        check("the GPU tests that fit one GPU pass", f"{tests['passed']} passed, {len(tests['failed'])} failed, "
              f"{tests['skipped']} skipped", tests["passed"] > 0 and not tests["failed"])
    runs = {name: f for name, c in parts["series"]["commands"].items() if (f := c.get("figures"))}
    if cuda and runs:  # every run: a workflow on a GPU that reported no memory is a finding too
        empty = [n for n, f in runs.items() if not f["memory_columns_filled"]]
        check("the memory callbacks fill allocated, reserved and both peaks at every moment of every rank's report",
              f"{len(runs) - len(empty)} of {len(runs)} runs filled" + (f"; empty: {', '.join(empty)}" if empty else ""),
              not empty)
    if cuda and "lora" in runs:
        check("mixed precision auto picks bf16 on a GPU with bf16", runs["lora"]["mixed_precision"],
              runs["lora"]["mixed_precision"] == "bf16")
    if "lora_fp16" in runs:
        f = runs["lora_fp16"]
        check("LoRA trains in fp16 mixed precision (the gradient scaler's path)",
              f"held-out loss {f['eval_loss_before']:.3f} -> {f['eval_loss']:.3f}",
              math.isfinite(f["eval_loss"]) and f["eval_loss"] < f["eval_loss_before"])
    if "lora" in runs and "lora_compile" in runs:  # the levers on a GPU, against LoRA's run as it is
        eager, compiled = runs["lora"], runs["lora_compile"]
        check("torch.compile (--compile) trains LoRA as eager does on a GPU, the graphs counted",
              f"{compiled['compiled_graphs']} graph(s); held-out loss {compiled['eval_loss']:.4f} against "
              f"{eager['eval_loss']:.4f}; tokens/s {compiled['tokens_per_s'] / eager['tokens_per_s']:.2f}x eager's "
              "(its first steps compile)",
              (compiled["compiled_graphs"] or 0) >= 1 and abs(compiled["eval_loss"] / eager["eval_loss"] - 1) <= 0.01)
    if "lora" in runs and "lora_checkpointing" in runs:
        eager, recomputed = runs["lora"], runs["lora_checkpointing"]
        check("activation checkpointing lowers LoRA's peak on a GPU and leaves its loss",
              f"peak {recomputed['peak_memory_bytes'] / eager['peak_memory_bytes']:.2f}x; tokens/s "
              f"{recomputed['tokens_per_s'] / eager['tokens_per_s']:.2f}x; held-out loss {recomputed['eval_loss']:.4f} "
              f"against {eager['eval_loss']:.4f}",
              recomputed["peak_memory_bytes"] < eager["peak_memory_bytes"]
              and abs(recomputed["eval_loss"] / eager["eval_loss"] - 1) <= 0.01)
    losses = seed_losses(runs)
    if "lora" in losses and len(losses) > 1 and not quick:  # two steps of --quick teach the tiny model nothing
        versus = {n: difference(v, losses["lora"]) for n, v in losses.items() if n != "lora" and len(v) > 1}
        check(f"QLoRA's held-out loss over {len(losses['lora'])} seeds ends within the noise between seeds of LoRA's "
              "on unquantized weights",
              f"LoRA {mean_interval(losses['lora'])}; minus LoRA's: "
              + ", ".join(f"{n} {d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]" for n, d in versus.items()),
              bool(versus) and not any(d.excludes(0) for d in versus.values()))
    planned = {f"series/{n}": f["planned_over_measured"] for n, f in runs.items() if "planned_over_measured" in f}
    planned.update({f"planner/{n}": c["figures"]["planned_over_measured"]
                    for n, c in parts["planner"]["commands"].items() if c.get("figures")})
    if planned:
        worst = max(((n, part, r) for n, ratios in planned.items() for part, r in ratios.items()),
                    key=lambda x: abs(x[2] - 1))
        check(f"the planner predicts every part of every step's tensors within {PLANNER_TOLERANCE:.0%}",
              f"{len(planned)} runs; worst {worst[0]} {worst[1]}: {worst[2]:.3f} of measured",
              abs(worst[2] - 1) <= PLANNER_TOLERANCE)
    qlora = next((c.get("figures") for c in parts["qlora"]["commands"].values() if c.get("figures")), None)
    if qlora and not quick:  # the targets are opt-350m's; --quick measures the tiny model
        for key, target in TARGETS.items():
            if key in qlora["ratios"]:
                check(f"{key.replace('_', ' ')} <= {target}", f"{qlora['ratios'][key]:.4f}",
                      qlora["ratios"][key] <= target)
    return found


# ------------------------------------------------------------------------------------------------ the report


def report(parts: dict, found: list[dict], markdown: bool = False) -> str:
    """The check as tables (the terminal's, or markdown for the README): the commands (terminal only), the series,
    one step's tensors against the planner, QLoRA's weights, MFU, and the checks."""
    table = markdown_table if markdown else text_table
    lines = []

    def section(title, headers, rows):
        if rows:
            lines.extend([f"**{title}**" if markdown else title + ":", "" if markdown else None, table(headers, rows),
                          ""])

    if not markdown:
        lines += [text_table(["part", "command", "status", "seconds", "reason"],
                             [[part, name, c["status"], f"{c.get('seconds', '-')}", c.get("reason", "")[:70]]
                              for part, entry in parts.items() for name, c in entry["commands"].items()]), ""]
    section("the series on the tiny preset",
            ["run", "precision", "held-out", "peak", "memory columns", "planned / measured: weights grads AdamW act."],
            [[n, f.get("mixed_precision", "-"), _before_after(f), format_bytes(f.get("peak_memory_bytes")),
              {True: "filled", False: "EMPTY", None: "- (CPU)"}[f["memory_columns_filled"]],
              " ".join(f"{r:.3f}" for r in f["planned_over_measured"].values()) if "planned_over_measured" in f
              else "-"] for n, c in parts["series"]["commands"].items() if (f := c.get("figures"))])
    section("one training step (random weights), planned / measured",
            ["step", "batch", "precision", "weights", "grads", "AdamW", "saved act.", "peak", "plan / peak"],
            [[n, "x".join(map(str, f["batch"])), f["precision"], *(f"{r:.3f}" for r in f["planned_over_measured"].values()),
              f"{format_bytes(f['peak_bytes'])} ({f['peak_what']})", f"{f['planned_peak_over_peak']:.3f}"]
             for n, c in parts["planner"]["commands"].items() if (f := c.get("figures"))])
    section("QLoRA's weights (bf16 checkpoint loaded through bitsandbytes)",
            ["preset", "weights", "by tensors", "by the allocator", "arithmetic", "x bf16"],
            [[n, name, format_bytes(f[f"weights_{key}"]), format_bytes(f.get(f"allocated_{key}")),
              format_bytes(f.get(f"weights_{key}_predicted")), f"{f[f'weights_{key}'] / f['weights_bf16']:.3f}"]
             for n, c in parts["qlora"]["commands"].items() if (f := c.get("figures"))
             for name, key in (("bf16", "bf16"), ("8-bit", "8bit"), ("4-bit NF4", "4bit"))
             if f.get(f"weights_{key}")])
    section("model FLOPs utilization (bf16, random tokens)",
            ["model", "batch", "method", "attention", "tokens/s", "model TFLOP/s", "of the measured matmul peak",
             "of the published bf16 peak"],
            [[n.rsplit("_b", 1)[0], "x".join(map(str, f[m]["batch"])), m, f[m]["attention"] or "-",
              f"{f[m]['tokens_per_s']:,.0f}", f"{f[m]['model_flops_per_s'] / 1e12:.1f}", f"{f[m]['mfu']:.3f}",
              f"{f[m]['mfu_of_published']:.3f}" if f[m]["mfu_of_published"] else "-"]
             for n, c in parts["mfu"]["commands"].items() if (f := c.get("figures")) for m in ("lora", "full")])
    if markdown:
        section("checks", ["claim", "measured", "holds"],
                [[c["claim"], c["measured"], "yes" if c["holds"] else "NO"] for c in found])
    else:
        lines += ["checks:"] + [f"  {'holds' if c['holds'] else 'FAILS'}: {c['claim']} ({c['measured']})"
                                for c in found]
    return "\n".join(line for line in lines if line is not None).rstrip()


def _before_after(f: dict) -> str:
    """A run's held-out figure before and after training: loss (instruction tuning) or accuracy (classification)."""
    name = "eval_loss" if "eval_loss" in f else "accuracy_after"
    before = f["eval_loss_before"] if name == "eval_loss" else f["accuracy_before"]
    return f"{'loss' if name == 'eval_loss' else 'accuracy'} {before:.3f} -> {f[name]:.3f}"


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m my_utils gpucheck", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default=None,
                   help="the check's results folder (must not exist; default: a new one under runs/gpucheck/)")
    p.add_argument("--quick", action="store_true", help="tiny sizes everywhere and no tests: the check of the check")
    p.add_argument("--parallel", type=int, default=None,
                   help="commands at a time after the timing ones (default: 6 on a GPU, 2 on a CPU)")
    p.add_argument("--budget-s", type=float, default=480,
                   help="seconds after which no further command starts (each is skipped, saying so)")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would run and what would be skipped (with --collect: the figures and checks); "
                   "run and write nothing")
    p.add_argument("--collect", metavar="FOLDER", default=None,
                   help="read a finished check's folder again and rewrite its figures and checks with this code (its "
                   "commands' results are kept as they ran); runs nothing")
    args = p.parse_args(argv)
    if args.parallel is not None:
        check_positive("--parallel", args.parallel)
    check_positive("--budget-s", args.budget_s, float)
    return args


def collect_again(folder: str | Path, write: bool = True) -> tuple[dict, list[dict]]:
    """A finished check's figures and checks computed again from its commands' results folders with this code: what
    ran, and how each command ended, are kept; with ``write``, summary.json is rewritten and says when and by which
    commit (without, nothing is written)."""
    folder = Path(folder)
    try:
        summary = read_json(folder / "summary.json")
        saved = {(part, name): entry for part, e in summary["parts"].items() for name, entry in e["commands"].items()}
    except (OSError, ValueError, KeyError, AttributeError):
        raise UserError(f"{folder} holds no finished GPU check (its summary.json is missing or not a check's); "
                        "name the folder a `python -m my_utils gpucheck` run wrote.") from None
    jobs = [job for job in plan_jobs(summary["cuda"], summary["quick"], bf16=False) if (job.part, job.name) in saved]
    for job in jobs:
        job.result = {k: v for k, v in saved[job.part, job.name].items() if k != "figures"}
    parts, found = collect(jobs, folder, summary["cuda"], summary["quick"], summary["device"])
    if write:
        atomic_write_json(folder / "summary.json", {**summary, "parts": parts, "checks": found,
                                                    "collected_again": {"at": now(), **git_state()}})
    return parts, found


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.collect:
        parts, found = collect_again(args.collect, write=not args.dry_run)
        print(report(parts, found))
        return None
    cuda = cuda_available()
    devices = device_inventory()
    device_name = devices[-1]["name"]
    out = check_new_run_dir(args.output_dir) if args.output_dir else unique_dir(
        RUNS_ROOT / "gpucheck" / f"{'cuda' if cuda else 'cpu'}_x1")
    jobs = plan_jobs(cuda, args.quick, fast_bf16())
    if args.dry_run:
        for job in jobs:
            print(f"{job.part:<8} {job.name:<24} " + (f"skipped: {job.skip}" if job.skip else
                                                      " ".join(["python", *job.args[1:]]).replace("{out}", str(out / job.part / job.name))))
        return None
    parallel = args.parallel or (6 if cuda else min(2, usable_cores()))
    run = Run.create(out, config=vars(args), devices=devices, holds_runs=True)
    with recorded(run):
        started = time.perf_counter()
        run_jobs(jobs, out, parallel, args.budget_s, threads=max(1, usable_cores() // parallel))
        check_something_ran(jobs)
        parts, found = collect(jobs, out, cuda, args.quick, device_name)
        summary = {"device": device_name, "cuda": cuda, "quick": args.quick, "seconds": time.perf_counter() - started,
                   "parts": parts, "checks": found}
        run.finish(summary)
    print(report(parts, found))
    print(f"\nresults folder: {out}")
    failed = [f"{p}/{n}" for p, e in parts.items() for n, c in e["commands"].items() if c["status"] == "failed"]
    if failed or not all(c["holds"] for c in found):
        raise SystemExit(1)
    return None


if __name__ == "__main__":
    main()
