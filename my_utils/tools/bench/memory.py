"""``memory``: one training step of the gpt2 architecture (random weights, batch 4 x 256, one fresh process each):
LoRA's peak against full fine-tuning's, <= 0.5 (peak allocated on CUDA; on a CPU the weights and AdamW states plus
the RSS rise during the step), both with the course's chunked loss (``my_utils.core.chunked_loss``), and each
method's peak with it against the plain loss's; the same with gradient checkpointing on both; what checkpointing
saves (activations kept for backward) and costs (step time); and, through ``run-qlora --weights-only``
(``qlora.py``), 4-bit NF4 weights against bf16 on the opt-350m architecture, <= 0.35.

    python -m my_utils bench run-step --preset gpt2 --method full --output-dir DIR     # one measured step
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from my_utils.core.adapters import AdapterSpec
from my_utils.core.chunked_loss import use_chunked_loss
from my_utils.core.devices import per_rank_device, usable_cores
from my_utils.core.memory import peak_bytes, reset_peak, snapshot
from my_utils.core.models import add_adapter, build_causal_lm, set_threads
from my_utils.core.presets import get_preset
from my_utils.run.callbacks import SavedActivations, gradient_bytes, model_weight_bytes, optimizer_state_bytes
from my_utils.run.config import OneLineParser
from my_utils.run.launch import run_logged
from my_utils.run.results import read_json
from my_utils.tools.bench import qlora
from my_utils.tools.bench.harness import Settings, bench_env, python_command, ratio_row, recorded_run
from my_utils.tools.planner import plan

NAME = "memory"
HELP = ("one training step's peak memory, LoRA against full fine-tuning (gpt2 architecture), <= 0.5, with the "
        "chunked loss and the plain one, with and without gradient checkpointing, each step's tensors against the "
        "planner's, within 15%; 4-bit NF4 weights against bf16 (opt-350m), <= 0.35")
TARGETS = {"lora_over_full_peak": 0.5, "weights_4bit_over_bf16": qlora.TARGETS["weights_4bit_over_bf16"],
           "planner_error": 0.15}
ORDER = 40


def run(s: Settings, folder: Path):
    """Peak memory of one training step: LoRA against full fine-tuning, gradient checkpointing on and off; 4-bit
    weights against bf16."""
    env = bench_env(s, threads=usable_cores())  # one process at a time: memory is measured, time is secondary
    steps = _measured_steps(s, folder, env)
    weights = qlora.measure_in_fresh_process(s, folder / "qlora_weights", env, weights_only=True)
    shape = f"{s.memory_preset}, batch {s.memory_batch_size} x {s.memory_max_length}"
    peak = {k: v["peak_bytes"] for k, v in steps.items()}
    rows = [
        ratio_row(NAME, "peak training memory", "LoRA r=8", "full fine-tuning", peak["lora"] / peak["full"],
                  target=TARGETS["lora_over_full_peak"], at_most=True,
                  detail=f"{shape}, chunked loss, {steps['lora']['peak_what']}",
                  if_missed="on a CPU the peak holds the allocator's slack beside the tensors; CUDA's peak allocated "
                            "for the same steps is in python -m my_utils gpucheck"),
        ratio_row(NAME, "peak training memory", "LoRA r=8, plain loss", "full fine-tuning, plain loss",
                  peak["lora_plain"] / peak["full_plain"], detail=f"{shape}, the whole logits held"),
        *(ratio_row(NAME, "peak training memory", f"{method}, chunked loss", f"{method}, plain loss",
                    peak[method] / peak[f"{method}_plain"], detail=shape) for method in ("lora", "full")),
        ratio_row(NAME, "peak training memory", "LoRA r=8, checkpointed", "full fine-tuning, checkpointed",
                  peak["lora_ckpt"] / peak["full_ckpt"], detail=shape),
        ratio_row(NAME, "peak training memory", "LoRA r=8, checkpointed", "full fine-tuning",
                  peak["lora_ckpt"] / peak["full"], detail=shape),
    ]
    for method in ("lora", "full"):
        stored, ckpt = steps[method], steps[f"{method}_ckpt"]
        rows += [
            ratio_row(NAME, "activations kept for backward", f"{method}, checkpointed", f"{method}, not checkpointed",
                      ckpt["saved_activation_bytes"] / stored["saved_activation_bytes"], detail=shape),
            ratio_row(NAME, "step time", f"{method}, checkpointed", f"{method}, not checkpointed",
                      ckpt["step_s"] / stored["step_s"], cpu_ratio=ckpt["step_cpu_s"] / stored["step_cpu_s"],
                      detail=f"{shape}, one step each"),
        ]
    planned = {name: planner_ratios(step) for name, step in steps.items()}
    rows += [ratio_row(NAME, "planner's error: |planned / measured - 1|, worst part", f"python -m my_utils plan, {name}",
                       "the step's tensors", max(abs(r - 1) for r in ratios.values()),
                       target=TARGETS["planner_error"], at_most=True,
                       detail=", ".join(f"{part} {r:.3f}" for part, r in ratios.items()))
             for name, ratios in planned.items()]
    rows.append(qlora.weights_row(NAME, weights, s.qlora_preset))
    return {"steps": steps, "planned_over_measured": planned, "qlora_weights": weights}, rows


def planner_ratios(step: dict) -> dict[str, float]:
    """Planned / measured bytes of each part of a ``run-step`` (weights, gradients, AdamW states, saved
    activations), the plan made for the same architecture, method, batch, precision, checkpointing, loss and
    device."""
    p = plan(step["preset"], step["method"], batch_size=step["batch"], max_length=step["seq"],
             device="cuda" if step["device"].startswith("cuda") else "cpu",
             dtype="bf16" if step["precision"].startswith("bf16") else "fp32",
             gradient_checkpointing=step["gradient_checkpointing"], chunked_loss=step["chunked_loss"])
    return {"weights": p.weights / step["weight_bytes"], "gradients": p.gradients / step["gradient_bytes"],
            "AdamW states": p.optimizer / step["optimizer_state_bytes"],
            "saved activations": p.saved_activations / step["saved_activation_bytes"]}


def _measured_steps(s: Settings, folder: Path, env: dict) -> dict:
    """``run-step`` of full fine-tuning and LoRA: the course's step, with gradient checkpointing, with the plain
    loss; one process each."""
    from tqdm.auto import tqdm

    configs = {f"{method}{suffix}": (method, flags) for suffix, flags in
               (("", []), ("_ckpt", ["--gradient-checkpointing"]), ("_plain", ["--plain-loss"]))
               for method in ("full", "lora")}
    steps = {}
    for name, (method, flags) in tqdm(configs.items(), desc=NAME, unit="run", file=sys.stdout):
        out = folder / name
        run_logged(python_command("run-step", "--preset", s.memory_preset, "--method", method, "--local-batch-size",
                                  s.memory_batch_size, "--max-length", s.memory_max_length, *flags,
                                  "--output-dir", out), folder / f"{name}.log", env)
        steps[name] = read_json(out / "summary.json")
    return steps


def step_main(argv) -> None:
    """``run-step``: one measured training step (memory and time) in this fresh process, into a results folder."""
    p = OneLineParser(prog="python -m my_utils bench run-step", description=measured_step.__doc__)
    p.add_argument("--preset", default="gpt2", help="architecture, built with random weights from its config")
    p.add_argument("--method", choices=("lora", "full"), default="lora")
    p.add_argument("--local-batch-size", dest="batch_size", type=int, default=4)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--plain-loss", action="store_true", help="the whole logits at once, not the chunked loss")
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)
    recorded_run(args.output_dir, vars(args), lambda: measured_step(
        args.preset, args.method, args.batch_size, args.max_length, args.gradient_checkpointing,
        chunked_loss=not args.plain_loss))


def measured_step(preset_name: str, method: str, batch: int, seq: int, gradient_checkpointing: bool,
                  chunked_loss: bool = True) -> dict:
    """One AdamW step of ``batch`` x ``seq`` random tokens after a small warm-up step (so that AdamW's states
    exist, as in every step but the first, and the code the step runs is loaded), with the peak counters reset
    just before it. The peak: on CUDA, peak allocated memory; on a CPU, the weights and AdamW's states (from their
    tensors) plus how far the RSS rose above its level at the start of the step (activations, gradients,
    temporaries), so that neither the libraries' memory nor code loaded on first use counts as training memory.
    bf16 autocast when the benchmark runs in bf16 (by default where bf16 trains faster, as in the LoRA workflow), with
    the course's chunked loss unless ``chunked_loss`` is False."""
    import gc

    import torch

    set_threads()
    torch.manual_seed(0)
    device = per_rank_device()
    before_model = snapshot(device)
    model = _model(preset_name, method, gradient_checkpointing, device)
    chunked_loss = chunked_loss and use_chunked_loss(model)
    bf16 = os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16"  # set by ``bench_env``, as for every measured run
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    step = _step_function(model, optimizer, device, bf16)
    vocab = model.config.vocab_size
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
        "gradient_checkpointing": gradient_checkpointing, "chunked_loss": chunked_loss,
        "precision": "bf16 autocast" if bf16 else "fp32",
        "threads": torch.get_num_threads(), "device": device,
        "weight_bytes": weights, "gradient_bytes": gradients, "optimizer_state_bytes": states,
        "saved_activation_bytes": saved.bytes,
        "peak_bytes": peak_bytes(end) if on_cuda else weights + states + max(0, end["peak_rss"] - begin["rss"]),
        "peak_what": "peak allocated" if on_cuda else "weights + AdamW states + RSS rise during the step",
        "peak_rss_above_process_before_model": end["peak_rss"] - before_model["rss"],
        "process_before_model": before_model, "begin": begin, "end": end,
        "step_s": seconds, "step_cpu_s": cpu_seconds,
    }


def _model(preset_name: str, method: str, gradient_checkpointing: bool, device: str):
    """The preset's architecture with random weights on ``device``, checkpointed if asked, with LoRA r=8 or not."""
    preset = get_preset(preset_name)
    model = build_causal_lm(preset, random_init=True).to(device)
    model.config.use_cache = False  # as in training: a cache would keep a copy of every key and value besides
    if gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})  # works with frozen inputs (LoRA)
    if method == "lora":
        model = add_adapter(model, AdapterSpec(rank=8).resolved(preset.lora_targets))
    model.train()
    return model


def _step_function(model, optimizer, device: str, bf16: bool):
    """``step(ids, saved=None) -> gradient bytes``: one AdamW step on ``ids`` as labels too, under ``saved`` (a
    context that counts the activations kept for backward) and bf16 autocast if asked."""
    from contextlib import nullcontext

    import torch

    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if bf16 else nullcontext()

    def step(ids, saved=None):
        with autocast, saved or nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = gradient_bytes(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return grads

    return step


WORKERS = {"run-step": step_main}
