"""What every accelerate step shares, so that a step file holds only its training loop and ``diff`` between two
steps shows nothing but the feature: the config and command line, the model and data (packed blocks, shuffled
once so that every run sees the same order), the results folder and its summary, and a metrics tracker.

Run a step with ``python -m my_utils.workflows.accelerate_steps.<step> --help``.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, replace
from typing import ClassVar
from pathlib import Path

from my_utils import UserError
from my_utils.core.blocks import block_dataset
from my_utils.core.data import check_enough_rows
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.presets import get_preset
from my_utils.core.printing import rank_print
from my_utils.run.cli import command_line
from my_utils.run.config import LocalBatchSettings, check_choice, setting
from my_utils.run.launch import is_cpu_only
from my_utils.run.lifecycle import join_world, run_lifecycle
from my_utils.run.results import Run, atomic_write_json
from my_utils.run.trackers import check_report_to
from my_utils.workflows.ddp_common import build_model, throughput, validate_common, worker_report, write_worker_report

MIXED_PRECISION = ("no", "bf16", "fp16")


@dataclass
class Config(LocalBatchSettings):
    TRAINING_DEFAULTS: ClassVar[dict] = {"local_batch_size": 8, "max_steps": 10, "max_length": 128}
    SETTING_HELP: ClassVar[dict] = {"local_batch_size": "blocks per process per batch",
                                    "max_length": "tokens per packed block"}
    dropout: float = setting(0.0, "dropout probability everywhere")
    mixed_precision: str = setting("no", "(step 3 on) autocast dtype of the forward pass; fp16 needs a GPU",
                                   choices=MIXED_PRECISION)
    grad_accum: int = setting(1, "(step 4 on) batches per optimizer step")
    save_steps: int = setting(0, "(step 5 on) checkpoint every n steps; 0: at the end only")
    resume_from: str | None = setting(None, "(step 5 on) a checkpoints/step_<n> folder of a run to resume from")


def validate(cfg: Config):
    """Check the config before anything starts; returns the preset."""
    preset = validate_common(cfg)
    check_choice("mixed precision", cfg.mixed_precision, MIXED_PRECISION)
    if cfg.mixed_precision == "fp16" and is_cpu_only():
        raise UserError("fp16 mixed precision needs a GPU; use --mixed-precision bf16 (or no) on a CPU.")
    if cfg.save_steps < 0:
        raise UserError(f"--save-steps must be 0 (at the end only) or a positive number of steps, got {cfg.save_steps}.")
    if cfg.resume_from is not None:
        step = checkpoint_step(cfg.resume_from)
        if step >= cfg.max_steps:
            raise UserError(f"The checkpoint {cfg.resume_from} is at step {step}, not before --max-steps "
                            f"{cfg.max_steps}; raise --max-steps to train further.")
    return preset


def resolve(cfg: Config, preset, world_size: int) -> Config:
    """Every default settled, as run.json records it: the learning rate, the world size and the trackers by name."""
    return replace(cfg, **cfg.settled(preset), num_processes=world_size, report_to=check_report_to(cfg.report_to))


def build(cfg: Config):
    """(model, dataset): the preset's causal LM (dropout set from the config, on the CPU) and its packed blocks,
    shuffled once with the seed. The order is fixed so that a resumed run continues exactly where it stopped."""
    import torch

    preset = get_preset(cfg.preset)
    blocks = block_dataset(preset, cfg.max_length)
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    model = build_model(preset, random_init=cfg.random_init, dropout=cfg.dropout)
    return model, [blocks[i] for i in order]


def batches(dataloader, count: int, skip: int = 0):
    """``count`` batches from ``dataloader``, epoch after epoch, after leaving out the first ``skip``."""
    seen = 0
    while True:
        for batch in dataloader:
            seen += 1
            if seen > skip:
                yield batch
            if seen == skip + count:
                return


def checkpoint_dir(run_dir, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step}"


def checkpoint_step(path) -> int:
    """The optimizer step a checkpoint folder (``.../checkpoints/step_<n>``) was saved at."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"Checkpoint folder {path} does not exist; pass a .../checkpoints/step_<n> folder of a run.")
    name = path.name
    if not (name.startswith("step_") and name[5:].isdigit()):
        raise UserError(f"{path} is not a checkpoint folder (named step_<n>); pass one from a run's checkpoints/.")
    return int(name[5:])


def tracker_config(cfg: Config) -> dict:
    """The config as trackers accept it (str, int, float, bool or None values)."""
    return {k: ",".join(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}


def jsonl_tracker(run_dir):
    """An accelerate tracker that appends each ``accelerator.log`` call to the run's metrics.jsonl."""
    import time

    from accelerate.tracking import GeneralTracker, on_main_process

    class JsonlTracker(GeneralTracker):
        name = "jsonl"
        requires_logging_directory = False
        main_process_only = True

        def __init__(self, path):
            super().__init__()
            self.run = Run(path)

        @property
        def tracker(self):
            return self.run

        @on_main_process
        def store_init_configuration(self, values: dict):
            atomic_write_json(self.run.path / "tracker_config.json", values)

        @on_main_process
        def log(self, values: dict, step: int | None = None, **kwargs):
            self.run.log_metrics({"step": step, **values, "time": time.time()})

    return JsonlTracker(run_dir)


def module_name(function) -> str:
    """The importable name of the module defining ``function``, also when it runs as ``python -m`` (__main__)."""
    module = sys.modules[function.__module__]
    spec = getattr(module, "__spec__", None)
    return spec.name if spec is not None else function.__module__


def run_step(loop, cfg: Config, loop_has_trackers: bool = False) -> dict:
    """Open the results folder, run ``loop(cfg, run_dir)`` (a step's training loop, which returns the per-batch
    losses averaged over processes and the seconds it trained), and write the summary. Returns the summary on
    every rank (on rank 0 only when the loop closed the process group, as step 6's ``end_training`` does).
    ``--report-to`` trackers get the metrics lines, unless the loop hands them to accelerate itself (step 6)."""
    import torch
    from accelerate import PartialState

    step_name = module_name(loop)
    preset = validate(cfg)
    world_size = join_world(cfg.num_processes, cfg.timeout_s)
    cfg = resolve(cfg, preset, world_size)
    check_enough_rows(len(block_dataset(preset, cfg.max_length)), cfg.global_batch(world_size))
    torch.manual_seed(cfg.seed)  # (transformers.set_seed would import bitsandbytes)
    default_dir = RUNS_ROOT / "accelerate_steps" / f"{step_name.rsplit('.', 1)[-1]}_{cfg.preset}_x{world_size}"
    with run_lifecycle(cfg, world_size, default_dir=default_dir, workflow=step_name,
                       report_to=() if loop_has_trackers else None) as life:
        report = worker_report(device=str(PartialState().device))  # the backend read now: step 6 closes the group
        write_worker_report(life.folder, report)
        rank_print(f"world size {report['world_size']}, backend {report['backend']}, device {report['device']}")
        result = loop(cfg, life.folder)
        losses = result["losses"]
        life.finish({
            "workflow": step_name, "preset": cfg.preset, "world_size": world_size, "backend": report["backend"],
            "threads_per_process": torch.get_num_threads(), "local_batch_size": cfg.local_batch_size,
            "mixed_precision": cfg.mixed_precision, "grad_accum": cfg.grad_accum,
            "global_batch_size": cfg.global_batch(world_size), "max_length": cfg.max_length,
            "learning_rate": cfg.learning_rate, "batches": len(losses), "train_loss_first": losses[0],
            "train_loss_final": losses[-1], "losses": losses, "runtime_s": result["seconds"],
            **throughput(len(losses), cfg.local_batch_size * world_size, cfg.max_length, result["seconds"]),
        } if life.is_main else None)
    return life.summary


def command_line_of(train, module: str):
    """``(parse_args, main)`` of the step module ``module`` (its ``__name__``), which defines ``train``
    (``command_line``)."""
    description = ("One step of the accelerate lesson: full fine-tuning of the preset's causal LM. Writes a results "
                   "folder and prints its summary. Several processes: `accelerate launch --config_file "
                   f"configs/cpu_x2.yaml -m {module_name(train)}`.")
    return command_line(Config, train, module, description)
