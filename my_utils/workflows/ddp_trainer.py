"""The DDP lesson's training with the transformers ``Trainer``: the same model, data and flags as
``my_utils.workflows.ddp``, and no distributed code at all. The Trainer reads the launcher's environment, so going
from one process to several is a change of launcher only:

    python -m my_utils.workflows.ddp_trainer --preset tiny                                 # one process
    torchrun --standalone --nproc_per_node 2 -m my_utils.workflows.ddp_trainer --preset tiny
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.ddp_trainer --preset tiny

On a CPU the Trainer needs ``use_cpu=True`` to form a gloo group of several processes (set below when no GPU is
present). Writes a results folder like the raw DDP workflow: run.json, metrics.jsonl, summary.json and
workers/rank_<r>.json.
"""

from __future__ import annotations

import time
from pathlib import Path

from my_utils.core.blocks import block_dataset
from my_utils.core.data import check_enough_rows
from my_utils.core.devices import per_rank_device, per_rank_device_map
from my_utils.core.memory import peak_bytes
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.printing import print0, rank_print
from my_utils.run.callbacks import make_callbacks
from my_utils.run.cli import command_line
from my_utils.run.divergence import StopNonFinite
from my_utils.run.launch import is_cpu_only
from my_utils.run.lifecycle import join_world, process_group_backend, run_lifecycle
from my_utils.workflows.ddp import Config, resolve, step_learning_rate, validate
from my_utils.workflows.ddp_common import build_model, throughput, worker_report, write_worker_report


DESCRIPTION = ("The DDP lesson's training with the transformers Trainer (no distributed code: the launcher decides "
               "the number of processes). Writes a results folder and prints its summary.")


def train(cfg: Config) -> dict:
    """Train with the Trainer; returns the summary (on every rank; rank 0 also writes it)."""
    preset = validate(cfg)
    from transformers import Trainer

    world_size = join_world(cfg.num_processes, cfg.timeout_s)
    cfg = resolve(cfg, preset, world_size)
    learning_rate = step_learning_rate(cfg, preset, world_size)
    global_batch = cfg.global_batch(world_size)
    dataset = block_dataset(preset, cfg.max_length)
    check_enough_rows(len(dataset), global_batch)
    default_dir = RUNS_ROOT / "ddp_trainer" / f"{cfg.preset}_x{world_size}"
    with run_lifecycle(cfg, world_size, default_dir=default_dir, workflow="ddp_trainer") as life:
        model = build_model(preset, random_init=cfg.random_init, dropout=cfg.dropout,
                            device_map=per_rank_device_map())
        memory_cb, metrics_cb = make_callbacks(life.run, per_rank_device())
        trainer = Trainer(model=model, args=training_arguments(cfg, life.folder, learning_rate), train_dataset=dataset,
                          callbacks=[c for c in (memory_cb, metrics_cb, StopNonFinite()) if c])
        report = worker_report(trainer.model)
        write_worker_report(life.folder, report)
        rank_print(f"world size {report['world_size']}, backend {report['backend']}, model on {report['model_device']}")
        print0(f"{len(dataset)} blocks of {cfg.max_length} tokens; global batch {global_batch}; "
               f"learning rate {learning_rate:g}")
        started = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - started
        if life.is_main and cfg.save_model:
            trainer.model.save_pretrained(life.folder / "model", safe_serialization=True)
        life.finish(build_summary(cfg, world_size, learning_rate, trainer, elapsed, memory_cb.report) if life.is_main else None)
    return life.summary


def training_arguments(cfg: Config, folder: Path, learning_rate: float):
    """The Trainer's settings for the raw DDP loop's ``cfg`` (resolved): the same optimizer, rate and steps."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(folder / "trainer"),
        per_device_train_batch_size=cfg.local_batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        learning_rate=learning_rate,
        optim="sgd" if cfg.optimizer == "sgd" else "adamw_torch",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,  # no clipping, like the raw loop
        max_steps=cfg.max_steps,
        logging_steps=cfg.logging_steps,
        save_strategy="no",
        report_to="none",
        use_cpu=is_cpu_only(),  # without it, several CPU processes do not form one gloo group
        seed=cfg.seed,
        ddp_find_unused_parameters=False,  # every parameter gets a gradient: skip the graph search
        dataloader_drop_last=True,
    )


def build_summary(cfg: Config, world_size: int, learning_rate: float, trainer, elapsed: float, memory: list[dict]) -> dict:
    """summary.json, under the raw DDP workflow's names."""
    import torch

    global_batch = cfg.global_batch(world_size)
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    return {
        "workflow": "ddp_trainer",
        "preset": cfg.preset,
        "world_size": world_size,
        "backend": process_group_backend(),
        "threads_per_process": torch.get_num_threads(),
        "local_batch_size": cfg.local_batch_size,
        "grad_accum": cfg.grad_accum,
        "global_batch_size": global_batch,
        "max_length": cfg.max_length,
        "learning_rate": learning_rate,
        "steps": trainer.state.global_step,
        "train_loss_first": losses[0] if losses else None,
        "train_loss_final": losses[-1] if losses else None,
        # the Trainer's own timer includes its set-up: this one covers every step (no untimed steps cut)
        "runtime_s": elapsed,
        **throughput(trainer.state.global_step, global_batch, cfg.max_length, elapsed),
        "memory": memory,
        "peak_memory_bytes": max(peak_bytes(r["end"]) for r in memory),
    }


parse_args, main = command_line(Config, train, __name__, DESCRIPTION)
