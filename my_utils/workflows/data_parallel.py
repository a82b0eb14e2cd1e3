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

import time
import warnings
from dataclasses import dataclass, replace
from typing import ClassVar

from my_utils import UserError
from my_utils.core.blocks import block_dataset
from my_utils.core.data import check_enough_rows
from my_utils.core.memory import peak_bytes, reset_peak, snapshot
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.printing import print0
from my_utils.run.cli import command_line
from my_utils.run.config import GlobalBatchSettings, check_positive, setting
from my_utils.run.divergence import check_finite
from my_utils.run.lifecycle import join_world, run_lifecycle
from my_utils.workflows.ddp_common import (build_model, throughput, untimed_steps, validate_common, worker_report,
                                           write_worker_report)


DESCRIPTION = ("Full fine-tuning with torch.nn.DataParallel: one process splits each batch over every GPU (on a "
               "CPU-only machine it runs on the CPU, unsplit). Writes a results folder and prints its summary.")


@dataclass
class Config(GlobalBatchSettings):
    TRAINING_DEFAULTS: ClassVar[dict] = {"global_batch_size": 16, "max_steps": 10, "max_length": 128}
    SETTING_HELP: ClassVar[dict] = {"max_length": "tokens per packed block", "global_batch_size": "blocks per step, "
                                    "the whole batch of the one process: DataParallel cuts it over the GPUs"}
    dropout: float = setting(0.0, "dropout probability everywhere")
    untimed_steps: int | None = setting(None, "first steps left out of the throughput figures (allocation, caches; "
                                        "default 2, fewer for shorter runs)")
    logging_steps: int = setting(5, "steps between metrics lines")
    num_gpus: int | None = setting(None, "GPUs to split over (default: every visible GPU; 0 on a machine without)")


def validate(cfg: Config):
    """Check the config before anything starts; returns the preset."""
    preset = validate_common(cfg)
    check_positive("--logging-steps", cfg.logging_steps)
    return preset


def resolve(cfg: Config, preset, gpus: list[int]) -> Config:
    """Every default settled, as run.json records it: the learning rate, the untimed steps, the GPUs and the one
    process."""
    return replace(cfg, **cfg.settled(preset), untimed_steps=untimed_steps(cfg), num_gpus=len(gpus), num_processes=1)


def check_single_process(world_size: int) -> None:
    if world_size > 1:
        raise UserError(
            f"DataParallel is one process driving every GPU, but this launch started {world_size}; run it with "
            "`python -m my_utils.workflows.data_parallel` and use my_utils.workflows.ddp for several processes."
        )


def gpus_to_use(num_gpus: int | None) -> list[int]:
    """The GPU indices DataParallel will split over ([]: the CPU, as on a machine without GPUs)."""
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_gpus is None:
        return list(range(available))
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or not 0 <= num_gpus <= available:
        raise UserError(f"--num-gpus must be between 0 (the CPU) and the {available} GPU(s) of this machine, got "
                        f"{num_gpus!r}; leave it out to use every GPU.")
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

    preset = validate(cfg)
    check_single_process(join_world(cfg.num_processes, cfg.timeout_s))
    gpus = gpus_to_use(cfg.num_gpus)
    cfg = resolve(cfg, preset, gpus)
    torch.manual_seed(cfg.seed)  # (transformers.set_seed would import bitsandbytes)
    dataset = block_dataset(preset, cfg.max_length)
    check_enough_rows(len(dataset), cfg.global_batch_size)
    name = f"{cfg.preset}_{'cuda_x' + str(len(gpus)) if gpus else 'cpu'}"
    with run_lifecycle(cfg, 1, default_dir=RUNS_ROOT / "data_parallel" / name, workflow="data_parallel") as life:
        # region: the wrapper
        # The model lives on the first GPU; DataParallel copies it to the others at every forward pass.
        first = f"cuda:{gpus[0]}" if gpus else "cpu"
        model = build_model(preset, random_init=cfg.random_init, dropout=cfg.dropout, device_map={"": first})
        parallel = torch.nn.DataParallel(model, device_ids=gpus or None)
        write_worker_report(life.folder, worker_report(model, gpus_driven=gpus))
        split = chunk_sizes(cfg.global_batch_size, len(gpus))
        print0(f"DataParallel over {len(gpus)} GPU(s): each batch of {cfg.global_batch_size} is cut into {split}"
               if gpus else "No GPU: DataParallel calls the model directly on the CPU (one device, nothing to split).")
        # endregion

        generator = torch.Generator().manual_seed(cfg.seed)
        loader = DataLoader(dataset, batch_size=cfg.global_batch_size, shuffle=True, drop_last=True,
                            generator=generator)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=0.0)
        devices = [f"cuda:{g}" for g in gpus] or ["cpu"]
        for device in devices:
            reset_peak(device)
        losses, batches = [], iter(())
        loop_started = time.perf_counter()
        for step in tqdm(range(1, cfg.max_steps + 1), desc="data_parallel"):
            if step == cfg.untimed_steps + 1:
                started = time.perf_counter()
            batch = next(batches, None)
            if batch is None:  # a new epoch
                batches = iter(loader)
                batch = next(batches)
            # region: the step
            batch = {k: v.to(first) for k, v in batch.items()}  # scatter starts from the first device
            with warnings.catch_warnings():
                # each replica returns a scalar loss; gathering scalars makes a vector (that is expected)
                warnings.filterwarnings("ignore", message="Was asked to gather along dimension 0")
                out = parallel(**batch)
            loss = out.loss.mean()  # one loss per replica, gathered on the first device
            loss.backward()
            check_finite(step, loss, model.parameters(), cfg.learning_rate)  # a diverged step stops here
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # endregion
            losses.append(loss.item())  # .item() waits for the GPUs: the timing below is honest
            if step % cfg.logging_steps == 0 or step == cfg.max_steps:
                life.log({"step": step, "loss": losses[-1], "time": time.time()})
        elapsed = time.perf_counter() - started
        runtime = time.perf_counter() - loop_started
        memory = [snapshot(device) for device in devices]
        life.finish({
            "workflow": "data_parallel", "preset": cfg.preset, "world_size": 1, "backend": None,
            "threads_per_process": torch.get_num_threads(), "devices_used": devices,
            "chunk_sizes": split if gpus else [cfg.global_batch_size],
            "global_batch_size": cfg.global_batch_size, "max_length": cfg.max_length,
            "learning_rate": cfg.learning_rate,
            "steps": cfg.max_steps, "train_loss_first": losses[0], "train_loss_final": losses[-1],
            "runtime_s": runtime,
            **throughput(cfg.max_steps - cfg.untimed_steps, cfg.global_batch_size, cfg.max_length, elapsed),
            "memory": [{"process": 0, "end": m} for m in memory],
            "peak_memory_bytes": max(peak_bytes(m) for m in memory),
        })
    return life.summary


parse_args, main = command_line(Config, train, __name__, DESCRIPTION)
