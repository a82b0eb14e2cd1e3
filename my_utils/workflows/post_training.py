"""What the post-training workflows (``dpo``, ``grpo``) share: their common settings and checks, trl's training
arguments set from them, and the summary fields every such run records. Each workflow adds its method's own."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from my_utils import UserError
from my_utils.core.adapters import AdapterSpec
from my_utils.core.memory import peak_bytes
from my_utils.run.checkpoints import checkpoint_step
from my_utils.run.config import LocalBatchSettings, check_choice, check_positive, setting
from my_utils.run.launch import OUTPUT_LOGGED, check_process_count, is_cpu_only
from my_utils.run.lifecycle import check_resumable, process_group_backend
from my_utils.workflows.ddp import OPTIMIZERS
from my_utils.workflows.lora import CHECKPOINTS, KEEP_CHECKPOINTS, MIXED_PRECISION, default_mixed_precision

# Settings a resumed run may change: where and how it runs, not what it trains.
RESUME_MAY_DIFFER = frozenset({"resume", "output_dir", "num_processes", "timeout_s", "save_steps",
                               "skip_generation_eval", "max_new_tokens"})


@dataclass
class PostTrainingSettings(LocalBatchSettings):
    """The settings of a trl trainer with a LoRA adapter, under the names the LoRA workflow gives them."""

    adapter: AdapterSpec = setting(AdapterSpec, "the adapter the policy trains")
    grad_accum: int = setting(1, "micro-batches per optimizer step: the global batch is local_batch_size x "
                              "grad_accum x processes")
    # Adam's first steps move every weight by about the learning rate whatever the size of its gradient, so a
    # gradient that is zero but for rounding on one layout and not on another sends two runs apart: SGD does not
    optimizer: str = setting("adamw", "sgd makes runs that see equal gradients end with visibly equal weights",
                             choices=OPTIMIZERS)
    gradient_checkpointing: bool = setting(False, "trade compute for activation memory (trl's own default is on)")
    mixed_precision: str = setting("auto", "auto: bf16 where it trains faster than fp32 (GPUs with bf16, CPUs with "
                                   "AMX), else no (trl's own default is bf16 wherever it runs); fp16 needs a GPU",
                                   choices=MIXED_PRECISION)
    eval_rows: int = setting(100, "held-out rows for exact match and similarity")
    max_new_tokens: int = setting(16, "tokens generated per held-out answer")
    logging_steps: int = setting(10, "steps between metrics lines")
    skip_generation_eval: bool = setting(False, "skip exact match and similarity (faster)")
    save_steps: int | None = setting(None, "save a checkpoint every N steps (the newest two are kept)")
    resume: bool = setting(False, "continue --output-dir from its newest whole checkpoint, with the same settings")


def check_settings(cfg: PostTrainingSettings, workflow: str):
    """The shared checks, before anything starts (nothing heavy imported, nothing written); returns the preset. A
    resumed run's settings are compared once resolved (``resolve``), as run.json records them."""
    preset = cfg.check_common()
    preset.require("causal")
    cfg.adapter.check()
    for name in ("grad_accum", "eval_rows", "logging_steps", "max_new_tokens"):
        check_positive(f"--{name.replace('_', '-')}", getattr(cfg, name))
    check_choice("optimizer", cfg.optimizer, OPTIMIZERS)
    check_choice("mixed precision", cfg.mixed_precision, MIXED_PRECISION)
    if cfg.mixed_precision == "fp16" and is_cpu_only():
        raise UserError("fp16 mixed precision needs a GPU; on a CPU use --mixed-precision bf16 or no.")
    if cfg.save_steps is not None:
        check_positive("--save-steps", cfg.save_steps)
    if cfg.num_processes is not None:
        check_process_count(cfg.num_processes)
    if cfg.resume:
        check_resumable(cfg.output_dir, dataclasses.asdict(resolve(cfg, preset, cfg.num_processes or 1)),
                        may_differ=RESUME_MAY_DIFFER, workflow=workflow, checkpoints=CHECKPOINTS)
    return preset


def resolve(cfg: PostTrainingSettings, preset, world_size: int):
    """Every shared default settled before the results folder opens: the batch, steps, length, rate, adapter and
    mixed precision."""
    mixed_precision = default_mixed_precision("none") if cfg.mixed_precision == "auto" else cfg.mixed_precision
    return dataclasses.replace(cfg, **cfg.settled(preset), adapter=cfg.adapter.resolved(preset.lora_targets),
                               mixed_precision=mixed_precision, num_processes=world_size)


def trl_arguments(cfg: PostTrainingSettings, folder: Path) -> dict:
    """trl's training arguments for the shared settings of ``cfg`` (resolved), its checkpoints inside the results
    ``folder``: the keyword arguments of ``DPOConfig`` or ``GRPOConfig``, besides the method's own."""
    return dict(
        output_dir=str(folder / CHECKPOINTS),
        per_device_train_batch_size=cfg.local_batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        learning_rate=cfg.learning_rate,
        optim="sgd" if cfg.optimizer == "sgd" else "adamw_torch",
        max_steps=cfg.max_steps,
        logging_steps=cfg.logging_steps,
        save_strategy="steps" if cfg.save_steps else "no",
        save_steps=cfg.save_steps or 500,
        save_total_limit=KEEP_CHECKPOINTS,
        report_to="none",
        disable_tqdm=True if os.environ.get(OUTPUT_LOGGED) else None,
        use_cpu=is_cpu_only(),
        seed=cfg.seed,
        data_seed=cfg.seed,
        ddp_timeout=int(cfg.timeout_s),
        ddp_find_unused_parameters=False,
        # set either way: trl's own defaults are bf16 and recomputation on, wherever it runs
        activation_checkpointing=cfg.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if cfg.gradient_checkpointing else None,
        bf16=cfg.mixed_precision == "bf16",
        fp16=cfg.mixed_precision == "fp16",
    )


def summary_fields(cfg: PostTrainingSettings, world_size: int, result, checkpoint, runtime: float,
                   memory: list[dict], quality: dict, params: dict, adapter_bytes: int, unit: str) -> dict:
    """The summary fields every post-training run records: the layout, steps, runtime and throughput (``unit``s per
    second: what a batch counts), quality before and after (``quality``: {"before": ..., "after": ...} from
    ``lora.generation_eval``), sizes and memory."""
    steps = result.global_step
    start_step = checkpoint_step(checkpoint) if checkpoint else 0  # its name: the Trainer may have deleted it since
    trained = steps > start_step
    before, after = quality["before"] or {}, quality["after"] or {}
    return {
        "world_size": world_size,
        "backend": process_group_backend(),
        "local_batch_size": cfg.local_batch_size,
        "grad_accum": cfg.grad_accum,
        "global_batch_size": cfg.global_batch(world_size),
        "learning_rate": cfg.learning_rate,
        "optimizer": cfg.optimizer,
        "mixed_precision": cfg.mixed_precision,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "max_length": cfg.max_length,
        "steps": steps,
        "resumed_from_step": start_step if checkpoint else None,
        "exact_match_before": before.get("exact_match"),
        "exact_match_after": after.get("exact_match"),
        "similarity_before": before.get("similarity"),
        "similarity_after": after.get("similarity"),
        "examples_after": after.get("examples"),
        # this process's training time (after a resume: the resumed part; none when nothing was left to train)
        "runtime_s": runtime if trained else None,
        f"{unit}_per_s": (steps - start_step) * cfg.global_batch(world_size) / runtime if trained else None,
        "trainable_params": params["trainable"],
        "total_params": params["total"],
        "adapter_bytes": adapter_bytes,
        "memory": memory,
        "peak_memory_bytes": max(peak_bytes(r["end"]) for r in memory) if trained else None,
    }
