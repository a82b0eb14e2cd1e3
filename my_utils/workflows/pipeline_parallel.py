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
from my_utils.core.printing import get_world_size
from my_utils.run.config import TrainingSettings, parse_config, setting
from my_utils.run.results import RUNS_ROOT

SCHEDULES = ("gpipe", "1f1b")


@dataclass
class Config(TrainingSettings):
    schedule: str = setting("gpipe", "gpipe: all forwards, then all backwards; 1f1b: one forward, one backward, "
                            "alternating", choices=SCHEDULES)
    microbatches: int = setting(4, "micro-batches per step")
    TRAINING_DEFAULTS: ClassVar[dict] = {"batch_size": 16, "max_steps": 4, "max_length": 64}
    SETTING_HELP: ClassVar[dict] = {"batch_size": "sequences per step: the pipeline is one model replica, so this is "
                                                  "its whole batch, cut into --microbatches micro-batches",
                                    "max_steps": "training steps after the output check",
                                    "max_length": "tokens per sequence"}


def validate(cfg: Config):
    """Check the config before anything starts; returns the preset."""
    from my_utils.run.config import check_choice, check_positive

    preset = cfg.check_common()
    check_choice("schedule", cfg.schedule, SCHEDULES)
    for name in ("microbatches", "batch_size", "max_length", "max_steps"):
        check_positive(f"--{name.replace('_', '-')}", getattr(cfg, name))
    if cfg.learning_rate is not None:
        check_positive("--learning-rate", cfg.learning_rate, float)
    if cfg.batch_size % cfg.microbatches:
        raise UserError(f"--batch-size {cfg.batch_size} does not split into {cfg.microbatches} equal micro-batches; "
                        "make it a multiple of --microbatches.")
    preset.require("causal")
    stages = cfg.num_processes or get_world_size()  # one stage per process
    if cfg.schedule == "1f1b" and cfg.microbatches < stages:
        raise UserError(f"1F1B needs at least one micro-batch per stage: --microbatches {cfg.microbatches} for "
                        f"{stages} stages; use --microbatches {stages} or more, or --schedule gpipe.")
    layers = model_layers(preset)
    if stages > layers:
        raise UserError(f"{stages} stages for a model of {layers} layers leave a stage without one; launch "
                        f"{layers} processes or fewer.")
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


# region: one stage per process, and a schedule
def pipeline_stage(model, n_stages: int, stage_index: int, device, example_args: tuple, example_kwargs=None):
    """This process's stage of ``model`` cut into ``n_stages`` (a ``PipelineStage``), and the split's device map.

    The cut points come from ``balanced_layer_split``; ``pipeline()`` traces the model with one micro-batch of
    example inputs (so every micro-batch must have that shape) and keeps the original parameters, so the stage
    trains the very weights of ``model``.
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    from my_utils.core.devices import balanced_layer_split

    device_map = balanced_layer_split(model, range(n_stages))
    starts = {}
    for name, stage in device_map.items():
        starts.setdefault(stage, name)
    split_spec = {starts[s]: SplitPoint.BEGINNING for s in range(1, n_stages)}
    pipe = pipeline(model, mb_args=example_args, mb_kwargs=example_kwargs or {}, split_spec=split_spec)
    return pipe.build_stage(stage_index, device), device_map


def make_schedule(name: str, stage, microbatches: int, loss_fn=None):
    """A GPipe or 1F1B schedule over ``stage`` (gradients averaged over micro-batches, as for one whole batch)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name](stage, n_microbatches=microbatches, loss_fn=loss_fn)
# endregion


def in_flight(schedule: str, stages: int, microbatches: int, stage: int) -> int:
    """Micro-batches stage ``stage`` (0 first) holds between their forward and their backward at its peak: GPipe
    runs every forward first (all M), 1F1B starts a backward as soon as one can (S - s of them, at most M). The
    planner (``my_utils.tools.planner.model_parallel``) plans pipeline memory with it."""
    return microbatches if schedule == "gpipe" else min(stages - stage, microbatches)


MULTI_STAGE_SCHEDULES = {  # torch's schedules with several stages per process, by the names their papers use
    "interleaved 1F1B": "ScheduleInterleaved1F1B", "interleaved zero bubble": "ScheduleInterleavedZeroBubble",
    "zero bubble V": "ScheduleZBVZeroBubble"}


# The zero-bubble paper's cost model: a forward, an input gradient (I) and a weight gradient (W) take one unit of time
# each, a whole backward (B = I + W) two.
ACTION_COST = {"FORWARD": 1, "BACKWARD_INPUT": 1, "BACKWARD_WEIGHT": 1, "FULL_BACKWARD": 2}


def action_table(schedule: str, processes: int, microbatches: int, stages_per_process: int = 2) -> tuple[str, float]:
    """The order of work a multi-stage schedule gives each process, as torch formats it ("2F1": stage 2's forward of
    micro-batch 1; B a backward, or I and W: a backward split into its input and weight gradients), and the share of
    the processes' time left idle. torch computes the order at construction from each stage's place alone, so
    stand-in stages (no process group, no model) are enough. The idle share reads the table as a pipeline in lock
    step: each column lasts as long as its longest action (``ACTION_COST``), and a process idles for the rest of
    it, or the whole of it when it has no action there."""
    from types import SimpleNamespace

    import torch
    from torch.distributed.pipelining import schedules

    n_stages = processes * stages_per_process
    # rank 0's stages: round robin (0, P, 2P...), or a V for the zero-bubble V schedule (0 and 2P - 1)
    mine = (0, n_stages - 1) if schedule == "zero bubble V" else range(0, n_stages, processes)
    stages = [SimpleNamespace(stage_index=i, num_stages=n_stages, group_size=processes, group_rank=0, is_first=i == 0,
                              is_last=i == n_stages - 1, submod=torch.nn.Identity()) for i in mine]
    order = getattr(schedules, MULTI_STAGE_SCHEDULES[schedule])(stages, n_microbatches=microbatches).pipeline_order
    length = max(len(actions) for actions in order.values())
    lanes = [[ACTION_COST[a.computation_type.name] if a is not None else 0 for a in actions]
             + [0] * (length - len(actions)) for actions in order.values()]
    elapsed = sum(max(column) for column in zip(*lanes))
    return schedules._format_pipeline_order(order), 1 - sum(map(sum, lanes)) / (elapsed * len(lanes))


def record_timeline(stage, events: list) -> None:
    """Append ``{kind, microbatch, start, end}`` to ``events`` each time ``stage`` computes a micro-batch's forward
    or backward (communication waits are outside these calls, so the gaps are idle time)."""

    def timed(kind, method):
        def wrapper(chunk, *args, **kwargs):
            start = time.time()  # wall clock: comparable between processes of one machine
            try:
                return method(chunk, *args, **kwargs)
            finally:
                events.append({"kind": kind, "microbatch": chunk, "start": start, "end": time.time()})

        return wrapper

    stage.forward_one_chunk = timed("forward", stage.forward_one_chunk)
    stage.backward_one_chunk = timed("backward", stage.backward_one_chunk)


def busy_fraction(events: list[dict], start: float, end: float) -> float:
    """The share of [start, end] a lane spent computing."""
    return sum(e["end"] - e["start"] for e in events) / (end - start)


def concurrent_time(lanes: dict[str, list[dict]]) -> float:
    """Seconds during which two or more lanes computed at once (0 for a naive split, > 0 for a pipeline)."""
    edges = sorted(edge for events in lanes.values() for e in events for edge in ((e["start"], 1), (e["end"], -1)))
    busy, total, previous = 0, 0.0, None
    for t, step in edges:
        if busy >= 2:
            total += t - previous
        busy, previous = busy + step, t
    return total


def naive_split_timeline(model, device_map: dict, batches) -> dict[str, list[dict]]:
    """Run ``model`` on ``batches`` and time each stage of ``device_map``: what a naive model-parallel split does
    on several devices (stage after stage, one busy at a time), measured here on one device.

    Returns ``{"stage <device>": [{kind, microbatch, start, end}, ...]}``: a forward pre-hook on a stage's first
    module starts its interval, a forward hook on its last module ends it.
    """
    import torch

    modules = dict(model.named_modules())
    stages: dict = {}
    for name, device in device_map.items():
        stages.setdefault(device, []).append(name)
    lanes = {f"stage {d}": [] for d in stages}
    current = {}
    handles = []
    for device, names in stages.items():
        lane = f"stage {device}"
        handles.append(modules[names[0]].register_forward_pre_hook(
            lambda m, a, lane=lane: current.update({lane: time.time()})))
        handles.append(modules[names[-1]].register_forward_hook(
            lambda m, a, o, lane=lane: lanes[lane].append(
                {"kind": "forward", "microbatch": current["batch"], "start": current[lane], "end": time.time()})))
    try:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                current["batch"] = i
                model(**batch)
    finally:
        for h in handles:
            h.remove()
    return lanes


def plot_timeline(lanes: dict[str, list[dict]], path, title: str):
    """A Gantt chart: one row per stage or rank, a bar per forward (blue) or backward (orange), numbered by
    micro-batch; white space is idle time."""
    from my_utils.core.plots import new_figure, save

    t0 = min(e["start"] for events in lanes.values() for e in events)
    fig = new_figure(9, 1.0 + 0.7 * len(lanes))
    ax = fig.add_subplot()
    colors = {"forward": "C0", "backward": "C1"}
    for row, (lane, events) in enumerate(lanes.items()):
        for e in events:
            left, width = (e["start"] - t0) * 1000, (e["end"] - e["start"]) * 1000
            ax.barh(row, width, left=left, color=colors[e["kind"]], edgecolor="white")
            ax.text(left + width / 2, row, str(e["microbatch"]), ha="center", va="center", color="white",
                    fontsize="small")
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.invert_yaxis()
    ax.set(xlabel="time (ms)", title=title)
    from matplotlib.patches import Patch

    kinds = [k for k in colors if any(e["kind"] == k for events in lanes.values() for e in events)]
    ax.legend(handles=[Patch(color=colors[k], label=k) for k in kinds], loc="upper right", fontsize="small")
    return save(fig, path)


def lm_loss(logits, labels):
    """Next-token cross-entropy: position t predicts token t + 1."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


# ---------------------------------------------------------------------------------------------- the workflow


def train(cfg: Config) -> dict:
    """Run the pipeline experiment; returns the summary on every rank (rank 0 writes it)."""
    from accelerate.utils import set_seed  # (transformers.set_seed would import peft and bitsandbytes: seconds)

    from my_utils.run.lifecycle import join_world

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


def peak_in_flight(events: list[dict]) -> int:
    """The most micro-batches a stage held at once between their forward and their backward (each one's
    activations wait in memory for its backward): GPipe holds all of them, 1F1B at most the stages after it."""
    held, peak = 0, 0
    for event in sorted(events, key=lambda e: e["start"]):
        held += 1 if event["kind"] == "forward" else -1
        peak = max(peak, held)
    return peak


def train_steps(stage, schedule, optimizer, batches, device, events: list) -> tuple[list, tuple, float]:
    """One optimizer step per batch, every process updating only its own stage. Returns the last stage's losses
    (empty elsewhere), the last step's (start, end) wall-clock times, and the runtime; ``events`` (filled by
    ``record_timeline``) keeps the last step's timeline."""
    import torch
    import torch.distributed as dist

    losses, started = [], time.perf_counter()
    for batch in batches:
        events.clear()  # keep the last step's timeline
        dist.barrier()
        step_start = time.time()
        # region: a pipeline training step
        micro_losses: list = []
        args = (batch.to(device),) if stage.is_first else ()  # the first stage takes the tokens
        kwargs = {"target": batch.to(device), "losses": micro_losses} if stage.is_last else {}  # the last, the targets
        schedule.step(*args, **kwargs)  # every micro-batch's forward and backward, in the schedule's order
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # endregion
        step_window = (step_start, time.time())
        if stage.is_last:
            losses.append(float(torch.stack(micro_losses).detach().mean()))
    return losses, step_window, time.perf_counter() - started


def train_pipeline(cfg: Config, preset, world_size: int) -> dict:
    """Check that the pipelined model computes what the plain one does, then train it for a few steps."""
    import gc

    import torch
    import torch.distributed as dist

    from my_utils.core.devices import per_rank_device
    from my_utils.core.memory import reset_peak, snapshot
    from my_utils.core.data import token_blocks
    from my_utils.core.models import build_causal_lm, load_tokenizer
    from my_utils.core.printing import print0, rank_print
    from my_utils.run.lifecycle import run_lifecycle

    rank, device = dist.get_rank(), per_rank_device()
    data = token_blocks(preset, load_tokenizer(preset), cfg.batch_size * (cfg.max_steps + 1), cfg.max_length)
    check_batch, train_batches = data[: cfg.batch_size], data[cfg.batch_size :].split(cfg.batch_size)
    with run_lifecycle(cfg, world_size, default_dir=RUNS_ROOT / "pipeline_parallel" / f"{cfg.preset}_{cfg.schedule}",
                       workflow="pipeline_parallel") as life:
        model = build_causal_lm(preset, random_init=cfg.random_init)
        model.config.use_cache = False  # a key-value cache is for generation, and cannot be traced
        disable_dropout(model)
        untie(model)
        reference, reference_loss, reference_grads = plain_step(model, check_batch)
        micro = cfg.batch_size // cfg.microbatches
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
            "rank": rank, "world_size_seen": dist.get_world_size(), "modules": my_modules,
            "parameters": stage_params, "pipelined_loss": pipelined_loss, "losses": losses, "timeline": events,
            "step_loss": step_loss, "grad_rel_diff": grad_diff, "in_flight": peak_in_flight(events),
            "max_abs_diff": float((output - reference).abs().max()) if output is not None else None,
            "step": step_window, "memory": {"rank": rank, "end": snapshot(device)}})
        if life.is_main:
            for i, loss in enumerate(reports[-1]["losses"], start=1):
                life.log({"step": i, "loss": loss})
        life.finish(pipeline_summary(cfg, world_size, reports, reference_loss, runtime) if life.is_main else None)
        print0(f"pipelined output vs plain model: max |difference| {life.summary['max_abs_diff']:.2e}")
    return life.summary


def pipeline_summary(cfg: Config, world_size: int, reports: list, reference_loss: float, runtime: float) -> dict:
    """summary.json of a pipeline run: the output check, the losses, and every stage's timeline and memory."""
    from my_utils.core.memory import peak_bytes
    from my_utils.run.lifecycle import process_group_backend

    last = reports[-1]
    step_start, step_end = min(r["step"][0] for r in reports), max(r["step"][1] for r in reports)
    return {
        "workflow": "pipeline_parallel", "preset": cfg.preset, "schedule": cfg.schedule,
        "world_size": world_size, "world_sizes_seen": [r["world_size_seen"] for r in reports],
        "backend": process_group_backend(), "microbatches": cfg.microbatches,
        "batch_size": cfg.batch_size, "effective_batch": cfg.batch_size,  # one model replica: the whole batch
        "max_length": cfg.max_length, "steps": cfg.max_steps, "learning_rate": cfg.learning_rate,
        "stage_modules": [r["modules"] for r in reports],
        "stage_parameters": [r["parameters"] for r in reports],
        "max_abs_diff": last["max_abs_diff"],
        "step_loss": last["step_loss"],
        "grad_rel_diff": max(r["grad_rel_diff"] for r in reports),
        # activations wait for their backward: GPipe keeps every micro-batch's, 1F1B at most one per later stage
        "in_flight": [r["in_flight"] for r in reports],
        "in_flight_expected": [in_flight(cfg.schedule, world_size, cfg.microbatches, r) for r in range(world_size)],
        "reference_loss": reference_loss,
        "pipelined_loss": last["pipelined_loss"],
        "train_loss_first": last["losses"][0],
        "train_loss_final": last["losses"][-1],
        "runtime_s": runtime,
        "samples_per_s": cfg.max_steps * cfg.batch_size / runtime,
        # GPipe's idle share with S stages and M micro-batches (equal stages, no communication)
        "bubble_fraction_theory": (world_size - 1) / (cfg.microbatches + world_size - 1),
        "busy_fraction": [busy_fraction(r["timeline"], step_start, step_end) for r in reports],
        "timeline": {f"rank {r['rank']}": r["timeline"] for r in reports},
        "timeline_window": [step_start, step_end],
        "memory": [r["memory"] for r in reports],
        "peak_memory_bytes": max(peak_bytes(r["memory"]["end"]) for r in reports),
    }


DESCRIPTION = ("Pipeline parallelism: one model stage per process, micro-batches, GPipe or 1F1B. Needs 2+ processes: "
               "torchrun --nproc_per_node 2 -m my_utils.workflows.pipeline_parallel ..., or (on a CPU) ACCELERATE_USE_CPU=1 accelerate launch --config_file "
               "configs/cpu_x2.yaml -m ...")


def parse_args(argv=None) -> Config:
    return parse_config(Config, argv, prog="python -m my_utils.workflows.pipeline_parallel", description=DESCRIPTION)


def main(argv=None) -> dict:
    from my_utils.run.cli import run_main

    return run_main(lambda: train(parse_args(argv)), prefix="pipeline_parallel")


if __name__ == "__main__":
    from my_utils.run.cli import run_as_script

    run_as_script(main)
