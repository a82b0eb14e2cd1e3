"""LoRA, QLoRA or full fine-tuning of a causal LM on instruction data, on one or several processes.

One function, two launchers:

    # a shell, 2 processes on a CPU (gloo)
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.lora --preset tiny
    # the same with 4-bit QLoRA, DoRA, or full fine-tuning
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.lora --preset tiny --quantize 4bit
    python -m my_utils.workflows.lora --preset tiny --dora
    python -m my_utils.workflows.lora --preset tiny --method full
    # any peft method, named by its config file (configs/peft/: ia3, prompt_tuning, prefix_tuning, vera, ...)
    python -m my_utils.workflows.lora --preset tiny --adapter-config configs/peft/ia3.json --learning-rate 0.1
    # a notebook
    from my_utils.core.adapters import AdapterSpec
    from my_utils.run.launch import launch
    launch(train, Config(preset="tiny", adapter=AdapterSpec(rank=16)), num_processes=2)

The adapter's flags (``--adapter-config --rank --alpha --targets --dropout --rslora --dora``) are the fields of
``my_utils.core.adapters.AdapterSpec``: a new peft option added there is a flag here, in run.json and in the sweep,
and a new peft method is one JSON file.

Checkpoints and resuming (the same results folder continues; its losses match an uninterrupted run). A crash
resumes from the newest whole checkpoint; a SIGTERM (a scheduler preempting the job) or SIGUSR1 (SLURM's warning
before the time limit; exit 75, which configs/slurm/preemptible.sbatch requeues on) stops every rank at the end
of the same step (on several processes, the next one) with a checkpoint; a rank that dies, hangs or is
stopped ends the job soon after --timeout-s, named:

    python -m my_utils.workflows.lora --preset tiny --save-steps 20 --output-dir runs/lora/mine
    python -m my_utils.workflows.lora --preset tiny --save-steps 20 --output-dir runs/lora/mine --resume

Every run writes a results folder (run.json with every default resolved, metrics.jsonl, summary.json, the
adapter) and returns its summary: exact match and a similarity score (chrF, one fixed scorer for every run) on
held-out rows before and after training, losses, runtime, samples/s, tokens/s, memory on every rank (allocated,
reserved, peak, RSS, and a breakdown into weights, gradients, optimizer states and activations), the first batch
each rank trained on, trainable parameters and adapter size.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, replace
from typing import ClassVar
from pathlib import Path

from my_utils import UserError
from my_utils.core.adapters import LORA, PROMPT_LEARNING, AdapterSpec, complete_adapter_folder, method_label
from my_utils.core.chunked_loss import use_chunked_loss
from my_utils.core.data import (INSTRUCTION_COLUMNS, check_enough_rows, check_text_columns, load_instructions,
                                pack_examples, packed_collator, padding_collator, read_jsonl, tokenize_instructions)
from my_utils.core.devices import compiler_missing, fast_bf16, meta_model, per_rank_device, per_rank_device_map
from my_utils.core.evaluation import SIMILARITY_SCORER, answer_quality, held_out_loss
from my_utils.core.learning_rate import LR_SCALING, scale_learning_rate
from my_utils.core.memory import peak_bytes
from my_utils.core.models import (QUANTIZE_CHOICES, add_adapter, build_causal_lm, check_lora_targets, count_parameters,
                                  load_tokenizer, max_positions)
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.printing import print0
from my_utils.run.callbacks import TokenCounter, make_callbacks
from my_utils.run.cli import command_line, file_system_refusal
from my_utils.run.config import LocalBatchSettings, check_choice, check_positive, setting
from my_utils.run.faults import course_trainer_class, reliability_callbacks
from my_utils.run.launch import OUTPUT_LOGGED, check_process_count, is_cpu_only
from my_utils.run.lifecycle import (check_resumable, join_world, process_group_backend, resume_after_restart,
                                    run_lifecycle)
from my_utils.run.signals import Preempted, Sigterm
from my_utils.workflows.ddp_common import worker_report, write_worker_report

METHODS = ("lora", "full")
MIXED_PRECISION = ("auto", "no", "fp16", "bf16")
LR_SCHEDULERS = ("cosine", "linear", "constant", "constant_with_warmup")
CHECKPOINTS = "checkpoints"  # the Trainer's checkpoints, inside the results folder
KEEP_CHECKPOINTS = 2  # the newest and the one before: a save cut short leaves a whole one to resume from
# Settings a resumed run may change: where and how it runs, not what it trains.
RESUME_MAY_DIFFER = frozenset({"resume", "output_dir", "num_processes", "timeout_s", "save_steps",
                               "skip_generation_eval", "max_new_tokens"})


DESCRIPTION = ("LoRA / QLoRA / full fine-tuning of a causal LM on instruction data. Writes a results folder and prints "
               "its summary. Launch with `ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m "
               "my_utils.workflows.lora ...` for several processes.")


@dataclass
class Config(LocalBatchSettings):
    SETTING_HELP: ClassVar[dict] = {
        "local_batch_size": "examples per process per micro-batch",
        "learning_rate": "the rate at the preset's batch (default: the preset's for LoRA, its full fine-tuning "
                         "rate or a tenth of LoRA's for full fine-tuning); --lr-scaling scales it to the effective batch, and summary.json records the "
                         "rate that ran"}
    method: str = setting("lora", "lora: a peft adapter, LoRA unless --adapter-config names another method (with "
                          "--quantize, QLoRA); full: every weight trains", choices=METHODS)
    adapter: AdapterSpec | None = setting(AdapterSpec, "the adapter (method lora; run.json records null for full "
                                          "fine-tuning, which has none)")
    quantize: str = setting("none", "load the base model in 8-bit or 4-bit NF4 (QLoRA)", choices=QUANTIZE_CHOICES)
    grad_accum: int = setting(1, "micro-batches per optimizer step: the global batch is local_batch_size x "
                              "grad_accum x processes")
    lr_scaling: str = setting("none", "scale the learning rate from the preset's batch to the global batch",
                              choices=LR_SCALING)
    lr_scheduler: str | None = setting(None, "learning-rate schedule (default: the preset's)", choices=LR_SCHEDULERS)
    # Batches of similar lengths pad less, but where length follows the task (as in the tiny data) every batch
    # holds one task and learning suffers: off unless asked for.
    group_by_length: bool = setting(False, "batches of examples of similar length (less padding; hurts when "
                                    "length follows the task)")
    packing: bool = setting(False, "pack the training examples into rows of --max-length tokens (best-fit "
                            "decreasing, trl's pack_dataset), each example attending only to itself: every "
                            "micro-batch then holds about local-batch-size x max-length tokens, on every rank")
    eval_rows: int = setting(100, "held-out rows for the loss, exact match and similarity")
    max_new_tokens: int = setting(16, "tokens generated per held-out answer")
    gradient_checkpointing: bool = setting(False, "trade compute for activation memory")
    compile: bool = setting(False, "torch.compile the model (Inductor: on a CPU it needs a C++ compiler; the first "
                            "steps compile, for tens of seconds); the loss is then transformers' own, since the "
                            "chunked loss replaces the forward in a way the compiler cannot trace")
    chunked_loss: bool = setting(True, "compute the training loss a chunk of tokens at a time, never holding the "
                                 "whole float32 logits (same loss and gradients; summary.json says whether the "
                                 "architecture allowed it)")
    data_file: str | None = setting(None, "JSON-lines file with instruction, input, output (default: the preset's "
                                    "data)")
    forgetting_data: str | None = setting(None, "JSON-lines rows like the model's pretraining text (the tiny "
                                          "preset's: assets/tiny/data/pretrain.jsonl): their loss before and after "
                                          "training measures what fine-tuning forgot (summary: forgetting_loss_*)")
    logging_steps: int = setting(10, "steps between metrics lines")
    skip_generation_eval: bool = setting(False, "skip exact match and similarity (faster)")
    save_steps: int | None = setting(None, "save a checkpoint every N steps (weights as safetensors; the newest two "
                                     "are kept); none without it")
    resume: bool = setting(False, "continue --output-dir from its newest whole checkpoint, with the same settings")
    auto_batch_size: bool = setting(False, "on out-of-memory, retry with a smaller per-process batch (recorded in "
                                    "summary.json)")
    mixed_precision: str = setting("auto", "auto: bf16 where it trains faster than fp32 (GPUs with bf16, CPUs with "
                                   "AMX), else no; fp16 needs a GPU", choices=MIXED_PRECISION)
    trust_remote_code: bool = setting(False, "let a hub model run its own Python code (off: only transformers' own "
                                      "classes load)")


def validate(cfg: Config):
    """Check the settings before anything starts (nothing heavy is imported, nothing is written); returns the
    preset. Files are checked next, by ``load_inputs``, also before the results folder is touched."""
    preset = cfg.check_common()
    preset.require("causal")
    check_choice("method", cfg.method, METHODS)
    check_choice("quantization", cfg.quantize, QUANTIZE_CHOICES)
    if cfg.quantize != "none" and cfg.method == "full":
        raise UserError("Quantized weights cannot be fully fine-tuned; use --method lora with --quantize (QLoRA).")
    if cfg.quantize != "none" and cfg.random_init:
        raise UserError("Quantization needs pretrained weights; drop --random-init or use --quantize none.")
    if cfg.method == "lora":
        (cfg.adapter or AdapterSpec()).check()
    check_choice("learning-rate scaling", cfg.lr_scaling, LR_SCALING)
    if cfg.lr_scheduler is not None:
        check_choice("learning-rate schedule", cfg.lr_scheduler, LR_SCHEDULERS)
    if cfg.save_steps is not None:
        check_positive("--save-steps", cfg.save_steps)
    for name in ("grad_accum", "eval_rows", "logging_steps", "max_new_tokens"):
        check_positive(f"--{name.replace('_', '-')}", getattr(cfg, name))
    check_choice("mixed precision", cfg.mixed_precision, MIXED_PRECISION)
    if cfg.packing and cfg.group_by_length:
        raise UserError("--packing fills every row to --max-length, so there are no lengths left to group by; "
                        "drop --group-by-length or --packing.")
    if cfg.packing and cfg.adapter is not None and cfg.adapter.peft_type in PROMPT_LEARNING:
        raise UserError(f"--packing restarts the position ids at every example, which {cfg.adapter.peft_type} "
                        "(virtual tokens in front of each row) does not allow; drop --packing.")
    if cfg.num_processes is not None:
        check_process_count(cfg.num_processes)
    if cfg.resume:
        # resolved against resolved: run.json records the settings with every default filled in
        resolved = resolve(cfg, preset, cfg.num_processes or 1)
        check_resumable(cfg.output_dir, asdict(resolved), may_differ=RESUME_MAY_DIFFER, workflow="lora",
                        checkpoints=CHECKPOINTS)
    if cfg.mixed_precision == "fp16":
        if is_cpu_only():
            raise UserError("fp16 mixed precision needs a GPU; on a CPU use --mixed-precision bf16 or no.")
    if cfg.compile and is_cpu_only() and (why := compiler_missing()):  # imports torch, only when asked to compile
        raise UserError(f"{why}, or drop --compile.")
    return preset


def resolve(cfg: Config, preset, world_size: int) -> Config:
    """Every default settled, before the results folder opens, so that run.json records what ran: the batch, steps,
    length, learning rate (at the preset's batch; ``training_learning_rate`` scales it), schedule, mixed precision
    ("auto" settled) and the adapter (alpha, targets; None for full fine-tuning, which has none)."""

    adapter = (cfg.adapter or AdapterSpec()).resolved(preset.lora_targets) if cfg.method == "lora" else None
    mixed_precision = cfg.mixed_precision
    if mixed_precision == "auto":
        mixed_precision = default_mixed_precision(cfg.quantize)
    return replace(cfg, **cfg.settled(preset, cfg.method), adapter=adapter,
                   lr_scheduler=cfg.lr_scheduler or preset.lr_scheduler, mixed_precision=mixed_precision,
                   num_processes=world_size)


def training_learning_rate(cfg: Config, preset, world_size: int) -> float:
    """The rate the optimizer uses: ``cfg.learning_rate`` scaled by ``cfg.lr_scaling`` from the preset's batch to
    the global batch (local_batch_size x grad_accum x processes)."""
    return scale_learning_rate(cfg.learning_rate, cfg.global_batch(world_size), preset.batch_size, cfg.lr_scaling)


def compiled_graphs() -> int:
    """How many graphs ``torch.compile`` built in this process, by torch's own counter: one per shape it could not
    reuse a graph for (lesson 15's recompilation trap)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def default_mixed_precision(quantize: str) -> str:
    """bf16 where it trains faster than fp32 (``fast_bf16``: a GPU with bf16, a CPU with AMX), as trl's SFTConfig
    defaults to bf16 on such GPUs; fp32 elsewhere, where bf16 is slower even when the CPU computes it natively. A
    quantized model on a CPU keeps fp32 compute: bitsandbytes' CPU kernels are what the QLoRA lesson checks."""
    if quantize != "none" and is_cpu_only():
        return "no"
    return "bf16" if fast_bf16() else "no"


def load_inputs(cfg: Config, preset, world_size: int) -> dict:
    """Read and check everything the run needs from files, before the results folder is touched: the model's
    config (LoRA targets, longest sequence), the tokenizer and the data. ``cfg`` is resolved (``resolve``). Returns
    the tokenizer, the tokenized sets and the held-out rows."""
    shipped_config = preset.offline_config.get("causal")
    if shipped_config:  # the architecture on the meta device: every module name and limit, no weights
        model = meta_model(shipped_config)
        limit = max_positions(model.config)
        # prompt tuning and P-tuning put their virtual tokens in front of every example
        virtual = (cfg.adapter.peft or {}).get("num_virtual_tokens", 0) if cfg.adapter is not None else 0
        if limit and cfg.max_length + virtual > limit:
            raise UserError(f"max_length {cfg.max_length}{f' and {virtual} virtual tokens' if virtual else ''} "
                            f"is longer than the model allows ({limit}); use --max-length {limit - virtual}.")
        if cfg.adapter is not None:
            if cfg.adapter.peft_type == LORA:
                check_lora_targets(model, cfg.adapter.targets, cfg.adapter.rank)
            add_adapter(model, cfg.adapter)  # peft's own checks of the config against the model, on no weights
    tokenizer = load_tokenizer(preset, trust_remote_code=cfg.trust_remote_code)
    train_rows, eval_rows = load_instructions(preset.instruction_data, eval_rows=cfg.eval_rows, seed=cfg.seed,
                                              path=cfg.data_file)
    source = cfg.data_file or f"the {preset.instruction_data} data"
    check_text_columns(train_rows + eval_rows, INSTRUCTION_COLUMNS, source)
    forgetting_rows = read_jsonl(cfg.forgetting_data, INSTRUCTION_COLUMNS)[:cfg.eval_rows] if cfg.forgetting_data \
        else []
    train_set = tokenize_instructions(train_rows, tokenizer, cfg.max_length)
    if cfg.packing:
        train_set = pack_examples(train_set, cfg.max_length)
    check_enough_rows(len(train_set), cfg.global_batch(world_size))
    return {
        "forgetting_set": tokenize_instructions(forgetting_rows, tokenizer, cfg.max_length) if forgetting_rows else None,
        "tokenizer": tokenizer,
        "train_set": train_set,
        "eval_set": tokenize_instructions(eval_rows, tokenizer, cfg.max_length),
        "eval_rows": eval_rows,
    }


def train(cfg: Config) -> dict:
    """Fine-tune and evaluate; returns the summary (on every rank; rank 0 also writes it)."""
    cfg = resume_after_restart(cfg)  # restarted by torchrun --max-restarts: go on from the newest checkpoint
    preset = validate(cfg)  # before any heavy import: bad settings fail in a fraction of a second

    world_size = join_world(cfg.num_processes, cfg.timeout_s)
    cfg = resolve(cfg, preset, world_size)  # run.json records the settings as they ran
    inputs = load_inputs(cfg, preset, world_size)  # bad files fail here, before the Trainer is even imported

    from transformers import set_seed

    set_seed(cfg.seed)
    tokenizer, eval_rows = inputs["tokenizer"], inputs["eval_rows"]
    learning_rate = training_learning_rate(cfg, preset, world_size)
    device = per_rank_device()
    label = method_label(cfg.method, cfg.quantize, cfg.adapter.peft if cfg.adapter is not None else None)
    default_dir = RUNS_ROOT / "lora" / f"{cfg.preset}_{label}"
    with run_lifecycle(cfg, world_size, default_dir=default_dir, checkpoints=CHECKPOINTS, workflow="lora") as life:
        write_worker_report(life.folder, worker_report())  # workers/rank_<r>.json: the world as each rank saw it
        # region: the model on each rank
        # Each process loads the whole model on the device of its local rank: {"": "cuda:<local rank>"} on GPUs.
        # Quantized weights are placed as they load, so the map goes straight into from_pretrained.
        model = build_causal_lm(preset, random_init=cfg.random_init, quantize=cfg.quantize,
                                device_map=per_rank_device_map() if cfg.quantize != "none" else None,
                                compute_dtype=_autocast_dtype(cfg),
                                trust_remote_code=cfg.trust_remote_code)
        if cfg.method == "lora":
            model = add_adapter(model, cfg.adapter)  # peft's config from the spec: cfg.adapter.peft_config(...)
        # endregion
        chunked_loss = cfg.chunked_loss and not cfg.compile and use_chunked_loss(model)
        params = count_parameters(model)
        print0(f"trainable parameters: {params['trainable']:,} of {params['total']:,} "
               f"({100 * params['trainable_fraction']:.2f}%); learning rate {learning_rate:g}")

        before = generation_eval(cfg, model.to(device), tokenizer, eval_rows)
        # Wraps the collator: counts tokens, and prints (with the rank prefix) and keeps each rank's first batch.
        collator = (packed_collator if cfg.packing else padding_collator)(tokenizer)
        counter = TokenCounter(collator, tokenizer=tokenizer, preview_batches=1)
        memory_cb, metrics_cb = make_callbacks(life.run, device)
        reliability = reliability_callbacks(world_size)  # checkpoint manifests, SIGTERM stop, fault injection
        callbacks = [stop_if_already_trained(), memory_cb, metrics_cb, _count_from_train_begin(counter, life.run),
                     *reliability.values()]
        Trainer = course_trainer_class()  # transformers' Trainer, resuming length-grouped batches exactly
        trainer = Trainer(model=model, args=training_arguments(cfg, life.folder, learning_rate),
                          train_dataset=inputs["train_set"], data_collator=counter,
                          callbacks=[c for c in callbacks if c])
        # The base model's losses, held out and on pretraining-style rows; a resumed run recorded them at its start.
        before_losses = {} if life.checkpoint else {key: _loss_on(model, inputs[key], tokenizer, cfg)
                                                    for key in ("eval_set", "forgetting_set")}
        result, runtime = fit(trainer, life.checkpoint, reliability["stop"])
        measured = {
            "chunked_loss": chunked_loss, "compiled_graphs": compiled_graphs() if cfg.compile else None, "runtime": runtime, "params": params, "learning_rate": learning_rate,
            "memory": memory_cb.report,
            "tokens": sum(life.gather(counter.tokens) or [0]),
            "first_batches": life.gather(counter.previews[0] if counter.previews else None),
            "eval_loss_before": before_losses.get("eval_set"), "before": before,
            "eval_loss": _loss_on(trainer.model, inputs["eval_set"], tokenizer, cfg),
            "forgetting_loss_before": before_losses.get("forgetting_set"),
            "forgetting_loss_after": _loss_on(trainer.model, inputs["forgetting_set"], tokenizer, cfg),
            "after": generation_eval(cfg, trainer.model, tokenizer, eval_rows),
        }
        summary = None
        if life.is_main:
            adapter_bytes = save_adapter(trainer.model, life.folder) if cfg.method == "lora" else None
            summary = build_summary(cfg, world_size, trainer, result, life.checkpoint, measured, adapter_bytes)
            if adapter_bytes is not None:
                complete_adapter_folder(life.folder / "adapter", tokenizer, life.run.info, summary)
        life.finish(summary)
    return life.summary


def training_arguments(cfg: Config, folder: Path, learning_rate: float):
    """The Trainer's settings for ``cfg`` (resolved), writing its checkpoints inside the results ``folder``."""
    import os

    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(folder / CHECKPOINTS),
        per_device_train_batch_size=cfg.local_batch_size,
        per_device_eval_batch_size=cfg.local_batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        learning_rate=learning_rate,
        lr_scheduler_type=cfg.lr_scheduler,
        warmup_steps=0.05,
        max_steps=cfg.max_steps,
        logging_steps=cfg.logging_steps,
        # Checkpoints (adapter or model as safetensors, optimizer, scheduler, every rank's RNG state) let
        # --resume continue exactly; a SIGTERM saves one whatever this says.
        save_strategy="steps" if cfg.save_steps else "no",
        save_steps=cfg.save_steps or 500,  # the Trainer's default, unused without --save-steps
        save_total_limit=KEEP_CHECKPOINTS,
        report_to="none",
        disable_tqdm=True if os.environ.get(OUTPUT_LOGGED) else None,  # a log file wants no progress bar
        use_cpu=is_cpu_only(),
        seed=cfg.seed,
        data_seed=cfg.seed,  # the shuffling order, the same again when a run resumes
        ddp_timeout=int(cfg.timeout_s),
        fp16=cfg.mixed_precision == "fp16",
        bf16=cfg.mixed_precision == "bf16",
        auto_find_batch_size=cfg.auto_batch_size,
        # region: the Trainer's settings for DDP
        # LoRA leaves most parameters frozen but every trainable one is used each step, so DDP need not
        # search the graph for unused parameters (a full extra traversal per step).
        ddp_find_unused_parameters=False,
        activation_checkpointing=cfg.gradient_checkpointing,
        torch_compile=cfg.compile,  # the Trainer compiles the model it trains (lesson 15 measures what it costs)
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and with DDP.
        activation_checkpointing_kwargs={"use_reentrant": False} if cfg.gradient_checkpointing else None,
        dataloader_drop_last=True,  # training batches only (course_trainer_class): same shapes on every rank
        # endregion
        # Batches of examples of similar length (shuffled in groups, longest batch first): dynamic padding then
        # adds little, so a step costs less for the same examples (`python -m my_utils bench trainer`).
        train_sampling_strategy="group_by_length" if cfg.group_by_length else "random",
    )


class _AlreadyTrained(Exception):
    """Raised as training begins when the checkpoint resumed from is the run's last step."""


def stop_if_already_trained():
    """A callback that ends ``train()`` before its first step when the resumed checkpoint is the last step (a run
    preempted in its final evaluation): weights, optimizer and log are loaded by then, and the Trainer would
    otherwise take one step past max_steps before it looks."""
    from transformers import TrainerCallback

    class StopIfAlreadyTrained(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if state.global_step >= state.max_steps:
                raise _AlreadyTrained

    return StopIfAlreadyTrained()


def fit(trainer, checkpoint, stop):
    """``trainer.train()`` (from ``checkpoint`` when resuming; nothing left to train when it is the last step); a
    SIGTERM stop (with its checkpoint) becomes KeyboardInterrupt, a SIGUSR1 one
    Preempted. Returns the result and the seconds it took."""
    from transformers.trainer_utils import TrainOutput

    started = time.perf_counter()
    # The Trainer starts with a full garbage collection (accelerate's free_memory), which walks every object the
    # libraries made: a quarter of a second, 5% of a 40-step tiny run (python -m my_utils bench overhead). Frozen,
    # those objects are left out of it; nothing made during training is.
    gc.freeze()
    try:
        result = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    except _AlreadyTrained:
        print0(f"{checkpoint.name} is the last step: evaluating and finishing the run without training further")
        return TrainOutput(trainer.state.global_step, None, {}), 0.0
    finally:
        gc.unfreeze()
    if stop.stopped:
        step = trainer.state.global_step
        stopped = Preempted if Sigterm.name == "SIGUSR1" else KeyboardInterrupt
        raise stopped(f"{Sigterm.name}; stopped after step {step} with {CHECKPOINTS}/checkpoint-{step}: "
                      "the same command with --resume continues")
    return result, time.perf_counter() - started


def save_adapter(model, folder: Path) -> int:
    """Save the adapter (safetensors) in ``folder``/adapter; returns the size of its weights file in bytes. A write
    the file system refuses (a full disk) is its one sentence (UserError), which the run records as it fails."""
    try:
        model.save_pretrained(folder / "adapter", safe_serialization=True)
    except OSError as e:
        refused = file_system_refusal(e)
        if refused is None:
            raise
        raise UserError(refused) from None
    return (folder / "adapter" / "adapter_model.safetensors").stat().st_size


def _loss_on(model, examples, tokenizer, cfg: Config) -> float | None:
    """``model``'s mean loss per predicted token on ``examples`` (``held_out_loss``); None without them."""
    if examples is None:
        return None
    return held_out_loss(model, examples, padding_collator(tokenizer), cfg.local_batch_size, _autocast_dtype(cfg))


def _autocast_dtype(cfg: Config):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.mixed_precision)


def build_summary(cfg: Config, world_size: int, trainer, result, checkpoint, measured: dict,
                  adapter_bytes: int | None) -> dict:
    """summary.json: the settings that ran (the adapter once, in run.json: ``my_utils.core.records.adapter_of``), the
    losses and quality before and after, speed, memory and sizes."""
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    steps = result.global_step
    start_step = int(checkpoint.name.rsplit("-", 1)[1]) if checkpoint else 0
    trained = steps > start_step
    settled_batch = trainer.state.train_batch_size or cfg.local_batch_size  # smaller after an --auto-batch-size retry
    global_batch = settled_batch * cfg.grad_accum * world_size
    before, after, memory, runtime = measured["before"] or {}, measured["after"] or {}, measured["memory"], \
        measured["runtime"]
    return {
        "workflow": "lora",
        "preset": cfg.preset,
        "method": cfg.method,
        "world_size": world_size,
        "backend": process_group_backend(),
        "local_batch_size": settled_batch,
        "local_batch_size_requested": cfg.local_batch_size,
        "auto_batch_size": cfg.auto_batch_size,
        "grad_accum": cfg.grad_accum,
        "global_batch_size": global_batch,
        "learning_rate": measured["learning_rate"],  # the rate that ran: cfg.learning_rate scaled by lr_scaling
        "lr_scaling": cfg.lr_scaling,
        "mixed_precision": cfg.mixed_precision,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "chunked_loss": measured["chunked_loss"],  # the setting, where the architecture allows it
        "compiled_graphs": measured["compiled_graphs"],  # with --compile: torch's count of the graphs it built
        "max_length": cfg.max_length,
        "steps": steps,
        "resumed_from_step": start_step if checkpoint else None,
        "train_loss_first": losses[0] if losses else None,
        "train_loss_final": losses[-1] if losses else None,
        "eval_loss_before": measured["eval_loss_before"],
        "eval_loss": measured["eval_loss"],
        "forgetting_loss_before": measured["forgetting_loss_before"],
        "forgetting_loss_after": measured["forgetting_loss_after"],
        "exact_match_before": before.get("exact_match"),
        "exact_match_after": after.get("exact_match"),
        "similarity_before": before.get("similarity"),
        "similarity_after": after.get("similarity"),
        "similarity_scorer": SIMILARITY_SCORER,
        "examples_after": after.get("examples"),
        # runtime and throughput of this process's training (after a resume: the resumed part)
        # (none when a resume found the last step already taken)
        "runtime_s": runtime if trained else None,
        "samples_per_s": (steps - start_step) * global_batch / runtime if trained else None,
        # the same per CPU second of the busiest process: steadier than wall-clock on a shared machine
        "samples_per_cpu_s": (steps - start_step) * global_batch / max(r["cpu_s"] for r in memory) if trained
        else None,
        "tokens_per_s": measured["tokens"] / runtime if trained else None,
        "trainable_params": measured["params"]["trainable"],
        "total_params": measured["params"]["total"],
        "adapter_bytes": adapter_bytes,
        "quantization": _quantization(trainer.model),
        "first_batches": measured["first_batches"],
        "memory": memory,
        "peak_memory_bytes": max(peak_bytes(r["end"]) for r in memory) if trained else None,
    }


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


def generation_eval(cfg, model, tokenizer, rows):
    """Exact match and similarity of greedy answers, on rank 0 (the other ranks wait); None when skipped."""
    from accelerate import PartialState

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


parse_args, main = command_line(Config, train, __name__, DESCRIPTION)
