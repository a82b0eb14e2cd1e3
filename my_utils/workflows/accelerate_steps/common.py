"""What every accelerate step shares, so that a step file holds only its training loop and ``diff`` between two
steps shows nothing but the feature: the config and command line, the model and data (packed blocks, shuffled
once so that every run sees the same order), the results folder and its summary, and a metrics tracker.

Run a step with ``python -m my_utils.workflows.accelerate_steps.<step> --help``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from my_utils import UserError
from my_utils.run.results import RUNS_ROOT

MIXED_PRECISION = ("no", "bf16", "fp16")


@dataclass
class Config:
    preset: str = "tiny"
    batch_size: int = 8  # per process
    max_steps: int = 10  # optimizer steps
    max_length: int = 128  # tokens per packed block
    learning_rate: float | None = None  # default: the preset's, divided by 10 (full fine-tuning)
    dropout: float = 0.0
    seed: int = 0
    mixed_precision: str = "no"  # from step 3: no | bf16 | fp16 (fp16 needs a GPU)
    grad_accum: int = 1  # from step 4: batches per optimizer step
    save_every: int = 0  # from step 5: save a checkpoint every n steps (0: at the end only)
    resume_from: str | None = None  # from step 5: a checkpoint folder .../checkpoints/step_<n>
    report_to: tuple[str, ...] = ()  # from step 6: accelerate trackers besides metrics.jsonl, e.g. tensorboard
    output_dir: str | None = None  # default: runs/accelerate_steps/<step>_<preset>_x<processes>
    num_processes: int | None = None  # what the launch asked for; checked inside every worker
    random_init: bool = False


def validate(cfg: Config):
    """Check the config before anything starts; returns the preset."""
    from my_utils.run.config import check_positive
    from my_utils.run.launch import is_cpu_only
    from my_utils.workflows.ddp_common import validate_common

    preset = validate_common(cfg)
    if cfg.mixed_precision not in MIXED_PRECISION:
        raise UserError(f"Unknown mixed precision {cfg.mixed_precision!r}; choose one of {', '.join(MIXED_PRECISION)}.")
    if cfg.mixed_precision == "fp16" and is_cpu_only():
        raise UserError("fp16 mixed precision needs a GPU; use --mixed-precision bf16 (or no) on a CPU.")
    if cfg.save_every < 0:
        raise UserError(f"--save-every must be 0 (at the end only) or a positive number of steps, got {cfg.save_every}.")
    check_positive("--grad-accum", cfg.grad_accum)
    if cfg.resume_from is not None:
        step = checkpoint_step(cfg.resume_from)
        if step >= cfg.max_steps:
            raise UserError(f"The checkpoint {cfg.resume_from} is at step {step}, not before --max-steps "
                            f"{cfg.max_steps}; raise --max-steps to train further.")
    return preset


def learning_rate(cfg: Config) -> float:
    from my_utils.core.presets import get_preset
    from my_utils.workflows.ddp_common import default_learning_rate

    return cfg.learning_rate or default_learning_rate(get_preset(cfg.preset))


def build(cfg: Config):
    """(model, dataset): the preset's causal LM (dropout set from the config, on the CPU) and its packed blocks,
    shuffled once with the seed. The order is fixed so that a resumed run continues exactly where it stopped."""
    import torch

    from my_utils.core.presets import get_preset
    from my_utils.workflows.ddp_common import block_dataset, build_model

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

    from my_utils.run.results import Run, atomic_write_json

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


def run_step(loop, cfg: Config) -> dict:
    """Open the results folder, run ``loop(cfg, run_dir)`` (a step's training loop, which returns the per-batch
    losses averaged over processes and the seconds it trained), and write the summary. Returns the summary on
    every rank (on rank 0 only once the loop has closed the process group)."""
    import torch
    import torch.distributed as dist
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    from my_utils.core.data import check_enough_rows
    from my_utils.core.devices import device_inventory
    from my_utils.core.models import set_threads
    from my_utils.core.printing import print0, rank_print
    from my_utils.run.launch import check_world_size
    from my_utils.run.lifecycle import open_run, recorded
    from my_utils.workflows.ddp_common import backend, block_dataset, worker_report, write_worker_report

    step_name = module_name(loop)
    preset = validate(cfg)
    world_size = check_world_size(cfg.num_processes)
    check_enough_rows(len(block_dataset(preset, cfg.max_length)), cfg.batch_size * cfg.grad_accum * world_size)
    threads = set_threads()
    torch.manual_seed(cfg.seed)  # (transformers.set_seed would import bitsandbytes)
    short = step_name.rsplit(".", 1)[-1]
    run, run_dir = open_run(cfg.output_dir, RUNS_ROOT / "accelerate_steps" / f"{short}_{cfg.preset}_x{world_size}",
                            asdict(cfg), workflow=step_name, world_size=world_size, backend=backend(),
                            devices=device_inventory(), threads_per_process=threads)
    backend_name = backend()  # read now: accelerator.end_training() (step 6) closes the process group
    with recorded(run):
        report = worker_report(device=str(PartialState().device))
        write_worker_report(run_dir, report)
        rank_print(f"world size {report['world_size']}, backend {report['backend']}, device {report['device']}")
        result = loop(cfg, run_dir)
        summary = None
        if run is not None:
            from my_utils.workflows.ddp_common import throughput

            losses = result["losses"]
            summary = {
                "workflow": step_name,
                "preset": cfg.preset,
                "world_size": world_size,
                "backend": backend_name,
                "threads_per_process": threads,
                "batch_size_per_process": cfg.batch_size,
                "mixed_precision": cfg.mixed_precision,
                "grad_accum": cfg.grad_accum,
                "effective_batch": cfg.batch_size * cfg.grad_accum * world_size,
                "batches": len(losses),
                "train_loss_first": losses[0],
                "train_loss_final": losses[-1],
                "losses": losses,
                "runtime_s": result["seconds"],
                **throughput(len(losses), cfg.batch_size * world_size, cfg.max_length, result["seconds"]),
            }
            run.finish(summary)
            print0(f"results folder: {run_dir}")
        if world_size > 1 and dist.is_initialized():
            summary = broadcast_object_list([summary])[0]
    return summary


def parse_args(argv, prog: str) -> Config:
    p = argparse.ArgumentParser(
        prog=prog,
        description="One step of the accelerate lesson: full fine-tuning of the preset's causal LM. Writes a results "
        "folder and prints its summary. Several processes: `accelerate launch --config_file configs/cpu_x2.yaml -m "
        f"{prog.split()[-1]}`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = Config()
    p.add_argument("--preset", default=defaults.preset, help="tiny (offline CPU), gpt2, opt-350m")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="blocks per process per batch")
    p.add_argument("--max-steps", type=int, default=defaults.max_steps, help="optimizer steps")
    p.add_argument("--max-length", type=int, default=defaults.max_length, help="tokens per packed block")
    p.add_argument("--learning-rate", type=float, default=None, help="default: the preset's / 10")
    p.add_argument("--dropout", type=float, default=defaults.dropout, help="dropout probability everywhere")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--mixed-precision", default=defaults.mixed_precision, choices=MIXED_PRECISION,
                   help="(step 3 on) autocast dtype of the forward pass")
    p.add_argument("--grad-accum", type=int, default=defaults.grad_accum,
                   help="(step 4 on) batches per optimizer step")
    p.add_argument("--save-every", type=int, default=defaults.save_every,
                   help="(step 5 on) checkpoint every n steps; 0: at the end only")
    p.add_argument("--resume-from", default=None, help="(step 5 on) a checkpoints/step_<n> folder to resume from")
    p.add_argument("--report-to", nargs="*", default=[], help="(step 6) accelerate trackers, e.g. tensorboard wandb")
    p.add_argument("--output-dir", default=None, help="results folder (must not exist)")
    p.add_argument("--num-processes", type=int, default=None,
                   help="world size to expect inside each worker (default: WORLD_SIZE from the launcher)")
    p.add_argument("--random-init", action="store_true", help="random weights from the shipped config (offline)")
    args = p.parse_args(argv)
    names = {f.name for f in fields(Config)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["report_to"] = tuple(values["report_to"])
    return Config(**values)


def main_for(train, argv) -> dict:
    """The ``main`` of a step module: parse the command line and run ``train`` with one-sentence errors."""
    from my_utils.run.cli import run_main

    module = module_name(train)
    return run_main(lambda: train(parse_args(argv, prog=f"python -m {module}")), prefix=module.rsplit(".", 1)[-1])
