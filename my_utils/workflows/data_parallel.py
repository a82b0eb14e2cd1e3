"""``torch.nn.DataParallel``: one process drives every GPU of the machine.

Each forward pass, DataParallel (1) scatters the batch: cuts it along dim 0 into one chunk per GPU, (2) replicates
the model from the first GPU onto the others, (3) runs the replicas in parallel threads, and (4) gathers every
output (logits, per-replica losses) back onto the first GPU, where the loss is reduced and backward starts; the
gradients flow back through the replicas and are summed onto the first GPU's weights. Its limits: one Python
process (the GIL, one data loader), the model is copied to every GPU at every step, and the first GPU carries the
gathered outputs and the optimizer on top of its share: it runs out of memory first. DDP (lesson 02) fixes all three.

On a machine without GPUs DataParallel has no device to split over and simply calls the model: the code path
runs, the parallelism does not.

    python -m my_utils.workflows.data_parallel --preset tiny                # every GPU (or the CPU)
    python -m my_utils.workflows.data_parallel --preset gpt2 --num-gpus 2
    accelerate launch --config_file configs/cpu_x1.yaml -m my_utils.workflows.data_parallel --preset tiny

It is one process by design: a launch of several processes is refused. Writes a results folder (run.json,
metrics.jsonl, summary.json with samples/s, tokens/s, loss and the peak memory of every device used).
"""

from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import asdict, dataclass, fields

from my_utils import UserError
from my_utils.run.results import RUNS_ROOT


@dataclass
class Config:
    preset: str = "tiny"
    batch_size: int = 16  # the whole batch: DataParallel splits it over the GPUs
    max_steps: int = 10
    max_length: int = 128  # tokens per packed block
    learning_rate: float | None = None  # default: the preset's, divided by 10 (full fine-tuning)
    dropout: float = 0.0
    seed: int = 0
    warmup_steps: int | None = None  # first steps left out of samples/s (default 2)
    log_every: int = 5
    num_gpus: int | None = None  # default: every visible GPU
    output_dir: str | None = None  # default: runs/data_parallel/<preset>_<devices>
    num_processes: int | None = None  # must be 1: checked inside the worker
    random_init: bool = False


def check_single_process(world_size: int) -> None:
    if world_size > 1:
        raise UserError(
            f"DataParallel is one process driving every GPU, but this launch started {world_size}; run it with "
            "`python -m my_utils.workflows.data_parallel` and use my_utils.workflows.ddp for several processes."
        )


def gpus_to_use(num_gpus: int | None) -> list[int]:
    """The GPU indices DataParallel will split over ([] on a machine without GPUs)."""
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_gpus is None:
        return list(range(available))
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1 or num_gpus > available:
        raise UserError(f"--num-gpus must be between 1 and the {available} GPU(s) of this machine, got {num_gpus!r}; "
                        "leave it out to use every GPU.")
    return list(range(num_gpus))


def chunk_sizes(batch_size: int, n_devices: int) -> list[int]:
    """How DataParallel's scatter cuts a batch: ``torch.chunk`` along dim 0 (the last chunk may be smaller, and
    with fewer rows than devices some devices get nothing)."""
    import torch

    return [len(c) for c in torch.arange(batch_size).chunk(max(1, n_devices))]


def train(cfg: Config) -> dict:
    """Train with DataParallel over every visible GPU (or plainly on the CPU); returns the summary."""
    import torch
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from my_utils.core.data import check_enough_rows
    from my_utils.core.devices import device_inventory
    from my_utils.core.memory import peak_bytes, reset_peak, snapshot
    from my_utils.core.models import set_threads
    from my_utils.core.printing import print0
    from my_utils.run.launch import check_world_size
    from my_utils.run.lifecycle import open_run, recorded
    from my_utils.workflows.ddp_common import (block_dataset, build_model, default_learning_rate, throughput,
                                               validate_common, warmup_steps, worker_report, write_worker_report)

    preset = validate_common(cfg)
    warmup = warmup_steps(cfg)
    check_single_process(check_world_size(cfg.num_processes))
    gpus = gpus_to_use(cfg.num_gpus)
    threads = set_threads()
    torch.manual_seed(cfg.seed)  # (transformers.set_seed would import bitsandbytes)
    learning_rate = cfg.learning_rate or default_learning_rate(preset)
    dataset = block_dataset(preset, cfg.max_length)
    check_enough_rows(len(dataset), cfg.batch_size)
    name = f"{cfg.preset}_{'cuda_x' + str(len(gpus)) if gpus else 'cpu'}"
    run, run_dir = open_run(cfg.output_dir, RUNS_ROOT / "data_parallel" / name, asdict(cfg),
                            workflow="data_parallel", world_size=1, backend=None, devices=device_inventory(),
                            threads_per_process=threads)
    with recorded(run):
        # The model lives on the first GPU; DataParallel copies it to the others at every forward pass.
        first = f"cuda:{gpus[0]}" if gpus else "cpu"
        model = build_model(preset, random_init=cfg.random_init, dropout=cfg.dropout, device_map={"": first})
        parallel = torch.nn.DataParallel(model, device_ids=gpus or None)
        write_worker_report(run_dir, worker_report(model, gpus_driven=gpus))
        split = chunk_sizes(cfg.batch_size, len(gpus))
        print0(f"DataParallel over {len(gpus)} GPU(s): each batch of {cfg.batch_size} is cut into {split}"
               if gpus else "No GPU: DataParallel calls the model directly on the CPU (one device, nothing to split).")

        generator = torch.Generator().manual_seed(cfg.seed)
        loader = DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True, drop_last=True, generator=generator)
        optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
        for device in gpus or ["cpu"]:
            reset_peak(f"cuda:{device}" if gpus else device)
        losses, batches = [], iter(())
        loop_started = time.perf_counter()
        for step in tqdm(range(1, cfg.max_steps + 1), desc="data_parallel"):
            if step == warmup + 1:
                started = time.perf_counter()
            batch = next(batches, None)
            if batch is None:  # a new epoch
                batches = iter(loader)
                batch = next(batches)
            batch = {k: v.to(first) for k, v in batch.items()}  # scatter starts from the first device
            with warnings.catch_warnings():
                # each replica returns a scalar loss; gathering scalars makes a vector (that is expected)
                warnings.filterwarnings("ignore", message="Was asked to gather along dimension 0")
                out = parallel(**batch)
            loss = out.loss.mean()  # one loss per replica, gathered on the first device
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())  # .item() waits for the GPUs: the timing below is honest
            if run is not None and (step % cfg.log_every == 0 or step == cfg.max_steps):
                run.log_metrics({"step": step, "loss": losses[-1], "time": time.time()})
        elapsed = time.perf_counter() - started
        runtime = time.perf_counter() - loop_started
        memory = [snapshot(f"cuda:{g}") for g in gpus] or [snapshot("cpu")]

        summary = {
            "workflow": "data_parallel",
            "preset": cfg.preset,
            "world_size": 1,
            "backend": None,
            "threads_per_process": threads,
            "devices_used": [f"cuda:{g}" for g in gpus] or ["cpu"],
            "chunk_sizes": split if gpus else [cfg.batch_size],
            "batch_size": cfg.batch_size,
            "effective_batch": cfg.batch_size,
            "max_length": cfg.max_length,
            "learning_rate": learning_rate,
            "steps": cfg.max_steps,
            "train_loss_first": losses[0],
            "train_loss_final": losses[-1],
            "runtime_s": runtime,
            **throughput(cfg.max_steps - warmup, cfg.batch_size, cfg.max_length, elapsed),
            "memory": [{"rank": 0, "end": m} for m in memory],
            "peak_memory_bytes": max(peak_bytes(m) for m in memory),
        }
        run.finish(summary)
        print0(f"results folder: {run_dir}")
    return summary


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(
        prog="python -m my_utils.workflows.data_parallel",
        description="Full fine-tuning with torch.nn.DataParallel: one process splits each batch over every GPU "
        "(on a CPU-only machine it runs on the CPU, unsplit). Writes a results folder and prints its summary.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = Config()
    p.add_argument("--preset", default=defaults.preset, help="tiny (offline CPU), gpt2, opt-350m")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="blocks per step, split over GPUs")
    p.add_argument("--max-steps", type=int, default=defaults.max_steps, help="optimizer steps")
    p.add_argument("--max-length", type=int, default=defaults.max_length, help="tokens per packed block")
    p.add_argument("--learning-rate", type=float, default=None, help="default: the preset's / 10")
    p.add_argument("--dropout", type=float, default=defaults.dropout, help="dropout probability everywhere")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="first steps left out of the throughput figures (default 2, fewer for shorter runs)")
    p.add_argument("--log-every", type=int, default=defaults.log_every, help="steps between metrics lines")
    p.add_argument("--num-gpus", type=int, default=None, help="GPUs to split over (default: all)")
    p.add_argument("--output-dir", default=None, help="results folder (must not exist)")
    p.add_argument("--num-processes", type=int, default=None, help="must be 1 (default: WORLD_SIZE)")
    p.add_argument("--random-init", action="store_true", help="random weights from the shipped config (offline)")
    args = p.parse_args(argv)
    names = {f.name for f in fields(Config)}
    return Config(**{k: v for k, v in vars(args).items() if k in names})


def main(argv=None) -> dict:
    from my_utils.run.cli import run_main

    return run_main(lambda: train(parse_args(argv)), prefix="data_parallel")


if __name__ == "__main__":
    main()
