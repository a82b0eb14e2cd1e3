"""The model, data and bookkeeping shared by the data-parallel lessons: 01 DataParallel, 02 DDP (raw torch and
the Trainer) and 03 accelerate.

The data is the block dataset (``my_utils.core.blocks``): the instruction set packed into blocks of exactly
``max_length`` tokens, so that tokens/s is simply samples/s x max_length.

Dropout is set to 0 by default so that runs are reproducible and processes do not draw different random masks.
"""

from __future__ import annotations

import os
import socket

from my_utils import UserError
from my_utils.core.devices import local_rank
from my_utils.core.models import build_causal_lm
from my_utils.core.printing import get_rank, get_world_size
from my_utils.run.config import check_positive
from my_utils.run.lifecycle import process_group_backend
from my_utils.run.results import atomic_write_json


def validate_common(cfg):
    """Checks shared by the data-parallel workflows' configs; returns the preset (bad input: one sentence)."""
    preset = cfg.check_common()
    preset.require("causal")
    check_positive("--grad-accum", getattr(cfg, "grad_accum", 1))
    if not 0.0 <= cfg.dropout < 1.0:
        raise UserError(f"--dropout must be in [0, 1), got {cfg.dropout!r}; use 0 to turn dropout off.")
    untimed = untimed_steps(cfg) if hasattr(cfg, "untimed_steps") else 0  # the accelerate steps time every batch
    if untimed < 0 or untimed >= cfg.max_steps:
        raise UserError(
            f"--untimed-steps must be at least 0 and below --max-steps ({cfg.max_steps}), got {untimed}; "
            "throughput is measured on the steps after them."
        )
    return preset


def untimed_steps(cfg) -> int:
    """Steps left out of the throughput figures (allocation, caches): ``cfg.untimed_steps``, by default 2 (fewer
    for very short runs)."""
    return min(2, cfg.max_steps - 1) if cfg.untimed_steps is None else cfg.untimed_steps


def set_dropout(model, p: float):
    """Set every dropout probability of ``model`` to ``p``: nn.Dropout modules, and the float ``dropout``
    attributes some architectures (OPT) pass to ``F.dropout`` instead."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, p)
    return model


def build_model(preset, *, random_init: bool = False, dropout: float = 0.0, device_map=None):
    """The preset's causal LM with dropout set to ``dropout``. ``device_map`` (one device, e.g.
    ``per_rank_device_map()``) places pretrained weights at load time; random weights are moved there after."""
    model = build_causal_lm(preset, random_init=random_init, device_map=device_map)
    if device_map is not None:
        model.to(device_map[""])
    return set_dropout(model, dropout)


def worker_report(model=None, **extra) -> dict:
    """What this process sees: ranks, world size, backend, where the model lives, host, threads."""
    import torch

    return {
        "process": get_rank(),
        "local_rank": local_rank(),
        "node_rank": int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))),
        "world_size": get_world_size(),
        "backend": process_group_backend(),
        "model_device": str(next(model.parameters()).device) if model is not None else None,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        **extra,
    }


def write_worker_report(run_dir, report: dict) -> None:
    """Every rank writes ``workers/rank_<r>.json`` into the results folder: the world as each worker saw it."""
    from pathlib import Path

    folder = Path(run_dir) / "workers"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / f"rank_{report['process']}.json", report)


def throughput(steps_timed: int, global_batch: int, max_length: int, seconds: float) -> dict:
    """samples/s and tokens/s over the timed steps (every token of a packed block is a real token)."""
    samples = steps_timed * global_batch
    return {
        "timed_steps": steps_timed,
        "timed_seconds": seconds,
        "samples_per_s": samples / seconds if seconds > 0 else None,
        "tokens_per_s": samples * max_length / seconds if seconds > 0 else None,
    }
