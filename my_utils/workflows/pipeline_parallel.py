"""Pipeline parallelism with micro-batches on two or more processes (tensor parallel: ``tensor_parallel``).

    # a shell, 2 processes on a CPU (gloo): each process holds one stage of the tiny causal LM
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m my_utils.workflows.pipeline_parallel --preset tiny
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.pipeline_parallel --preset tiny --schedule 1f1b

The workflow cuts the model into one stage per process with ``balanced_layer_split`` (stages of about equal
parameter counts), traces it with ``torch.distributed.pipelining.pipeline`` and runs a schedule (GPipe or 1F1B)
over micro-batches. It first checks that the pipelined forward gives the plain model's output, then trains a few
steps and records what every stage did when: the timeline of the last step shows the pipeline's bubble.

Every run writes a results folder (run.json, metrics.jsonl, summary.json) with the world size each worker saw.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar

from my_utils import UserError
from my_utils.core.data import token_blocks
from my_utils.core.devices import per_rank_device
from my_utils.core.memory import peak_bytes, reset_peak, snapshot
from my_utils.core.models import build_causal_lm, load_tokenizer
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.pipeline import (SCHEDULES, busy_fraction, in_flight, make_schedule, peak_in_flight, pipeline_stage,
                                     record_timeline)
from my_utils.core.printing import get_world_size, print0, rank_print
from my_utils.core.splits import check_pipeline_split
from my_utils.core.stats import check_tolerances
from my_utils.run.cli import command_line
from my_utils.run.config import GlobalBatchSettings, check_choice, check_positive, setting
from my_utils.run.divergence import check_finite
from my_utils.run.faults import step_done
from my_utils.run.lifecycle import join_world, process_group_backend, run_lifecycle


DESCRIPTION = ("Pipeline parallelism: one model stage per process, micro-batches, GPipe or 1F1B. Needs 2+ processes: "
               "torchrun --nproc_per_node 2 -m my_utils.workflows.pipeline_parallel ..., or (on a CPU) "
               "ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m ...")


@dataclass
class Config(GlobalBatchSettings):
    schedule: str = setting("gpipe", "gpipe: all forwards, then all backwards; 1f1b: one forward, one backward, "
                            "alternating", choices=SCHEDULES)
    microbatches: int = setting(4, "micro-batches per step")
    TRAINING_DEFAULTS: ClassVar[dict] = {"global_batch_size": 16, "max_steps": 4, "max_length": 64}
    SETTING_HELP: ClassVar[dict] = {"global_batch_size": "sequences per step: the pipeline is one model replica, so "
                                                         "this is its whole batch, cut into --microbatches "
                                                         "micro-batches",
                                    "max_steps": "training steps after the output check",
                                    "max_length": "tokens per sequence"}


def validate(cfg: Config):
    """Check the config before anything starts; returns the preset."""
    preset = cfg.check_common()
    check_choice("schedule", cfg.schedule, SCHEDULES)
    check_positive("--microbatches", cfg.microbatches)
    preset.require("causal")
    stages = cfg.num_processes or get_world_size()  # one stage per process
    check_pipeline_split(stages, model_layers(preset), cfg.global_batch_size, cfg.microbatches, cfg.schedule)
    return preset


def model_layers(preset) -> int:
    """The number of layers of the preset's causal LM, from its config (nothing downloaded)."""
    from transformers import AutoConfig

    folder = preset.offline_config.get("causal") or preset.causal_model
    return AutoConfig.from_pretrained(folder).num_hidden_layers


def resolve(cfg: Config, preset, world_size: int) -> Config:
    """Every default settled, as run.json records it: the learning rate and the world size."""
    return replace(cfg, **cfg.settled(preset), num_processes=world_size)


# ---------------------------------------------------------------------------------------------- shared pieces


def disable_dropout(model) -> None:
    """Set every dropout to 0, so that a pipelined and a plain forward can be compared number for number."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def lm_loss(logits, labels):
    """Next-token cross-entropy: position t predicts token t + 1."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


# ---------------------------------------------------------------------------------------------- the workflow


def train(cfg: Config) -> dict:
    """Run the pipeline experiment; returns the summary on every rank (rank 0 writes it)."""
    from accelerate.utils import set_seed  # (transformers.set_seed would import peft and bitsandbytes: seconds)

    preset = validate(cfg)
    world_size = join_world(cfg.num_processes, cfg.timeout_s)
    if world_size < 2:
        raise UserError("pipeline_parallel splits the model over processes but this run has one; "
                        "launch it with torchrun --nproc_per_node 2 or accelerate launch --num_processes 2.")
    cfg = resolve(cfg, preset, world_size)
    set_seed(cfg.seed)
    return train_pipeline(cfg, preset, world_size)


def pipelined_forward(stage, schedule, batch, device) -> tuple:
    """Forward only, through the pipeline: the last stage's output (on the CPU) and mean loss on ``batch``; (None,
    None) on the other stages."""
    import torch

    losses: list = []
    with torch.no_grad():
        if stage.is_last:
            output = schedule.eval(target=batch.to(device), losses=losses)
            return output.cpu(), float(torch.stack(losses).detach().mean())
        schedule.eval(*((batch.to(device),) if stage.is_first else ()))
    return None, None


def untie(model) -> None:
    """Give the output layer its own copy of a tied input embedding: split over stages, the two live on different
    processes and train apart (real frameworks add a gradient sum between them), so the plain model that the
    pipeline is checked against must be untied the same way."""
    import torch

    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    if output is not None and output.weight is embedding.weight:
        output.weight = torch.nn.Parameter(embedding.weight.detach().clone())
        model.config.tie_word_embeddings = False


def plain_step(model, batch) -> tuple:
    """The plain model's output, loss and gradients (by parameter name) on ``batch``: what the pipeline must give."""
    output = model(input_ids=batch).logits
    loss = lm_loss(output, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return output.detach(), loss.item(), grads


def pipelined_gradients(stage, schedule, batch, device, reference_grads: dict) -> tuple[float | None, float]:
    """One forward and backward through the pipeline (no optimizer step): the last stage's mean loss (None
    elsewhere) and the largest difference of this stage's gradients from the plain model's, relative to the largest
    of them. The stage keeps the plain model's parameter names."""
    import torch

    losses: list = []
    args = (batch.to(device),) if stage.is_first else ()
    schedule.step(*args, **({"target": batch.to(device), "losses": losses} if stage.is_last else {}))
    grads = {name: p.grad for name, p in stage.submod.named_parameters() if p.grad is not None}
    scale = max(float(reference_grads[name].abs().max()) for name in grads)
    diff = max(float((g.cpu() - reference_grads[name]).abs().max()) for name, g in grads.items()) / scale
    stage.submod.zero_grad(set_to_none=True)
    return (float(torch.stack(losses).detach().mean()) if stage.is_last else None), diff


def train_steps(stage, schedule, optimizer, batches, device, events: list) -> tuple[list, tuple, float]:
    """One optimizer step per batch, every process updating only its own stage. Returns the last stage's losses
    (empty elsewhere), the last step's (start, end) wall-clock times, and the runtime; ``events`` (filled by
    ``record_timeline``) keeps the last step's timeline."""
    import torch
    import torch.distributed as dist

    losses, started = [], time.perf_counter()
    learning_rate = optimizer.param_groups[0]["lr"]
    for step, batch in enumerate(batches, start=1):
        events.clear()  # keep the last step's timeline
        dist.barrier()
        step_start = time.time()
        # region: a pipeline training step
        micro_losses: list = []
        args = (batch.to(device),) if stage.is_first else ()  # the first stage takes the tokens
        kwargs = {"target": batch.to(device), "losses": micro_losses} if stage.is_last else {}  # the last, the targets
        schedule.step(*args, **kwargs)  # every micro-batch's forward and backward, in the schedule's order
        check_finite(step, sum(micro_losses), stage.submod.parameters(), learning_rate)  # every stage stops together
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # endregion
        step_window = (step_start, time.time())
        if stage.is_last:
            losses.append(float(torch.stack(micro_losses).detach().mean()))
        step_done(step, dist.get_rank())  # the step a failure names; the tests' faults
    return losses, step_window, time.perf_counter() - started


def train_pipeline(cfg: Config, preset, world_size: int) -> dict:
    """Check that the pipelined model computes what the plain one does, then train it for a few steps."""
    import gc

    import torch
    import torch.distributed as dist

    rank, device = dist.get_rank(), per_rank_device()
    data = token_blocks(preset, load_tokenizer(preset), cfg.global_batch_size * (cfg.max_steps + 1), cfg.max_length)
    batch = cfg.global_batch_size
    check_batch, train_batches = data[:batch], data[batch:].split(batch)
    with run_lifecycle(cfg, world_size, default_dir=RUNS_ROOT / "pipeline_parallel" / f"{cfg.preset}_{cfg.schedule}",
                       workflow="pipeline_parallel") as life:
        model = build_causal_lm(preset, random_init=cfg.random_init)
        model.config.use_cache = False  # a key-value cache is for generation, and cannot be traced
        disable_dropout(model)
        untie(model)
        reference, reference_loss, reference_grads = plain_step(model, check_batch)
        micro = cfg.global_batch_size // cfg.microbatches
        stage, device_map = pipeline_stage(model, world_size, rank, torch.device(device), (check_batch[:micro],))
        del model  # each process keeps only its stage's weights
        gc.collect()
        stage_params = sum(p.numel() for p in stage.submod.parameters())
        my_modules = [name for name, s in device_map.items() if s == rank]
        rank_print(f"stage {rank}: {my_modules[0]} .. {my_modules[-1]}, {stage_params:,} parameters")

        # 1. Forward only: the last stage's output and loss must equal the plain model's.
        schedule = make_schedule(cfg.schedule, stage, cfg.microbatches, loss_fn=lm_loss)
        output, pipelined_loss = pipelined_forward(stage, schedule, check_batch, device)
        # 2. Forward and backward: every stage's gradients must equal the plain model's.
        step_loss, grad_diff = pipelined_gradients(stage, schedule, check_batch, device, reference_grads)

        # 3. Training steps: every process updates only its own stage, and times what it computes.
        optimizer = torch.optim.AdamW([p for p in stage.submod.parameters() if p.requires_grad], lr=cfg.learning_rate)
        events: list[dict] = []
        record_timeline(stage, events)
        reset_peak(device)
        losses, step_window, runtime = train_steps(stage, schedule, optimizer, train_batches, device, events)
        reports = life.gather({
            "process": rank, "world_size_seen": dist.get_world_size(), "modules": my_modules,
            "parameters": stage_params, "pipelined_loss": pipelined_loss, "losses": losses, "timeline": events,
            "step_loss": step_loss, "grad_rel_diff": grad_diff, "in_flight": peak_in_flight(events),
            "max_abs_diff": float((output - reference).abs().max()) if output is not None else None,
            "step": step_window, "memory": {"process": rank, "end": snapshot(device)}})
        if life.is_main:
            for i, loss in enumerate(reports[-1]["losses"], start=1):
                life.log({"step": i, "loss": loss})
        life.finish(pipeline_summary(cfg, world_size, reports, reference_loss, runtime) if life.is_main else None)
        print0(f"pipelined output vs plain model: max |difference| {life.summary['max_abs_diff']:.2e}")
    check_tolerances(life.summary, "The pipelined model and the plain model")
    return life.summary


# The largest differences from the plain model that count as equal: float32 rounding of the same sums over smaller
# micro-batches (the output's logits, absolute; the gradients, relative to the largest of them)
TOLERANCES = {"max_abs_diff": 1e-4, "grad_rel_diff": 1e-5}


def pipeline_summary(cfg: Config, world_size: int, reports: list, reference_loss: float, runtime: float) -> dict:
    """summary.json of a pipeline run: the output check, the losses, and every stage's timeline and memory."""
    last = reports[-1]
    step_start, step_end = min(r["step"][0] for r in reports), max(r["step"][1] for r in reports)
    return {
        "workflow": "pipeline_parallel", "preset": cfg.preset, "schedule": cfg.schedule,
        "world_size": world_size, "world_sizes_seen": [r["world_size_seen"] for r in reports],
        "backend": process_group_backend(), "microbatches": cfg.microbatches,
        "global_batch_size": cfg.global_batch_size,  # one model replica: the whole batch
        "max_length": cfg.max_length, "steps": cfg.max_steps, "learning_rate": cfg.learning_rate,
        "stage_modules": [r["modules"] for r in reports],
        "stage_parameters": [r["parameters"] for r in reports],
        "max_abs_diff": last["max_abs_diff"],
        "step_loss": last["step_loss"],
        "grad_rel_diff": max(r["grad_rel_diff"] for r in reports),
        "tolerances": TOLERANCES,
        # activations wait for their backward: GPipe keeps every micro-batch's, 1F1B at most one per later stage
        "in_flight": [r["in_flight"] for r in reports],
        "in_flight_expected": [in_flight(cfg.schedule, world_size, cfg.microbatches, r) for r in range(world_size)],
        "reference_loss": reference_loss,
        "pipelined_loss": last["pipelined_loss"],
        "train_loss_first": last["losses"][0],
        "train_loss_final": last["losses"][-1],
        "runtime_s": runtime,
        "samples_per_s": cfg.max_steps * cfg.global_batch_size / runtime,
        # GPipe's idle share with S stages and M micro-batches (equal stages, no communication)
        "bubble_fraction_theory": (world_size - 1) / (cfg.microbatches + world_size - 1),
        "busy_fraction": [busy_fraction(r["timeline"], step_start, step_end) for r in reports],
        "timeline": {f"rank {r['process']}": r["timeline"] for r in reports},
        "timeline_window": [step_start, step_end],
        "memory": [r["memory"] for r in reports],
        "peak_memory_bytes": max(peak_bytes(r["memory"]["end"]) for r in reports),
    }


parse_args, main = command_line(Config, train, __name__, DESCRIPTION)
