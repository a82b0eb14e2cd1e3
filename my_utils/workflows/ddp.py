"""Distributed data parallel (DDP) in raw PyTorch: full fine-tuning of the preset's causal LM on packed blocks.

Every process holds a whole copy of the model on the device of its local rank, reads its own share of each
global batch (``DistributedSampler``) and, during ``backward()``, DDP averages the gradients of all processes
(an all-reduce), so every copy takes the same optimizer step: two processes with batch b train exactly like
one process with batch 2b.

    # one process (a process group of one)
    python -m my_utils.workflows.ddp --preset tiny
    # two processes on one machine: torchrun, accelerate launch or (in a notebook) my_utils.run.launch.launch
    torchrun --standalone --nproc_per_node 2 -m my_utils.workflows.ddp --preset tiny
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.ddp --preset tiny
    # two machines (run on each, node_rank 0 and 1; the first machine's address)
    torchrun --nnodes 2 --nproc_per_node 1 --node_rank 0 --master_addr 10.0.0.1 --master_port 29500 \\
        -m my_utils.workflows.ddp --preset tiny

The same training with the transformers Trainer is ``my_utils.workflows.ddp_trainer`` (same flags). Each run
writes a results folder: run.json, metrics.jsonl, summary.json (loss, samples/s, tokens/s, memory on every
rank) and workers/rank_<r>.json (the world size, backend and model device each worker saw).
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import ClassVar

from my_utils.core.blocks import block_dataset
from my_utils.core.data import check_enough_rows
from my_utils.core.devices import local_rank, per_rank_device, per_rank_device_map
from my_utils.core.learning_rate import LR_SCALING, scale_learning_rate
from my_utils.core.memory import peak_bytes, reset_peak, snapshot
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.printing import print0, rank_print
from my_utils.run.cli import command_line
from my_utils.run.config import LocalBatchSettings, check_choice, check_positive, setting
from my_utils.run.divergence import check_finite
from my_utils.run.faults import step_done
from my_utils.run.lifecycle import join_world, run_lifecycle
from my_utils.workflows.ddp_common import (build_model, throughput, untimed_steps, validate_common, worker_report,
                                           write_worker_report)

OPTIMIZERS = ("adamw", "sgd")


DESCRIPTION = ("Full fine-tuning with DistributedDataParallel in raw PyTorch. Writes a results folder and prints its "
               "summary. Several processes: `torchrun --nproc_per_node 2 -m my_utils.workflows.ddp` or (on a CPU) "
               "`ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.ddp`.")


@dataclass
class Config(LocalBatchSettings):
    TRAINING_DEFAULTS: ClassVar[dict] = {"local_batch_size": 8, "max_steps": 20, "max_length": 128}
    SETTING_HELP: ClassVar[dict] = {"local_batch_size": "blocks per process per micro-batch: the global batch is "
                                                        "local_batch_size x grad_accum x processes",
                                    "max_length": "tokens per packed block"}
    grad_accum: int = setting(1, "micro-batches per optimizer step")
    lr_scaling: str = setting("none", "scale the learning rate from the preset's batch to the global batch",
                              choices=LR_SCALING)
    optimizer: str = setting("adamw", "sgd makes runs that see equal gradients end with visibly equal weights",
                             choices=OPTIMIZERS)
    dropout: float = setting(0.0, "dropout probability everywhere")
    untimed_steps: int | None = setting(None, "first steps left out of the throughput figures (allocation, caches; "
                                        "default 2, fewer for shorter runs)")
    logging_steps: int = setting(5, "steps between metrics lines")
    save_model: bool = setting(False, "save the final weights (safetensors) in the results folder")


def validate(cfg: Config):
    """Check the config before anything starts; returns the preset."""
    preset = validate_common(cfg)
    check_choice("learning-rate scaling", cfg.lr_scaling, LR_SCALING)
    check_choice("optimizer", cfg.optimizer, OPTIMIZERS)
    check_positive("--logging-steps", cfg.logging_steps)
    return preset


def resolve(cfg: Config, preset, world_size: int) -> Config:
    """Every default settled, as run.json records it: the learning rate (before ``--lr-scaling``, as given; the
    summary records the rate used) and the untimed steps."""
    return replace(cfg, **cfg.settled(preset), untimed_steps=untimed_steps(cfg), num_processes=world_size)


def step_learning_rate(cfg: Config, preset, world_size: int) -> float:
    """The rate the optimizer uses: ``cfg.learning_rate`` scaled from the preset's batch to the global batch."""
    return scale_learning_rate(cfg.learning_rate, cfg.global_batch(world_size), preset.batch_size,
                               cfg.lr_scaling)


def init_process_group() -> None:
    """Join the process group described by the launcher's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
    (torchrun, accelerate launch and notebook_launcher all set them), or form a group of one without a launcher."""
    import torch.distributed as dist

    from my_utils.core.devices import cuda_available
    from my_utils.run.launch import free_port, join_restarted_group

    join_restarted_group()
    if dist.is_initialized():
        return
    backend = "nccl" if cuda_available() else "gloo"  # gloo: the CPU backend
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)  # reads the environment variables set by the launcher
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def make_optimizer(name: str, parameters, learning_rate: float):
    """AdamW (the default), or plain SGD. Adam divides each update by the gradient's running size, so it
    magnifies float rounding on parameters whose gradient is ~0 and it hides a gradient scaled by a constant:
    comparisons of runs (DDP against one process) use SGD."""
    import torch

    if name == "sgd":
        return torch.optim.SGD(parameters, lr=learning_rate)
    return torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=0.0)


def batches_forever(loader, sampler):
    """Batches across epochs; ``set_epoch`` gives every epoch a new shuffle, the same one on every rank."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def train(cfg: Config) -> dict:
    """Train with DDP; returns the summary (on every rank; rank 0 also writes it)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler
    from tqdm.auto import tqdm

    preset = validate(cfg)
    init_process_group()
    world_size = join_world(cfg.num_processes, cfg.timeout_s)
    cfg = resolve(cfg, preset, world_size)
    rank = dist.get_rank()
    torch.manual_seed(cfg.seed)  # (transformers.set_seed would import bitsandbytes)
    global_batch = cfg.global_batch(world_size)
    learning_rate = step_learning_rate(cfg, preset, world_size)
    dataset = block_dataset(preset, cfg.max_length)
    check_enough_rows(len(dataset), global_batch)
    with run_lifecycle(cfg, world_size, default_dir=RUNS_ROOT / "ddp" / f"{cfg.preset}_x{world_size}",
                       workflow="ddp") as life:
        # region: the DDP training
        # Every process holds the whole model, on the device of its local rank (its index on this machine).
        device, device_map = per_rank_device(), per_rank_device_map()
        model = build_model(preset, random_init=cfg.random_init, dropout=cfg.dropout, device_map=device_map)
        report = worker_report(model, device_map=device_map)
        write_worker_report(life.folder, report)
        rank_print(f"world size {report['world_size']}, backend {report['backend']}, model on {report['model_device']}")
        # DDP broadcasts rank 0's weights to every process, then all-reduces gradients during backward().
        model = DistributedDataParallel(model, device_ids=[local_rank()] if device.startswith("cuda") else None)

        # Each rank reads a different 1/world_size of every epoch's shuffled order.
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed,
                                     drop_last=True)
        loader = DataLoader(dataset, batch_size=cfg.local_batch_size, sampler=sampler, drop_last=True)
        optimizer = make_optimizer(cfg.optimizer, model.parameters(), learning_rate)
        print0(f"{len(dataset)} blocks of {cfg.max_length} tokens; global batch {global_batch} = "
               f"{cfg.local_batch_size} x {cfg.grad_accum} accumulation x {world_size} processes; learning rate {learning_rate:g}")

        stream = batches_forever(loader, sampler)
        losses = []
        reset_peak(device)
        model.train()
        loop_started = time.perf_counter()
        for step in tqdm(range(1, cfg.max_steps + 1), desc="ddp", disable=rank != 0):
            if step == cfg.untimed_steps + 1:
                started, cpu_started = time.perf_counter(), time.process_time()
            step_loss = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                batch = {k: v.to(device) for k, v in next(stream).items()}
                # Gradients are all-reduced on the last micro-batch only: no_sync() skips the communication.
                with nullcontext() if micro == cfg.grad_accum - 1 else model.no_sync():
                    loss = model(**batch).loss / cfg.grad_accum
                    loss.backward()
                step_loss += loss.detach()
            check_finite(step, step_loss, model.parameters(), learning_rate)  # a diverged step stops here
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dist.all_reduce(step_loss, op=dist.ReduceOp.SUM)  # for the log only: the mean over ranks
            losses.append(step_loss.item() / world_size)
            if step % cfg.logging_steps == 0 or step == cfg.max_steps:
                life.log({"step": step, "loss": losses[-1], "time": time.time()})
            step_done(step, rank)  # the step a failure names; the tests' faults
        # endregion
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        timing = {"elapsed": time.perf_counter() - started, "runtime": time.perf_counter() - loop_started}
        # CPU seconds of this process (all its threads, gloo's included) over the timed steps: on a shared machine
        # they tell the work done apart from the time spent waiting for a core.
        per_rank = life.gather({"process": rank, "end": snapshot(device), "cpu_seconds": time.process_time() - cpu_started})
        if life.is_main and cfg.save_model:
            model.module.save_pretrained(life.folder / "model", safe_serialization=True)
        life.finish(summarize(cfg, world_size, learning_rate, losses, timing, per_rank, report) if life.is_main
                    else None)
    return life.summary


def summarize(cfg: Config, world_size: int, learning_rate: float, losses: list, timing: dict, per_rank: list,
              report: dict) -> dict:
    """The summary of a finished run (rank 0): settings, losses, throughput over the timed steps, memory per rank."""
    import torch

    global_batch = cfg.global_batch(world_size)
    return {
        "workflow": "ddp", "preset": cfg.preset, "world_size": world_size, "backend": report["backend"],
        "threads_per_process": torch.get_num_threads(), "local_batch_size": cfg.local_batch_size,
        "grad_accum": cfg.grad_accum, "global_batch_size": global_batch, "max_length": cfg.max_length,
        "learning_rate": learning_rate, "steps": cfg.max_steps,
        "train_loss_first": losses[0], "train_loss_final": losses[-1], "runtime_s": timing["runtime"],
        **throughput(cfg.max_steps - cfg.untimed_steps, global_batch, cfg.max_length, timing["elapsed"]),
        "cpu_seconds_per_rank": [r["cpu_seconds"] for r in per_rank],
        "memory": per_rank, "peak_memory_bytes": max(peak_bytes(r["end"]) for r in per_rank),
    }


parse_args, main = command_line(Config, train, __name__, DESCRIPTION)
