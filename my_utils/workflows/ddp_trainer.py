"""The DDP lesson's training with the transformers ``Trainer``: the same model, data and flags as
``my_utils.workflows.ddp``, and no distributed code at all. The Trainer reads the launcher's environment, so going
from one process to several is a change of launcher only:

    python -m my_utils.workflows.ddp_trainer --preset tiny                                 # one process
    torchrun --standalone --nproc_per_node 2 -m my_utils.workflows.ddp_trainer --preset tiny
    accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.ddp_trainer --preset tiny

On a CPU the Trainer needs ``use_cpu=True`` to form a gloo group of several processes (set below when no GPU is
present). Writes a results folder like the raw DDP workflow: run.json, metrics.jsonl, summary.json and
workers/rank_<r>.json.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from my_utils.run.results import RUNS_ROOT
from my_utils.workflows.ddp import Config, parse_args, validate


def train(cfg: Config) -> dict:
    """Train with the Trainer; returns the summary (on every rank; rank 0 also writes it)."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list
    from transformers import Trainer, TrainingArguments

    from my_utils.core.data import check_enough_rows
    from my_utils.core.devices import device_inventory, per_rank_device, per_rank_device_map
    from my_utils.core.learning_rate import scale_learning_rate
    from my_utils.core.memory import peak_bytes
    from my_utils.core.models import set_threads
    from my_utils.core.printing import print0, rank_print
    from my_utils.run.callbacks import make_callbacks
    from my_utils.run.launch import check_world_size, is_cpu_only
    from my_utils.run.lifecycle import open_run, recorded
    from my_utils.workflows.ddp_common import (backend, block_dataset, build_model, default_learning_rate, throughput,
                                               worker_report, write_worker_report)

    preset = validate(cfg)
    world_size = check_world_size(cfg.num_processes)
    threads = set_threads()
    global_batch = cfg.batch_size * cfg.grad_accum * world_size
    learning_rate = scale_learning_rate(cfg.learning_rate or default_learning_rate(preset), global_batch,
                                        preset.batch_size, cfg.lr_scaling)
    dataset = block_dataset(preset, cfg.max_length)
    check_enough_rows(len(dataset), global_batch)
    run, run_dir = open_run(cfg.output_dir, RUNS_ROOT / "ddp_trainer" / f"{cfg.preset}_x{world_size}", asdict(cfg),
                            workflow="ddp_trainer", world_size=world_size, backend=backend(),
                            devices=device_inventory(), threads_per_process=threads)
    with recorded(run):
        model = build_model(preset, random_init=cfg.random_init, dropout=cfg.dropout,
                            device_map=per_rank_device_map())
        memory_cb, metrics_cb = make_callbacks(run, per_rank_device())
        args = TrainingArguments(
            output_dir=str(run_dir / "trainer"),
            per_device_train_batch_size=cfg.batch_size,
            gradient_accumulation_steps=cfg.grad_accum,
            learning_rate=learning_rate,
            optim="sgd" if cfg.optimizer == "sgd" else "adamw_torch",
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=0.0,  # no clipping, like the raw loop
            max_steps=cfg.max_steps,
            logging_steps=cfg.log_every,
            save_strategy="no",
            report_to="none",
            use_cpu=is_cpu_only(),  # without it, several CPU processes do not form one gloo group
            seed=cfg.seed,
            ddp_find_unused_parameters=False,  # every parameter gets a gradient: skip the graph search
            dataloader_drop_last=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset,
                          callbacks=[c for c in (memory_cb, metrics_cb) if c])
        report = worker_report(trainer.model)
        write_worker_report(run_dir, report)
        rank_print(f"world size {report['world_size']}, backend {report['backend']}, model on {report['model_device']}")
        print0(f"{len(dataset)} blocks of {cfg.max_length} tokens; global batch {global_batch}; "
               f"learning rate {learning_rate:g}")
        started = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - started

        summary = None
        if run is not None:
            losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
            summary = {
                "workflow": "ddp_trainer",
                "preset": cfg.preset,
                "world_size": world_size,
                "backend": backend(),
                "threads_per_process": threads,
                "batch_size_per_process": cfg.batch_size,
                "grad_accum": cfg.grad_accum,
                "effective_batch": global_batch,
                "max_length": cfg.max_length,
                "learning_rate": learning_rate,
                "steps": trainer.state.global_step,
                "train_loss_first": losses[0] if losses else None,
                "train_loss_final": losses[-1] if losses else None,
                # the Trainer's own timer includes its set-up: this one covers every step (no warm-up cut)
                "runtime_s": elapsed,
                **throughput(trainer.state.global_step, global_batch, cfg.max_length, elapsed),
                "memory": memory_cb.report,
                "peak_memory_bytes": max(peak_bytes(r["end"]) for r in memory_cb.report),
            }
            if cfg.save_model:
                trainer.model.save_pretrained(run_dir / "model", safe_serialization=True)
            run.finish(summary)
            print0(f"results folder: {run_dir}")
        if world_size > 1:
            summary = broadcast_object_list([summary])[0]
        PartialState().wait_for_everyone()
    return summary


def main(argv=None) -> dict:
    from my_utils.run.cli import run_main

    description = ("The DDP lesson's training with the transformers Trainer (no distributed code: the launcher "
                   "decides the number of processes). Writes a results folder and prints its summary.")
    return run_main(lambda: train(parse_args(argv, prog="python -m my_utils.workflows.ddp_trainer",
                                             description=description)), prefix="ddp_trainer")


if __name__ == "__main__":
    main()
