"""``qlora``: QLoRA memory on the opt-350m architecture, offline: the 4-bit NF4 (and 8-bit) weight footprint against
bf16, <= 0.35, and LoRA's trainable state on the 4-bit model against full fine-tuning's, <= 0.01.

    python -m my_utils bench run-qlora                     # the measurement alone, with its own report
    python -m my_utils bench run-qlora --rank 16 --output-dir runs/bench/qlora_memory/r16

The model is built from the shipped config (assets/configs/opt-350m) with random weights: memory depends on
shapes and dtypes, not on values. It is saved in bf16 with safetensors to a temporary folder and loaded back
through bitsandbytes (8-bit, and 4-bit NF4 with double quantization) onto the GPU when there is one (its CUDA
kernels), else the CPU, as a real checkpoint would be. Then one optimizer step (AdamW, a batch of 2 x 32 random
tokens) is taken twice: LoRA on the 4-bit model, and full fine-tuning of the float32 model. Every figure is
measured from the tensors themselves (weights with their quantization constants, gradients, AdamW states,
activations kept for backward), not from process memory, so phases run in one process without disturbing each
other; on a GPU, CUDA's allocator also gives what each load added (``allocated_8bit``, ``allocated_4bit``) and
each step's peak (``peak_allocated``). ``run-qlora`` exits with 1 when a target is missed;
``--weights-only`` stops after the weights (no training steps, about half the time: what ``memory`` runs).

Needs about 7 GB of RAM (the full fine-tuning step keeps 331M float32 weights, gradients and two AdamW states)
and runs in a few minutes on a CPU.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

from my_utils.core.adapters import AdapterSpec
from my_utils.core.devices import per_rank_device, usable_cores
from my_utils.core.memory import format_bytes, reset_peak, snapshot
from my_utils.core.models import add_adapter, build_causal_lm, quantization_config, set_threads
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.presets import get_preset
from my_utils.core.tables import text_table
from my_utils.run.callbacks import (SavedActivations, gradient_bytes, model_weight_bytes, optimizer_state_bytes,
                                    tensor_bytes)
from my_utils.run.config import OneLineParser
from my_utils.run.launch import run_logged
from my_utils.run.lifecycle import recorded
from my_utils.run.results import Run, check_new_run_dir, read_json, unique_dir
from my_utils.tools.bench.harness import Settings, bench_env, python_command, ratio_row

NAME = "qlora"
HELP = ("4-bit NF4 and 8-bit weights against bf16 (opt-350m), <= 0.35, and QLoRA's trainable state against full "
        "fine-tuning's, <= 0.01")
TARGETS = {"weights_4bit_over_bf16": 0.35, "lora_state_over_full_state": 0.01}  # each: at most
ORDER = 45


def run(s: Settings, folder: Path):
    """QLoRA's weights and trainable state against bf16 weights and full fine-tuning's state."""
    result = measure_in_fresh_process(s, folder / "qlora", bench_env(s, threads=usable_cores()))
    ratios = result["ratios"]
    rows = [weights_row(NAME, result, s.qlora_preset),
            ratio_row(NAME, "weights", "8-bit (LLM.int8)", "bf16", ratios["weights_8bit_over_bf16"],
                      detail=s.qlora_preset),
            ratio_row(NAME, "trainable state: parameters, gradients, AdamW states",
                      f"QLoRA r={result['lora_rank']} (4-bit base)", "full fine-tuning (float32)",
                      ratios["lora_state_over_full_state"], target=TARGETS["lora_state_over_full_state"], at_most=True,
                      detail=f"{s.qlora_preset}, one AdamW step of {result['batch'][0]} x {result['batch'][1]} tokens")]
    return {"qlora": result}, rows  # the measured run's figures, its own "ratios" included, apart from the rows


def measure_in_fresh_process(s: Settings, out: Path, env: dict, weights_only: bool = False) -> dict:
    """``run-qlora`` on ``s.qlora_preset`` into ``out`` (its log beside it); returns its figures."""
    # exit code 1: a target missed, which the table reports like any other
    run_logged(python_command("run-qlora", "--preset", s.qlora_preset, *(["--weights-only"] if weights_only else []),
                              "--output-dir", out), out.parent / f"{out.name}.log", env, ok_codes=(0, 1))
    return read_json(out / "summary.json")


def weights_row(benchmark: str, result: dict, preset: str) -> dict:
    return ratio_row(benchmark, "weights", "4-bit NF4 + double quantization", "bf16",
                     result["ratios"]["weights_4bit_over_bf16"], target=TARGETS["weights_4bit_over_bf16"],
                     at_most=True, detail=f"{preset}, run-qlora")


# --- the measurement, in the fresh process of ``run-qlora``


def measure(preset_name: str, rank: int, seq_len: int = 32, batch_size: int = 2, weights_only: bool = False) -> dict:
    import torch
    from tqdm import tqdm
    from transformers.utils.logging import disable_progress_bar

    preset = get_preset(preset_name)
    set_threads()
    disable_progress_bar()  # one bar for the phases instead of one per loaded tensor
    torch.manual_seed(0)
    device = per_rank_device()
    results = {"preset": preset_name, "lora_rank": rank, "device": device,
               "lora_targets": list(preset.lora_targets), "batch": [batch_size, seq_len]}
    phases = tqdm(total=3 if weights_only else 6, desc="bf16 build", unit="phase", file=sys.stdout)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        four_bit, vocab = _weights(preset, tmp, results, phases, device)
        if weights_only:
            phases.close()
            return _with_ratios(results, started)
        batch = {"input_ids": torch.randint(3, vocab, (batch_size, seq_len), device=device)}
        batch["labels"] = batch["input_ids"].clone()
        phases.set_description("QLoRA step")
        results["lora"] = one_step(add_adapter(four_bit, AdapterSpec(rank=rank).resolved(preset.lora_targets)), batch)
        del four_bit
        gc.collect()
        phases.update()

    phases.set_description("full step")
    full = build_causal_lm(preset, random_init=True, dtype=torch.float32).to(device)
    phases.update()
    results["full"] = one_step(full, batch)
    del full
    gc.collect()
    phases.update()
    phases.close()
    return _with_ratios(results, started)


def _weights(preset, tmp: str, results: dict, phases, device: str):
    """Build the architecture in bf16, save it to ``tmp``, load it back in 8 and 4 bits onto ``device``; every
    footprint (measured and predicted; on CUDA, what each load added to allocated memory) goes into ``results``.
    Returns the 4-bit model and the vocabulary size."""
    import torch
    from transformers import AutoModelForCausalLM

    model = build_causal_lm(preset, random_init=True, dtype=torch.bfloat16)
    results["total_params"] = sum(p.numel() for p in model.parameters())
    results["weights_bf16"] = model_weight_bytes(model)
    vocab = model.config.vocab_size
    model.save_pretrained(tmp, safe_serialization=True)
    del model
    gc.collect()
    phases.update()

    loaded = {}
    for bits in (8, 4):
        phases.set_description(f"{bits}-bit load")
        before = snapshot(device)["allocated"]
        loaded[bits] = AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=quantization_config(f"{bits}bit", compute_dtype=torch.bfloat16),
            dtype=torch.bfloat16, device_map={"": device})
        results[f"weights_{bits}bit"] = model_weight_bytes(loaded[bits])
        if before is not None:  # CUDA's allocator: None on a CPU
            results[f"allocated_{bits}bit"] = snapshot(device)["allocated"] - before
        phases.update()
    shapes = [(m.out_features, m.in_features) for m in loaded[8].modules() if type(m).__name__ == "Linear8bitLt"]
    results["quantized_params"] = sum(rows * cols for rows, cols in shapes)
    for bits in (8, 4):
        results[f"weights_{bits}bit_predicted"] = predicted_weight_bytes(results["total_params"], shapes, bits)
    del loaded[8]
    gc.collect()
    return loaded.pop(4), vocab


def predicted_weight_bytes(total_params: int, linear_shapes: list[tuple[int, int]], bits: int) -> int:
    """Arithmetic: the quantized linear layers' weights at ``bits`` per value plus their scales, every other
    parameter in bf16 (2 bytes)."""
    quantized = sum(rows * cols for rows, cols in linear_shapes)
    if bits == 4:  # an 8-bit scale per block of 64 values (double quantization), and a float32 per 256 scales
        scales = quantized // 64 + 4 * quantized // (64 * 256)
    else:  # a float32 scale per output row
        scales = 4 * sum(rows for rows, _ in linear_shapes)
    return quantized * bits // 8 + scales + 2 * (total_params - quantized)


def one_step(model, batch) -> dict:
    """One AdamW step on ``batch``; bytes of the trainable parameters, their gradients, the optimizer states
    and the activations kept for backward."""
    import torch

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    model.train()
    device = str(batch["input_ids"].device)
    reset_peak(device)
    with SavedActivations(model) as saved:
        loss = model(**batch).loss
    loss.backward()
    gradients = gradient_bytes(model)
    optimizer.step()
    figures = {
        "peak_allocated": snapshot(device)["peak_allocated"],  # None on a CPU
        "trainable_params": sum(p.numel() for p in trainable),
        "trainable_param_bytes": tensor_bytes(trainable),
        "gradient_bytes": gradients,
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "saved_activation_bytes": saved.bytes,
    }
    figures["trainable_state_bytes"] = (figures["trainable_param_bytes"] + gradients
                                        + figures["optimizer_state_bytes"])
    return figures


def _with_ratios(results: dict, started: float) -> dict:
    """Add the run's seconds, the ratios and the targets (those of the steps only when the steps ran)."""
    results["seconds"] = time.perf_counter() - started
    results["ratios"] = {
        "weights_4bit_over_bf16": results["weights_4bit"] / results["weights_bf16"],
        "weights_8bit_over_bf16": results["weights_8bit"] / results["weights_bf16"],
    }
    if "full" in results:
        results["ratios"]["lora_state_over_full_state"] = (results["lora"]["trainable_state_bytes"]
                                                           / results["full"]["trainable_state_bytes"])
        results["ratios"]["lora_params_over_full_params"] = (results["lora"]["trainable_params"]
                                                             / results["full"]["trainable_params"])
    results["targets"] = {k: {"at_most": v, "met": results["ratios"][k] <= v} for k, v in TARGETS.items()
                          if k in results["ratios"]}
    return results


def report(r: dict) -> str:
    """The figures as tables: the weights (measured, predicted, against bf16), one AdamW step's state, the targets."""
    weights = [[name, format_bytes(r[key]), format_bytes(r.get(f"{key}_predicted")) if r.get(f"{key}_predicted") else "-",
                f"{r[key] / r['weights_bf16']:.3f}"]
               for name, key in (("bf16", "weights_bf16"), ("8-bit (LLM.int8)", "weights_8bit"),
                                 ("4-bit NF4 + double quant", "weights_4bit"))]
    state = [[name, f"{s['trainable_params']:,}", format_bytes(s["trainable_param_bytes"]), format_bytes(s["gradient_bytes"]),
              format_bytes(s["optimizer_state_bytes"]), format_bytes(s["trainable_state_bytes"]),
              format_bytes(s["saved_activation_bytes"])]
             for name, s in ((f"QLoRA r={r['lora_rank']}", r.get("lora")), ("full (float32)", r.get("full"))) if s]
    checks = [f"{k}: {r['ratios'][k]:.4f} (target <= {t['at_most']}) {'OK' if t['met'] else 'MISSED'}"
              for k, t in r["targets"].items()]
    return "\n\n".join([
        f"{r['preset']}: {r['total_params']:,} parameters, {r['quantized_params']:,} of them in quantized linear layers",
        text_table(["weights", "measured", "predicted", "x bf16"], weights),
        *([text_table(["one AdamW step", "trainable", "params", "grads", "AdamW states", "trainable state",
                       f"activations ({r['batch'][0]}x{r['batch'][1]})"], state)] if state else []),
        "\n".join(checks),
    ])


def qlora_main(argv) -> None:
    """``run-qlora``: QLoRA's weights (and, unless --weights-only, one training step's state) against bf16 weights
    and full fine-tuning, into a results folder; prints a report; exit code 1 when a target is missed."""
    p = OneLineParser(prog="python -m my_utils bench run-qlora", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="opt-350m", help="preset whose architecture is built (random weights)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--output-dir", default=None, help="results folder (must not exist); default: a new one under "
                   "runs/bench/qlora_memory/")
    p.add_argument("--weights-only", action="store_true", help="measure the weights only, not the training steps")
    args = p.parse_args(argv)
    AdapterSpec(rank=args.rank).check()
    out = check_new_run_dir(args.output_dir) if args.output_dir else unique_dir(
        RUNS_ROOT / "bench" / "qlora_memory" / f"{args.preset}_r{args.rank}")
    run = Run.create(out, config=vars(args))
    with recorded(run):
        results = measure(args.preset, args.rank, weights_only=args.weights_only)
        run.finish(results)
    print(report(results))
    print(f"\nresults folder: {out}")
    if not all(t["met"] for t in results["targets"].values()):
        raise SystemExit(1)


WORKERS = {"run-qlora": qlora_main}
