"""Distributed data parallel (DDP) in raw PyTorch: full fine-tuning of the preset's causal LM on packed blocks.

Every process holds a whole copy of the model on the device of its local rank, reads its own share of each
global batch (``DistributedSampler``) and, during ``backward()``, DDP averages the gradients of all processes
(an all-reduce), so every copy takes the same optimizer step: two processes with batch b train exactly like
one process with batch 2b.

    # one process (a process group of one)
    python -m my_utils.workflows.ddp --preset tiny
    # two processes on one machine: torchrun, accelerate launch or (in a notebook) my_utils.run.launch.launch
    torchrun --standalone --nproc_per_node 2 -m my_utils.workflows.ddp --preset tiny
    accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.ddp --preset tiny
    # two machines (run on each, node_rank 0 and 1; the first machine's address)
    torchrun --nnodes 2 --nproc_per_node 1 --node_rank 0 --master_addr 10.0.0.1 --master_port 29500 \\
        -m my_utils.workflows.ddp --preset tiny

The same training with the transformers Trainer is ``my_utils.workflows.ddp_trainer`` (same flags). Each run
writes a results folder: run.json, metrics.jsonl, summary.json (loss, samples/s, tokens/s, memory on every
rank) and workers/rank_<r>.json (the world size, backend and model device each worker saw).
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

from my_utils.run.results import RUNS_ROOT

OPTIMIZERS = ("adamw", "sgd")


@dataclass
class Config:
    preset: str = "tiny"
    batch_size: int = 8  # per process: the global batch is batch_size x grad_accum x processes
    grad_accum: int = 1
    max_steps: int = 20  # optimizer steps
    max_length: int = 128  # tokens per packed block
    learning_rate: float | None = None  # default: the preset's, divided by 10 (full fine-tuning)
    lr_scaling: str = "none"  # none | linear | sqrt, from the preset's batch to the global batch
    optimizer: str = "adamw"  # adamw | sgd (plain SGD makes equal gradients give visibly equal weights)
    dropout: float = 0.0
    seed: int = 0
    warmup_steps: int | None = None  # first steps left out of samples/s (default 2: allocation, caches)
    log_every: int = 5
    save_model: bool = False  # save the final weights (safetensors) into the results folder
    output_dir: str | None = None  # default: runs/ddp/<preset>_x<processes>
    num_processes: int | None = None  # what the launch asked for; checked inside every worker
    random_init: bool = False  # random weights from the shipped config (offline, for speed measurements)


def validate(cfg: Config):
    """Check the config before anything starts; returns the preset."""
    from my_utils import UserError
    from my_utils.core.learning_rate import LR_SCALING
    from my_utils.run.config import check_positive
    from my_utils.workflows.ddp_common import validate_common

    preset = validate_common(cfg)
    if cfg.lr_scaling not in LR_SCALING:
        raise UserError(f"Unknown learning-rate scaling {cfg.lr_scaling!r}; choose one of {', '.join(LR_SCALING)}.")
    if cfg.optimizer not in OPTIMIZERS:
        raise UserError(f"Unknown optimizer {cfg.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}.")
    check_positive("--log-every", cfg.log_every)
    return preset


def init_process_group() -> None:
    """Join the process group described by the launcher's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
    (torchrun, accelerate launch and notebook_launcher all set them), or form a group of one without a launcher."""
    import torch.distributed as dist

    from my_utils.core.devices import cuda_available
    from my_utils.run.launch import free_port

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

    from my_utils.core.data import check_enough_rows
    from my_utils.core.devices import device_inventory, local_rank, per_rank_device, per_rank_device_map
    from my_utils.core.learning_rate import scale_learning_rate
    from my_utils.core.memory import peak_bytes, reset_peak, snapshot
    from my_utils.core.models import set_threads
    from my_utils.core.printing import print0, rank_print
    from my_utils.run.callbacks import gather_to_rank0
    from my_utils.run.launch import check_world_size
    from my_utils.run.lifecycle import open_run, recorded
    from my_utils.workflows.ddp_common import (backend, block_dataset, build_model, default_learning_rate, throughput,
                                               warmup_steps, worker_report, write_worker_report)

    preset = validate(cfg)
    warmup = warmup_steps(cfg)
    init_process_group()
    world_size = check_world_size(cfg.num_processes)
    rank = dist.get_rank()
    threads = set_threads()
    torch.manual_seed(cfg.seed)  # (transformers.set_seed would import bitsandbytes)
    global_batch = cfg.batch_size * cfg.grad_accum * world_size
    learning_rate = scale_learning_rate(cfg.learning_rate or default_learning_rate(preset), global_batch,
                                        preset.batch_size, cfg.lr_scaling)

    dataset = block_dataset(preset, cfg.max_length)
    check_enough_rows(len(dataset), global_batch)
    run, run_dir = open_run(cfg.output_dir, RUNS_ROOT / "ddp" / f"{cfg.preset}_x{world_size}", asdict(cfg),
                            workflow="ddp", world_size=world_size, backend=backend(), devices=device_inventory(),
                            threads_per_process=threads)
    with recorded(run):
        # Every process holds the whole model, on the device of its local rank (its index on this machine).
        device = per_rank_device()
        device_map = per_rank_device_map()
        model = build_model(preset, random_init=cfg.random_init, dropout=cfg.dropout, device_map=device_map)
        report = worker_report(model, device_map=device_map)
        write_worker_report(run_dir, report)
        rank_print(f"world size {report['world_size']}, backend {report['backend']}, model on {report['model_device']}")
        # DDP broadcasts rank 0's weights to every process, then all-reduces gradients during backward().
        model = DistributedDataParallel(model, device_ids=[local_rank()] if device.startswith("cuda") else None)

        # Each rank reads a different 1/world_size of every epoch's shuffled order.
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed,
                                     drop_last=True)
        loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)
        optimizer = make_optimizer(cfg.optimizer, model.parameters(), learning_rate)
        print0(f"{len(dataset)} blocks of {cfg.max_length} tokens; global batch {global_batch} = {cfg.batch_size} "
               f"x {cfg.grad_accum} accumulation x {world_size} processes; learning rate {learning_rate:g}")

        stream = batches_forever(loader, sampler)
        losses = []
        reset_peak(device)
        model.train()
        loop_started = time.perf_counter()
        for step in tqdm(range(1, cfg.max_steps + 1), desc="ddp", disable=rank != 0):
            if step == warmup + 1:
                started, cpu_started = time.perf_counter(), time.process_time()
            step_loss = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                batch = {k: v.to(device) for k, v in next(stream).items()}
                # Gradients are all-reduced on the last micro-batch only: no_sync() skips the communication.
                with nullcontext() if micro == cfg.grad_accum - 1 else model.no_sync():
                    loss = model(**batch).loss / cfg.grad_accum
                    loss.backward()
                step_loss += loss.detach()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dist.all_reduce(step_loss, op=dist.ReduceOp.SUM)  # for the log only: the mean over ranks
            losses.append(step_loss.item() / world_size)
            if run is not None and (step % cfg.log_every == 0 or step == cfg.max_steps):
                run.log_metrics({"step": step, "loss": losses[-1], "time": time.time()})
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
        runtime = time.perf_counter() - loop_started
        # CPU seconds of this process (all its threads, gloo's included) over the timed steps: on a shared machine
        # they tell the work done apart from the time spent waiting for a core.
        per_rank = gather_to_rank0({"rank": rank, "end": snapshot(device),
                                    "cpu_seconds": time.process_time() - cpu_started})

        summary = None
        if run is not None:
            summary = {
                "workflow": "ddp",
                "preset": cfg.preset,
                "world_size": world_size,
                "backend": backend(),
                "threads_per_process": threads,
                "batch_size_per_process": cfg.batch_size,
                "grad_accum": cfg.grad_accum,
                "effective_batch": global_batch,
                "max_length": cfg.max_length,
                "learning_rate": learning_rate,
                "steps": cfg.max_steps,
                "train_loss_first": losses[0],
                "train_loss_final": losses[-1],
                "runtime_s": runtime,
                **throughput(cfg.max_steps - warmup, global_batch, cfg.max_length, elapsed),
                "cpu_seconds_per_rank": [r["cpu_seconds"] for r in per_rank],
                "memory": per_rank,
                "peak_memory_bytes": max(peak_bytes(r["end"]) for r in per_rank),
            }
            if cfg.save_model:
                model.module.save_pretrained(run_dir / "model", safe_serialization=True)
            run.finish(summary)
            print0(f"results folder: {run_dir}")
        summary_list = [summary]
        dist.broadcast_object_list(summary_list, src=0)
    dist.destroy_process_group()
    return summary_list[0]


def parse_args(argv=None, prog: str = "python -m my_utils.workflows.ddp", description: str | None = None) -> Config:
    p = argparse.ArgumentParser(
        prog=prog,
        description=description or "Full fine-tuning with DistributedDataParallel in raw PyTorch. Writes a results "
        "folder and prints its summary. Several processes: `torchrun --nproc_per_node 2 -m my_utils.workflows.ddp` "
        "or `accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.ddp`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = Config()
    p.add_argument("--preset", default=defaults.preset, help="tiny (offline CPU), gpt2, opt-350m")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="blocks per process per micro-batch")
    p.add_argument("--grad-accum", type=int, default=defaults.grad_accum, help="micro-batches per optimizer step")
    p.add_argument("--max-steps", type=int, default=defaults.max_steps, help="optimizer steps")
    p.add_argument("--max-length", type=int, default=defaults.max_length, help="tokens per packed block")
    p.add_argument("--learning-rate", type=float, default=None, help="default: the preset's / 10")
    p.add_argument("--lr-scaling", default=defaults.lr_scaling, choices=("none", "linear", "sqrt"),
                   help="scale the learning rate with the global batch")
    p.add_argument("--optimizer", default=defaults.optimizer, choices=OPTIMIZERS,
                   help="sgd makes runs that see equal gradients end with visibly equal weights")
    p.add_argument("--dropout", type=float, default=defaults.dropout, help="dropout probability everywhere")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="first steps left out of the throughput figures (default 2, fewer for shorter runs)")
    p.add_argument("--log-every", type=int, default=defaults.log_every, help="steps between metrics lines")
    p.add_argument("--save-model", action="store_true", help="save the final weights in the results folder")
    p.add_argument("--output-dir", default=None, help="results folder (must not exist)")
    p.add_argument("--num-processes", type=int, default=None,
                   help="world size to expect inside each worker (default: WORLD_SIZE from the launcher)")
    p.add_argument("--random-init", action="store_true", help="random weights from the shipped config (offline)")
    args = p.parse_args(argv)
    names = {f.name for f in fields(Config)}
    return Config(**{k: v for k, v in vars(args).items() if k in names})


def main(argv=None) -> dict:
    from my_utils.run.cli import run_main

    return run_main(lambda: train(parse_args(argv)), prefix="ddp")


if __name__ == "__main__":
    main()
