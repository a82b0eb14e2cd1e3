"""LoRA, QLoRA or full fine-tuning of a causal LM on instruction data, on one or several processes.

One function, two launchers:

    # a shell, 2 processes on a CPU (gloo)
    accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.lora --preset tiny
    # the same with 4-bit QLoRA, or full fine-tuning
    accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.lora --preset tiny --quantize 4bit
    python -m my_utils.workflows.lora --preset tiny --method full
    # a notebook
    from my_utils.launch import launch; launch(train, Config(preset="tiny"), num_processes=2)

Every run writes a results folder (run.json, metrics.jsonl, summary.json, the adapter) and returns its summary:
exact match and a similarity score (chrF, one fixed scorer for every run) on held-out rows before and after
training, losses, runtime, samples/s, tokens/s, memory on every rank (allocated, reserved, peak, RSS, and a
breakdown into weights, gradients, optimizer states and activations), the first batch each rank trained on,
trainable parameters and adapter size.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from my_utils import UserError
from my_utils.runs import RUNS_ROOT

METHODS = ("lora", "full")


@dataclass
class Config:
    preset: str = "tiny"
    method: str = "lora"  # "lora" (adapters; with --quantize, QLoRA) or "full" (every weight trains)
    rank: int = 8
    alpha: float | None = None  # default 2 x rank
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None  # default: the preset's LoRA targets
    quantize: str = "none"  # none | 8bit | 4bit
    batch_size: int | None = None  # per process; default: the preset's
    grad_accum: int = 1
    learning_rate: float | None = None  # default: the preset's (for LoRA; full fine-tuning uses a tenth)
    lr_scaling: str = "none"  # none | linear | sqrt, from the preset's batch to the effective batch
    max_steps: int | None = None
    max_length: int | None = None
    eval_rows: int = 100
    max_new_tokens: int = 16
    gradient_checkpointing: bool = False
    seed: int = 0
    data_file: str | None = None  # a JSON-lines file with instruction, input, output
    output_dir: str | None = None  # default: runs/lora/<preset>_<method>
    num_processes: int | None = None  # what the launch asked for; checked inside every worker
    random_init: bool = False  # build the architecture from its shipped config (offline, no quality)
    logging_steps: int = 10
    skip_generation_eval: bool = False


def validate(cfg: Config):
    """Check the config before anything starts; returns the preset."""
    from my_utils.models import QUANTIZE_CHOICES, check_lora_args
    from my_utils.presets import get_preset
    from my_utils.training import LR_SCALING, check_positive

    preset = get_preset(cfg.preset)
    preset.require("causal")
    if cfg.method not in METHODS:
        raise UserError(f"Unknown method {cfg.method!r}; choose one of {', '.join(METHODS)}.")
    if cfg.quantize not in QUANTIZE_CHOICES:
        raise UserError(f"Unknown quantization {cfg.quantize!r}; choose one of {', '.join(QUANTIZE_CHOICES)}.")
    if cfg.quantize != "none" and cfg.method == "full":
        raise UserError("Quantized weights cannot be fully fine-tuned; use --method lora with --quantize (QLoRA).")
    if cfg.method == "lora":
        check_lora_args(cfg.rank, cfg.alpha)
    if cfg.lr_scaling not in LR_SCALING:
        raise UserError(f"Unknown learning-rate scaling {cfg.lr_scaling!r}; choose one of {', '.join(LR_SCALING)}.")
    for name in ("batch_size", "max_steps", "max_length"):
        if getattr(cfg, name) is not None:
            check_positive(f"--{name.replace('_', '-')}", getattr(cfg, name))
    for name in ("grad_accum", "eval_rows", "logging_steps"):
        check_positive(f"--{name.replace('_', '-')}", getattr(cfg, name))
    if cfg.learning_rate is not None:
        check_positive("--learning-rate", cfg.learning_rate, float)
    return preset


def train(cfg: Config) -> dict:
    """Fine-tune and evaluate; returns the summary (on every rank; rank 0 also writes it)."""
    from transformers import Trainer, TrainingArguments, set_seed

    from my_utils.callbacks import TokenCounter, gather_to_rank0, make_callbacks
    from my_utils.data import check_enough_rows, load_instructions, padding_collator, tokenize_instructions
    from my_utils.devices import device_inventory, per_rank_device, per_rank_device_map
    from my_utils.evaluation import SIMILARITY_SCORER
    from my_utils.launch import check_world_size, is_cpu_only
    from my_utils.memory import peak_bytes
    from my_utils.models import add_lora, build_causal_lm, count_parameters, folder_size, load_tokenizer, set_threads
    from my_utils.printing import print0
    from my_utils.training import open_run, recorded, scale_learning_rate

    preset = validate(cfg)
    world_size = check_world_size(cfg.num_processes)
    threads = set_threads()
    set_seed(cfg.seed)
    batch_size = cfg.batch_size or preset.batch_size
    max_length = cfg.max_length or preset.max_length
    effective_batch = batch_size * cfg.grad_accum * world_size
    base_lr = cfg.learning_rate or (preset.learning_rate if cfg.method == "lora" else preset.learning_rate / 10)
    learning_rate = scale_learning_rate(base_lr, effective_batch, preset.batch_size, cfg.lr_scaling)
    device = per_rank_device()

    tokenizer = load_tokenizer(preset)
    train_rows, eval_rows = load_instructions(preset.instruction_data, eval_rows=cfg.eval_rows, seed=cfg.seed,
                                              path=cfg.data_file)
    check_enough_rows(len(train_rows), effective_batch)
    train_set = tokenize_instructions(train_rows, tokenizer, max_length)
    eval_set = tokenize_instructions(eval_rows, tokenizer, max_length)

    default_dir = RUNS_ROOT / "lora" / f"{cfg.preset}_{cfg.method if cfg.quantize == 'none' else 'q' + cfg.quantize}"
    run, run_dir = open_run(cfg.output_dir, default_dir, asdict(cfg), world_size=world_size,
                            backend=_backend(), devices=device_inventory(), threads_per_process=threads)
    with recorded(run):
        model = build_causal_lm(preset, random_init=cfg.random_init, quantize=cfg.quantize,
                                device_map=per_rank_device_map() if cfg.quantize != "none" else None)
        if cfg.method == "lora":
            model = add_lora(model, cfg.rank, cfg.alpha, cfg.targets or preset.lora_targets, cfg.dropout)
        _keep_4bit_weights_trainable(model)
        params = count_parameters(model)
        print0(f"trainable parameters: {params['trainable']:,} of {params['total']:,} "
               f"({100 * params['trainable_fraction']:.2f}%)")

        before = _generation_eval(cfg, model.to(device), tokenizer, eval_rows)
        # Wraps the collator: counts tokens, and prints (with the rank prefix) and keeps each rank's first batch.
        counter = TokenCounter(padding_collator(tokenizer), tokenizer=tokenizer, preview_batches=1)
        memory_cb, metrics_cb = make_callbacks(run, device)
        args = TrainingArguments(
            output_dir=str(run_dir / "trainer"),
            per_device_train_batch_size=batch_size,
            per_device_eval_batch_size=batch_size,
            gradient_accumulation_steps=cfg.grad_accum,
            learning_rate=learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=0.05,
            max_steps=cfg.max_steps or preset.max_steps,
            logging_steps=cfg.logging_steps,
            save_strategy="no",
            report_to="none",
            use_cpu=is_cpu_only(),
            seed=cfg.seed,
            # LoRA leaves most parameters frozen but every trainable one is used each step, so DDP need not
            # search the graph for unused parameters (a full extra traversal per step).
            ddp_find_unused_parameters=False,
            activation_checkpointing=cfg.gradient_checkpointing,
            # Non-reentrant checkpointing works with frozen inputs (LoRA) and with DDP.
            activation_checkpointing_kwargs={"use_reentrant": False} if cfg.gradient_checkpointing else None,
            dataloader_drop_last=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=train_set, eval_dataset=eval_set,
                          data_collator=counter, callbacks=[c for c in (memory_cb, metrics_cb) if c])
        started = time.perf_counter()
        result = trainer.train()
        runtime = time.perf_counter() - started
        tokens = sum(gather_to_rank0(counter.tokens) or [0])
        first_batches = gather_to_rank0(counter.previews[0])
        eval_metrics = trainer.evaluate()
        model = trainer.model
        after = _generation_eval(cfg, model, tokenizer, eval_rows)

        summary = None
        if run is not None:
            adapter_bytes = None
            if cfg.method == "lora":
                model.save_pretrained(run_dir / "adapter", safe_serialization=True)
                adapter_bytes = folder_size(run_dir / "adapter")
            losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
            steps = result.global_step
            summary = {
                "workflow": "lora",
                "preset": cfg.preset,
                "method": cfg.method if cfg.quantize == "none" else f"qlora-{cfg.quantize}",
                "rank": cfg.rank if cfg.method == "lora" else None,
                "world_size": world_size,
                "backend": _backend(),
                "batch_size_per_process": batch_size,
                "grad_accum": cfg.grad_accum,
                "effective_batch": effective_batch,
                "learning_rate": learning_rate,
                "lr_scaling": cfg.lr_scaling,
                "steps": steps,
                "train_loss_first": losses[0] if losses else None,
                "train_loss_final": losses[-1] if losses else None,
                "eval_loss": eval_metrics.get("eval_loss"),
                "exact_match_before": (before or {}).get("exact_match"),
                "exact_match_after": (after or {}).get("exact_match"),
                "similarity_before": (before or {}).get("similarity"),
                "similarity_after": (after or {}).get("similarity"),
                "similarity_scorer": SIMILARITY_SCORER,
                "examples_after": (after or {}).get("examples"),
                "runtime_s": runtime,
                "samples_per_s": steps * effective_batch / runtime,
                "tokens_per_s": tokens / runtime,
                "trainable_params": params["trainable"],
                "total_params": params["total"],
                "adapter_bytes": adapter_bytes,
                "quantization": _quantization(model),
                "first_batches": first_batches,
                "memory": memory_cb.report,
                "peak_memory_bytes": max(peak_bytes(r["end"]) for r in memory_cb.report),
            }
            run.finish(summary)
            print0(f"results folder: {run_dir}")
        from accelerate.utils import broadcast_object_list

        summary = broadcast_object_list([summary])[0] if world_size > 1 else summary
    return summary


def _backend() -> str | None:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None


def _generation_eval(cfg, model, tokenizer, rows):
    """Exact match and similarity of greedy answers, on rank 0 (the other ranks wait); None when skipped."""
    from accelerate import PartialState

    from my_utils.evaluation import answer_quality

    state = PartialState()
    quality = None
    if not cfg.skip_generation_eval and state.is_main_process:
        quality = answer_quality(model, tokenizer, rows, max_new_tokens=cfg.max_new_tokens)
    state.wait_for_everyone()
    return quality


def _keep_4bit_weights_trainable(model) -> None:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference (AVX512-BF16 machines): it repacks
    them in the first forward without gradients (our evaluation before training), and training on repacked
    weights then fails. The evaluation uses the plain 4-bit kernel instead."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def _quantization(model) -> dict | None:
    """How the base weights were quantized (bits, type, double quantization, compute dtype), or None."""
    qconfig = getattr(model.config, "quantization_config", None)
    if qconfig is None:
        return None
    q = qconfig if isinstance(qconfig, dict) else qconfig.to_dict()
    if q.get("load_in_8bit"):
        return {"bits": 8, "type": "int8 (LLM.int8)", "double_quant": False, "compute_dtype": None}
    return {"bits": 4, "type": q.get("bnb_4bit_quant_type"), "double_quant": q.get("bnb_4bit_use_double_quant"),
            "compute_dtype": str(q.get("bnb_4bit_compute_dtype"))}


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(
        prog="python -m my_utils.workflows.lora",
        description="LoRA / QLoRA / full fine-tuning of a causal LM on instruction data. Writes a results folder "
        "and prints its summary. Launch with `accelerate launch --config_file configs/cpu_x2.yaml -m "
        "my_utils.workflows.lora ...` for several processes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = Config()
    p.add_argument("--preset", default=defaults.preset, help="tiny (offline CPU), gpt2, opt-350m")
    p.add_argument("--method", default=defaults.method, choices=METHODS)
    p.add_argument("--rank", type=int, default=defaults.rank, help="LoRA rank r")
    p.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    p.add_argument("--dropout", type=float, default=defaults.dropout, help="LoRA dropout")
    p.add_argument("--targets", nargs="+", default=None, help="module names to adapt (default: the preset's)")
    p.add_argument("--quantize", default=defaults.quantize, choices=("none", "8bit", "4bit"),
                   help="load the base model in 8-bit or 4-bit NF4 (QLoRA)")
    p.add_argument("--batch-size", type=int, default=None, help="per-process batch (default: the preset's)")
    p.add_argument("--grad-accum", type=int, default=defaults.grad_accum, help="gradient accumulation steps")
    p.add_argument("--learning-rate", type=float, default=None, help="default: the preset's")
    p.add_argument("--lr-scaling", default=defaults.lr_scaling, choices=("none", "linear", "sqrt"),
                   help="scale the learning rate with the effective batch")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    p.add_argument("--max-length", type=int, default=None, help="tokens per example (default: the preset's)")
    p.add_argument("--eval-rows", type=int, default=defaults.eval_rows,
                   help="held-out rows for exact match and similarity")
    p.add_argument("--gradient-checkpointing", action="store_true", help="trade compute for activation memory")
    p.add_argument("--logging-steps", type=int, default=defaults.logging_steps, help="log the loss every N steps")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--data-file", default=None, help="JSON-lines file with instruction, input, output")
    p.add_argument("--output-dir", default=None, help="results folder (must not exist)")
    p.add_argument("--num-processes", type=int, default=None,
                   help="world size to expect inside each worker (default: WORLD_SIZE from the launcher)")
    p.add_argument("--random-init", action="store_true", help="random weights from the shipped config (offline)")
    p.add_argument("--skip-generation-eval", action="store_true", help="skip exact match and similarity (faster)")
    args = p.parse_args(argv)
    names = {f.name for f in fields(Config)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if values.get("targets"):
        values["targets"] = tuple(values["targets"])
    return Config(**values)


def main(argv=None) -> dict:
    from my_utils.cli import run_main

    return run_main(lambda: train(parse_args(argv)), prefix="lora")


if __name__ == "__main__":
    main()
