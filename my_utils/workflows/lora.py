"""LoRA, QLoRA or full fine-tuning of a causal LM on instruction data, on one or several processes.

One function, two launchers:

    # a shell, 2 processes on a CPU (gloo)
    accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.lora --preset tiny
    # the same with 4-bit QLoRA, or full fine-tuning
    accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.lora --preset tiny --quantize 4bit
    python -m my_utils.workflows.lora --preset tiny --method full
    # a notebook
    from my_utils.run.launch import launch; launch(train, Config(preset="tiny"), num_processes=2)

Checkpoints and resuming (the same results folder continues; its losses match an uninterrupted run). A crash
resumes from the newest whole checkpoint; a SIGTERM (a scheduler preempting the job) stops every rank at the
end of the current step with a checkpoint; a rank that dies or hangs ends the job within --timeout-s, named:

    python -m my_utils.workflows.lora --preset tiny --save-steps 20 --output-dir runs/lora/mine
    python -m my_utils.workflows.lora --preset tiny --save-steps 20 --output-dir runs/lora/mine --resume

Every run writes a results folder (run.json, metrics.jsonl, summary.json, the adapter) and returns its summary:
exact match and a similarity score (chrF, one fixed scorer for every run) on held-out rows before and after
training, losses, runtime, samples/s, tokens/s, memory on every rank (allocated, reserved, peak, RSS, and a
breakdown into weights, gradients, optimizer states and activations), the first batch each rank trained on,
trainable parameters and adapter size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from my_utils import UserError
from my_utils.run.results import RUNS_ROOT

METHODS = ("lora", "full")
MIXED_PRECISION = ("auto", "no", "fp16", "bf16")
CHECKPOINTS = "checkpoints"  # the Trainer's checkpoints, inside the results folder
KEEP_CHECKPOINTS = 2  # the newest and the one before: a save cut short leaves a whole one to resume from
# Settings a resumed run may change: where and how it runs, not what it trains.
RESUME_MAY_DIFFER = frozenset({"resume", "output_dir", "num_processes", "timeout_s", "save_steps",
                               "skip_generation_eval", "max_new_tokens"})


@dataclass
class Config:
    preset: str = "tiny"
    method: str = "lora"  # "lora" (adapters; with --quantize, QLoRA) or "full" (every weight trains)
    rank: int = 8
    alpha: float | None = None  # default 2 x rank
    rslora: bool = False  # scale the update by alpha / sqrt(rank) instead of alpha / rank (peft's use_rslora)
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None  # default: the preset's LoRA targets
    quantize: str = "none"  # none | 8bit | 4bit
    batch_size: int | None = None  # per process; default: the preset's
    grad_accum: int = 1
    learning_rate: float | None = None  # default: the preset's (for LoRA; full fine-tuning uses a tenth)
    lr_scaling: str = "none"  # none | linear | sqrt, from the preset's batch to the effective batch
    lr_scheduler: str | None = None  # cosine, linear, constant, constant_with_warmup; default: the preset's
    # Batches of similar lengths pad less, but where length follows the task (as in the tiny data) every batch
    # holds one task and learning suffers: off unless asked for.
    group_by_length: bool = False
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
    save_steps: int | None = None  # checkpoint every N steps (safetensors weights), for --resume
    resume: bool = False  # continue output_dir from its newest whole checkpoint
    timeout_s: float = 1800  # how long a collective waits for a rank that stopped before the job fails
    auto_batch_size: bool = False  # on out-of-memory, retry with a smaller batch (the summary records it)
    mixed_precision: str = "auto"  # auto (bf16 where native, else no) | no | fp16 (GPUs only) | bf16
    trust_remote_code: bool = False  # let a hub model run its own Python code (off unless asked for)


def validate(cfg: Config):
    """Check ``cfg`` (one sentence per problem) and settle ``mixed_precision="auto"``; returns the preset."""
    """Check the settings before anything starts (nothing heavy is imported, nothing is written); returns the
    preset. Files are checked next, by ``load_inputs``, also before the results folder is touched."""
    from my_utils.core.learning_rate import LR_SCALING
    from my_utils.core.models import QUANTIZE_CHOICES, check_lora_args
    from my_utils.core.presets import get_preset
    from my_utils.run.checkpoints import find_resume_checkpoint
    from my_utils.run.config import check_positive
    from my_utils.run.launch import check_process_count
    from my_utils.run.lifecycle import check_resumable
    from my_utils.run.results import check_can_create, check_new_run_dir

    preset = get_preset(cfg.preset)
    preset.require("causal")
    if cfg.method not in METHODS:
        raise UserError(f"Unknown method {cfg.method!r}; choose one of {', '.join(METHODS)}.")
    if cfg.quantize not in QUANTIZE_CHOICES:
        raise UserError(f"Unknown quantization {cfg.quantize!r}; choose one of {', '.join(QUANTIZE_CHOICES)}.")
    if cfg.quantize != "none" and cfg.method == "full":
        raise UserError("Quantized weights cannot be fully fine-tuned; use --method lora with --quantize (QLoRA).")
    if cfg.quantize != "none" and cfg.random_init:
        raise UserError("Quantization needs pretrained weights; drop --random-init or use --quantize none.")
    if cfg.method == "lora":
        check_lora_args(cfg.rank, cfg.alpha)
        if cfg.targets is not None and not cfg.targets:
            raise UserError("--targets names no module; give at least one, e.g. --targets c_attn.")
    if cfg.lr_scaling not in LR_SCALING:
        raise UserError(f"Unknown learning-rate scaling {cfg.lr_scaling!r}; choose one of {', '.join(LR_SCALING)}.")
    for name in ("batch_size", "max_steps", "max_length", "save_steps"):
        if getattr(cfg, name) is not None:
            check_positive(f"--{name.replace('_', '-')}", getattr(cfg, name))
    for name in ("grad_accum", "eval_rows", "logging_steps", "max_new_tokens"):
        check_positive(f"--{name.replace('_', '-')}", getattr(cfg, name))
    if cfg.learning_rate is not None:
        check_positive("--learning-rate", cfg.learning_rate, float)
    check_positive("--timeout-s", cfg.timeout_s, float)
    if not 0 <= cfg.dropout < 1:
        raise UserError(f"--dropout must be at least 0 and below 1, got {cfg.dropout!r}.")
    if cfg.mixed_precision not in MIXED_PRECISION:
        raise UserError(f"Unknown mixed precision {cfg.mixed_precision!r}; choose one of {', '.join(MIXED_PRECISION)}.")
    if cfg.mixed_precision == "auto":
        cfg.mixed_precision = default_mixed_precision(cfg.quantize)
    if cfg.num_processes is not None:
        check_process_count(cfg.num_processes)
    if cfg.resume:
        if not cfg.output_dir:
            raise UserError("--resume continues an existing results folder; name it with --output-dir.")
        check_resumable(cfg.output_dir, asdict(cfg), may_differ=RESUME_MAY_DIFFER)
        find_resume_checkpoint(Path(cfg.output_dir) / CHECKPOINTS)  # one sentence now if there is none
    elif cfg.output_dir:
        check_new_run_dir(cfg.output_dir)
        check_can_create(cfg.output_dir)
    if cfg.mixed_precision == "fp16":
        from my_utils.run.launch import is_cpu_only

        if is_cpu_only():
            raise UserError("fp16 mixed precision needs a GPU; on a CPU use --mixed-precision bf16 or no.")
    return preset


def default_mixed_precision(quantize: str) -> str:
    """bf16 where the device computes it natively, as trl's SFTConfig defaults to: on such a CPU it doubles the
    matmul rate and the tiny lessons learn as well (``python -m my_utils bench trainer`` measures both). A quantized
    model on a CPU keeps fp32 compute: bitsandbytes' CPU kernels are what the QLoRA lesson checks."""
    from my_utils.core.devices import native_bf16
    from my_utils.run.launch import is_cpu_only

    if quantize != "none" and is_cpu_only():
        return "no"
    return "bf16" if native_bf16() else "no"


def load_inputs(cfg: Config, preset, world_size: int) -> dict:
    """Read and check everything the run needs from files, before the results folder is touched: the model's
    config (LoRA targets, longest sequence), the tokenizer and the data. Returns the tokenizer, the tokenized
    sets, the held-out rows, and the batch size and max length in use."""
    from my_utils.core.data import (INSTRUCTION_COLUMNS, check_enough_rows, check_text_columns, load_instructions,
                                    tokenize_instructions)
    from my_utils.core.devices import meta_model
    from my_utils.core.models import check_lora_targets, load_tokenizer, max_positions

    batch_size = cfg.batch_size or preset.batch_size
    max_length = cfg.max_length or preset.max_length
    shipped_config = preset.offline_config.get("causal")
    if shipped_config:  # the architecture on the meta device: every module name and limit, no weights
        model = meta_model(shipped_config)
        limit = max_positions(model.config)
        if limit and max_length > limit:
            raise UserError(f"max_length {max_length} is longer than the model allows ({limit}); "
                            f"use --max-length {limit}.")
        if cfg.method == "lora":
            check_lora_targets(model, cfg.targets or preset.lora_targets)
    tokenizer = load_tokenizer(preset, trust_remote_code=cfg.trust_remote_code)
    train_rows, eval_rows = load_instructions(preset.instruction_data, eval_rows=cfg.eval_rows, seed=cfg.seed,
                                              path=cfg.data_file)
    source = cfg.data_file or f"the {preset.instruction_data} data"
    check_text_columns(train_rows + eval_rows, INSTRUCTION_COLUMNS, source)
    check_enough_rows(len(train_rows), batch_size * cfg.grad_accum * world_size)
    return {
        "tokenizer": tokenizer,
        "train_set": tokenize_instructions(train_rows, tokenizer, max_length),
        "eval_set": tokenize_instructions(eval_rows, tokenizer, max_length),
        "eval_rows": eval_rows,
        "batch_size": batch_size,
        "max_length": max_length,
    }


def train(cfg: Config) -> dict:
    """Fine-tune and evaluate; returns the summary (on every rank; rank 0 also writes it)."""
    preset = validate(cfg)  # before any heavy import: bad settings fail in a fraction of a second
    from my_utils.run.launch import check_process_count, check_world_size

    world_size = check_world_size(cfg.num_processes, timeout_s=cfg.timeout_s)
    check_process_count(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))  # processes on this machine
    inputs = load_inputs(cfg, preset, world_size)  # bad files fail here, before the Trainer is even imported

    import torch
    from accelerate.utils import broadcast_object_list
    from transformers import TrainingArguments, set_seed

    from my_utils.core.data import padding_collator
    from my_utils.core.devices import device_inventory, per_rank_device, per_rank_device_map
    from my_utils.core.evaluation import SIMILARITY_SCORER, held_out_loss
    from my_utils.core.learning_rate import scale_learning_rate
    from my_utils.core.memory import peak_bytes
    from my_utils.core.models import add_lora, build_causal_lm, count_parameters, folder_size, set_threads
    from my_utils.core.printing import print0
    from my_utils.run.callbacks import TokenCounter, gather_to_rank0, make_callbacks
    from my_utils.run.faults import course_trainer_class, install_fake_oom, name_stopped_ranks, reliability_callbacks
    from my_utils.run.launch import is_cpu_only
    from my_utils.run.lifecycle import open_run, recorded, reopen_run

    threads = set_threads()
    set_seed(cfg.seed)
    tokenizer, eval_rows, batch_size = inputs["tokenizer"], inputs["eval_rows"], inputs["batch_size"]
    effective_batch = batch_size * cfg.grad_accum * world_size
    base_lr = cfg.learning_rate or (preset.learning_rate if cfg.method == "lora" else preset.learning_rate / 10)
    learning_rate = scale_learning_rate(base_lr, effective_batch, preset.batch_size, cfg.lr_scaling)
    device = per_rank_device()

    checkpoint = None
    if cfg.resume:
        run, run_dir, checkpoint = reopen_run(cfg.output_dir, CHECKPOINTS, world_size=world_size)
        print0(f"resuming {run_dir} from {checkpoint.relative_to(run_dir)}")
    else:
        default_dir = RUNS_ROOT / "lora" / f"{cfg.preset}_{_method(cfg)}"
        run, run_dir = open_run(cfg.output_dir, default_dir, asdict(cfg), world_size=world_size,
                                backend=_backend(), devices=device_inventory(), threads_per_process=threads)
    with recorded(run):
        model = build_causal_lm(preset, random_init=cfg.random_init, quantize=cfg.quantize,
                                device_map=per_rank_device_map() if cfg.quantize != "none" else None,
                                trust_remote_code=cfg.trust_remote_code)
        if cfg.method == "lora":
            model = add_lora(model, cfg.rank, cfg.alpha, cfg.targets or preset.lora_targets, cfg.dropout,
                             use_rslora=cfg.rslora)
        install_fake_oom(model)
        params = count_parameters(model)
        print0(f"trainable parameters: {params['trainable']:,} of {params['total']:,} "
               f"({100 * params['trainable_fraction']:.2f}%)")

        before = _generation_eval(cfg, model.to(device), tokenizer, eval_rows)
        # Wraps the collator: counts tokens, and prints (with the rank prefix) and keeps each rank's first batch.
        counter = TokenCounter(padding_collator(tokenizer), tokenizer=tokenizer, preview_batches=1)
        memory_cb, metrics_cb = make_callbacks(run, device)
        reliability = reliability_callbacks(world_size)  # checkpoint manifests, SIGTERM stop, fault injection
        args = TrainingArguments(
            output_dir=str(run_dir / CHECKPOINTS),
            per_device_train_batch_size=batch_size,
            per_device_eval_batch_size=batch_size,
            gradient_accumulation_steps=cfg.grad_accum,
            learning_rate=learning_rate,
            lr_scheduler_type=cfg.lr_scheduler or preset.lr_scheduler,
            warmup_steps=0.05,
            max_steps=cfg.max_steps or preset.max_steps,
            logging_steps=cfg.logging_steps,
            # Checkpoints (adapter or model as safetensors, optimizer, scheduler, every rank's RNG state) let
            # --resume continue exactly; a SIGTERM saves one whatever this says.
            save_strategy="steps" if cfg.save_steps else "no",
            save_steps=cfg.save_steps or 500,  # the Trainer's default, unused without --save-steps
            save_total_limit=KEEP_CHECKPOINTS,
            report_to="none",
            use_cpu=is_cpu_only(),
            seed=cfg.seed,
            data_seed=cfg.seed,  # the shuffling order, the same again when a run resumes
            ddp_timeout=int(cfg.timeout_s),
            fp16=cfg.mixed_precision == "fp16",
            bf16=cfg.mixed_precision == "bf16",
            auto_find_batch_size=cfg.auto_batch_size,
            # LoRA leaves most parameters frozen but every trainable one is used each step, so DDP need not
            # search the graph for unused parameters (a full extra traversal per step).
            ddp_find_unused_parameters=False,
            activation_checkpointing=cfg.gradient_checkpointing,
            # Non-reentrant checkpointing works with frozen inputs (LoRA) and with DDP.
            activation_checkpointing_kwargs={"use_reentrant": False} if cfg.gradient_checkpointing else None,
            dataloader_drop_last=True,  # training batches only (course_trainer_class): same shapes on every rank
            # Batches of examples of similar length (shuffled in groups, longest batch first): dynamic padding then
            # adds little, so a step costs less for the same examples (`python -m my_utils bench trainer`).
            train_sampling_strategy="group_by_length" if cfg.group_by_length else "random",
        )
        callbacks = [memory_cb, metrics_cb, _count_from_train_begin(counter, run), *reliability.values()]
        Trainer = course_trainer_class()  # transformers' Trainer; its evaluation sees every row
        trainer = Trainer(model=model, args=args, train_dataset=inputs["train_set"], eval_dataset=inputs["eval_set"],
                          data_collator=counter, callbacks=[c for c in callbacks if c])
        # The base model's held-out loss, as evaluate() reports it; a resumed run recorded it when it first started.
        eval_loss_before = None if checkpoint else held_out_loss(
            model, inputs["eval_set"], padding_collator(tokenizer), batch_size,
            {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.mixed_precision))
        started = time.perf_counter()
        try:
            result = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
        except Exception as e:
            failure = name_stopped_ranks(e, world_size, cfg.timeout_s, step=trainer.state.global_step)
            if failure is None:
                raise
            raise failure from e
        if reliability["stop"].stopped:
            step = trainer.state.global_step
            raise KeyboardInterrupt(f"SIGTERM; stopped after step {step} with {CHECKPOINTS}/checkpoint-{step}, "
                                    "continue with --resume")
        runtime = time.perf_counter() - started
        tokens = sum(gather_to_rank0(counter.tokens) or [0])
        first_batches = gather_to_rank0(counter.previews[0] if counter.previews else None)
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
            start_step = int(checkpoint.name.rsplit("-", 1)[1]) if checkpoint else 0
            settled_batch = trainer.state.train_batch_size or batch_size
            effective_batch = settled_batch * cfg.grad_accum * world_size
            summary = {
                "workflow": "lora",
                "preset": cfg.preset,
                "method": cfg.method if cfg.quantize == "none" else f"qlora-{cfg.quantize}",
                "rank": cfg.rank if cfg.method == "lora" else None,
                "alpha": (cfg.alpha or 2 * cfg.rank) if cfg.method == "lora" else None,
                "rslora": cfg.rslora if cfg.method == "lora" else None,
                "targets": list(cfg.targets or preset.lora_targets) if cfg.method == "lora" else None,
                "world_size": world_size,
                "backend": _backend(),
                "batch_size_per_process": settled_batch,
                "batch_size_requested": batch_size,
                "auto_batch_size": cfg.auto_batch_size,
                "grad_accum": cfg.grad_accum,
                "effective_batch": effective_batch,
                "learning_rate": learning_rate,
                "lr_scaling": cfg.lr_scaling,
                "mixed_precision": cfg.mixed_precision,
                "gradient_checkpointing": cfg.gradient_checkpointing,
                "steps": steps,
                "resumed_from_step": start_step if checkpoint else None,
                "train_loss_first": losses[0] if losses else None,
                "train_loss_final": losses[-1] if losses else None,
                "eval_loss_before": eval_loss_before,
                "eval_loss": eval_metrics.get("eval_loss"),
                "exact_match_before": (before or {}).get("exact_match"),
                "exact_match_after": (after or {}).get("exact_match"),
                "similarity_before": (before or {}).get("similarity"),
                "similarity_after": (after or {}).get("similarity"),
                "similarity_scorer": SIMILARITY_SCORER,
                "examples_after": (after or {}).get("examples"),
                # runtime and throughput of this process's training (after a resume: the resumed part)
                "runtime_s": runtime,
                "samples_per_s": (steps - start_step) * effective_batch / runtime,
                # the same per CPU second of the busiest process: steadier than wall-clock on a shared machine
                "samples_per_cpu_s": (steps - start_step) * effective_batch / max(r["cpu_s"] for r in memory_cb.report),
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
        summary = broadcast_object_list([summary])[0] if world_size > 1 else summary
    return summary


def _count_from_train_begin(counter, run):
    """A callback that restarts the records when training begins: an out-of-memory retry (--auto-batch-size)
    begins training again, and only the attempt that runs to the end counts, in ``counter`` (a TokenCounter)
    and in ``run``'s metrics (rows logged by an abandoned attempt are dropped)."""
    from transformers import TrainerCallback

    class CountFromTrainBegin(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            counter.tokens = counter.padded_tokens = 0
            counter.previews.clear()
            if run is not None:
                run.keep_metrics_until(state.global_step)  # 0, or the step a resumed run starts from

    return CountFromTrainBegin()


def _method(cfg: Config) -> str:
    return cfg.method if cfg.quantize == "none" else "q" + cfg.quantize


def _backend() -> str | None:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None


def _generation_eval(cfg, model, tokenizer, rows):
    """Exact match and similarity of greedy answers, on rank 0 (the other ranks wait); None when skipped."""
    from accelerate import PartialState

    from my_utils.core.evaluation import answer_quality

    state = PartialState()
    quality = None
    if not cfg.skip_generation_eval and state.is_main_process:
        quality = answer_quality(model, tokenizer, rows, max_new_tokens=cfg.max_new_tokens)
    state.wait_for_everyone()
    return quality


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


class _OneLineParser(argparse.ArgumentParser):
    """argparse with a bad option reported in one line (what is wrong, where to look), not the whole usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}; see --help.\n")


def parse_args(argv=None) -> Config:
    p = _OneLineParser(
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
    p.add_argument("--rslora", action="store_true",
                   help="rank-stabilised LoRA: scale the update by alpha / sqrt(rank) instead of alpha / rank")
    p.add_argument("--dropout", type=float, default=defaults.dropout, help="LoRA dropout")
    p.add_argument("--targets", nargs="+", default=None, help="module names to adapt (default: the preset's)")
    p.add_argument("--quantize", default=defaults.quantize, choices=("none", "8bit", "4bit"),
                   help="load the base model in 8-bit or 4-bit NF4 (QLoRA)")
    p.add_argument("--batch-size", type=int, default=None, help="per-process batch (default: the preset's)")
    p.add_argument("--grad-accum", type=int, default=defaults.grad_accum, help="gradient accumulation steps")
    p.add_argument("--learning-rate", type=float, default=None, help="default: the preset's")
    p.add_argument("--lr-scheduler", default=None, choices=("cosine", "linear", "constant", "constant_with_warmup"),
                   help="learning-rate schedule (default: the preset's)")
    p.add_argument("--group-by-length", action="store_true",
                   help="batches of examples of similar length (less padding; hurts when length follows the task)")
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
    p.add_argument("--output-dir", default=None, help="results folder (must not exist, unless --resume)")
    p.add_argument("--num-processes", type=int, default=None,
                   help="world size to expect inside each worker (default: WORLD_SIZE from the launcher)")
    p.add_argument("--random-init", action="store_true", help="random weights from the shipped config (offline)")
    p.add_argument("--skip-generation-eval", action="store_true", help="skip exact match and similarity (faster)")
    p.add_argument("--save-steps", type=int, default=None,
                   help="save a checkpoint every N steps (weights as safetensors; the newest two are kept)")
    p.add_argument("--resume", action="store_true",
                   help="continue --output-dir from its newest whole checkpoint, with the same settings")
    p.add_argument("--timeout-s", type=float, default=defaults.timeout_s,
                   help="seconds a collective waits for a rank that stopped (died or hung) before the job fails "
                   "naming it; keep it above the longest time one rank works alone (the generation evaluation)")
    p.add_argument("--auto-batch-size", action="store_true",
                   help="on out-of-memory, retry with a smaller per-process batch (recorded in summary.json)")
    p.add_argument("--mixed-precision", default=defaults.mixed_precision, choices=MIXED_PRECISION,
                   help="auto: bf16 where the device computes it natively (recent GPUs, CPUs with AVX-512 BF16 or "
                   "AMX), else no; fp16 needs a GPU")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let a hub model run its own Python code (off: only transformers' own classes load)")
    args = p.parse_args(argv)
    names = {f.name for f in fields(Config)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if values.get("targets"):
        values["targets"] = tuple(values["targets"])
    return Config(**values)


def main(argv=None) -> dict:
    from my_utils.run.cli import run_main

    try:
        return run_main(lambda: train(parse_args(argv)), prefix="lora")
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: run.json says interrupted; one line, not a traceback
        print(f"lora: interrupted ({e or 'Ctrl-C'})", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
