"""The model, data and bookkeeping shared by the data-parallel lessons: 01 DataParallel, 02 DDP (raw torch and
the Trainer) and 03 accelerate.

The data is the preset's instruction set, formatted as prompt + response + eos and packed end to end into blocks
of exactly ``max_length`` tokens (no padding). Every example then predicts the same number of tokens, so the mean
loss over a batch of 2b is exactly the average of the mean losses over its two halves of b: that is why DDP over
two processes with batch b equals one process with batch 2b, and why tokens/s is simply samples/s x max_length.

Dropout is set to 0 by default so that runs are reproducible and processes do not draw different random masks.

    python -m my_utils.workflows.ddp_common        # how many blocks the tiny preset makes, and the first one
"""

from __future__ import annotations

import functools
import os
import socket

from my_utils.run.config import check_positive


def validate_common(cfg):
    """Checks shared by the data-parallel workflows' configs; returns the preset (bad input: one sentence)."""
    from my_utils import UserError

    preset = cfg.check_common()
    preset.require("causal")
    for name in ("batch_size", "max_steps", "max_length"):
        check_positive(f"--{name.replace('_', '-')}", getattr(cfg, name))
    check_positive("--grad-accum", getattr(cfg, "grad_accum", 1))
    if cfg.learning_rate is not None:
        check_positive("--learning-rate", cfg.learning_rate, float)
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
    from my_utils.core.models import build_causal_lm

    model = build_causal_lm(preset, random_init=random_init, device_map=device_map)
    if device_map is not None:
        model.to(device_map[""])
    return set_dropout(model, dropout)


def pack_blocks(rows, tokenizer, block_length: int):
    """Token ids of every row (prompt + response + eos) concatenated and cut into blocks of ``block_length``
    (the tail that does not fill a block is dropped). Returns a LongTensor [n_blocks, block_length]."""
    import torch

    from my_utils import UserError
    from my_utils.core.data import format_example

    texts = [format_example(row, tokenizer.eos_token) for row in rows]
    ids = [i for row_ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in row_ids]
    n_blocks = len(ids) // block_length
    if n_blocks == 0:
        raise UserError(f"The data has {len(ids)} tokens, fewer than one block of {block_length}; lower --max-length.")
    return torch.tensor(ids[: n_blocks * block_length]).view(n_blocks, block_length)


def block_dataset(preset, max_length: int) -> list[dict]:
    """The preset's instruction training rows as packed blocks: a list of {"input_ids", "labels"} (labels are the
    inputs; the model shifts them by one), usable by a DataLoader and by the Trainer. Cached per preset and
    length: treat it as read-only."""
    return _block_dataset(preset.name, max_length)


@functools.lru_cache(maxsize=4)
def _block_dataset(preset_name: str, max_length: int) -> list[dict]:
    from my_utils import UserError
    from my_utils.core.data import load_instructions
    from my_utils.core.models import load_tokenizer
    from my_utils.core.presets import get_preset

    preset = get_preset(preset_name)
    tokenizer = load_tokenizer(preset)
    limit = getattr(tokenizer, "model_max_length", None)
    if limit and limit < 10**9 and max_length > limit:
        raise UserError(f"--max-length {max_length} is longer than the model allows ({limit}); use {limit} or less.")
    train_rows, _ = load_instructions(preset.instruction_data, eval_rows=1)
    return [{"input_ids": block, "labels": block} for block in pack_blocks(train_rows, tokenizer, max_length)]


def worker_report(model=None, **extra) -> dict:
    """What this process sees: ranks, world size, backend, where the model lives, host, threads."""
    import torch

    from my_utils.core.devices import local_rank
    from my_utils.core.printing import get_rank, get_world_size
    from my_utils.run.lifecycle import process_group_backend

    return {
        "rank": get_rank(),
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

    from my_utils.run.results import atomic_write_json

    folder = Path(run_dir) / "workers"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / f"rank_{report['rank']}.json", report)


def throughput(steps_timed: int, global_batch: int, max_length: int, seconds: float) -> dict:
    """samples/s and tokens/s over the timed steps (every token of a packed block is a real token)."""
    samples = steps_timed * global_batch
    return {
        "timed_steps": steps_timed,
        "timed_seconds": seconds,
        "samples_per_s": samples / seconds if seconds > 0 else None,
        "tokens_per_s": samples * max_length / seconds if seconds > 0 else None,
    }


if __name__ == "__main__":
    from my_utils.core.models import load_tokenizer
    from my_utils.core.presets import get_preset

    tiny = get_preset("tiny")
    blocks = block_dataset(tiny, 128)
    print(f"{len(blocks)} blocks of 128 tokens; the first one:\n")
    print(load_tokenizer(tiny).decode(blocks[0]["input_ids"]))
