"""``run-loop``: a bare accelerate + peft training loop, the baseline of ``overhead`` and the loops ``mfu`` times.

    python -m my_utils bench run-loop --preset tiny --method lora --output-dir DIR

Also the token-and-time windows both this loop and the LoRA workflow (``course.py``) are measured with.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, fields

from my_utils import UserError
from my_utils.core.adapters import AdapterSpec
from my_utils.core.chunked_loss import use_chunked_loss
from my_utils.core.data import load_instructions, padding_collator, tokenize_instructions
from my_utils.core.models import add_adapter, build_causal_lm, load_tokenizer, set_threads
from my_utils.core.presets import get_preset
from my_utils.run.callbacks import TokenCounter
from my_utils.run.config import OneLineParser
from my_utils.run.lifecycle import join_world
from my_utils.tools.bench.flops import model_flops_per_token
from my_utils.tools.bench.harness import recorded_run


@dataclass
class LoopConfig:
    preset: str = "tiny"
    method: str = "lora"  # lora | full
    rank: int = 8
    local_batch_size: int | None = None
    max_length: int | None = None
    steps: int = 40
    warmup_steps: int = 2  # steps before the steady-state window (the whole loop is timed too)
    logging_steps: int = 5
    sampling: str = "random"  # random | group_by_length (the Trainer's names)
    random_tokens: bool = False  # blocks of max_length random tokens (no padding, no tokenizer) instead of data
    learning_rate: float | None = None  # default: the preset's for the method, as the workflow
    random_init: bool = False
    data_file: str | None = None
    seed: int = 0
    mixed_precision: str | None = None  # default: the launcher's (ACCELERATE_MIXED_PRECISION, or its config file)


def bare_loop(cfg: LoopConfig) -> dict:
    """A bare accelerate + peft training loop: plain DataLoader, AdamW, the preset's schedule with 5 % warm-up,
    gradient clipping at 1, the chunked loss (the workflow's settings, so that both do the same arithmetic). Returns
    its figures: the whole loop from ``accelerator.prepare`` (as Trainer.train is timed) and the steady state after
    ``warmup_steps``."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import get_scheduler

    preset = get_preset(cfg.preset)
    set_threads()
    set_seed(cfg.seed)
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision)  # device (and precision) from the launcher
    batch_size = cfg.local_batch_size or preset.batch_size
    max_length = cfg.max_length or preset.max_length
    model = build_causal_lm(preset, random_init=cfg.random_init)
    loader, counter = _loader(cfg, preset, model.config.vocab_size, batch_size, max_length)
    if cfg.method == "lora":
        model = add_adapter(model, AdapterSpec(rank=cfg.rank).resolved(preset.lora_targets))
    use_chunked_loss(model)  # the workflow's loss, by default
    flops = model_flops_per_token(model, max_length, cfg.method)
    learning_rate = cfg.learning_rate or (preset.learning_rate if cfg.method == "lora" else preset.learning_rate / 10)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=learning_rate,
                                  weight_decay=0.0)
    # the LoRA workflow's default schedule for the preset
    scheduler = get_scheduler(preset.lr_scheduler, optimizer, num_warmup_steps=math.ceil(0.05 * cfg.steps),
                              num_training_steps=cfg.steps)
    timed = _train(cfg, accelerator, model, optimizer, loader, scheduler, counter)
    return {
        "method": cfg.method, "batch_size": batch_size, "max_length": max_length, "steps": cfg.steps,
        "warmup_steps": cfg.warmup_steps, "sampling": cfg.sampling, "random_tokens": cfg.random_tokens,
        "mixed_precision": accelerator.mixed_precision, "device": str(accelerator.device),
        "threads": torch.get_num_threads(), "learning_rate": learning_rate,
        "attention": getattr(model.config, "_attn_implementation", None), **timed, **flops,
    }


def _loader(cfg: LoopConfig, preset, vocab_size: int, batch_size: int, max_length: int):
    """The DataLoader (the workflow's batching: random or length-grouped) and the collator that counts its tokens."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler
    from transformers.trainer_pt_utils import LengthGroupedSampler

    if cfg.random_tokens:  # FLOPs do not depend on the tokens' values: any architecture, offline
        ids = torch.randint(0, vocab_size, (batch_size * (cfg.steps + 1), max_length),
                            generator=torch.Generator().manual_seed(cfg.seed))
        data = [{"input_ids": x, "labels": x} for x in ids]
        collate = BlockCounter()
    else:
        tokenizer = load_tokenizer(preset)
        rows, _ = load_instructions(preset.instruction_data, eval_rows=1, path=cfg.data_file)
        data = tokenize_instructions(rows, tokenizer, max_length)
        collate = TokenCounter(padding_collator(tokenizer))
    generator = torch.Generator().manual_seed(cfg.seed)
    if cfg.sampling == "group_by_length":
        sampler = LengthGroupedSampler(batch_size, lengths=[len(x["input_ids"]) for x in data], generator=generator)
    else:
        sampler = RandomSampler(data, generator=generator)
    return DataLoader(data, batch_size=batch_size, sampler=sampler, collate_fn=collate, drop_last=True), collate


def _train(cfg: LoopConfig, accelerator, model, optimizer, loader, scheduler, counter) -> dict:
    """The timed loop: the whole of it, the steady state after ``cfg.warmup_steps``, the logged losses."""
    import torch

    def sync():
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize(accelerator.device)

    started, cpu_started = time.perf_counter(), time.process_time()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    batches = _forever(loader)
    losses, window_loss = [], torch.zeros((), device=accelerator.device)
    for step in range(1, cfg.steps + 1):
        if step == cfg.warmup_steps + 1:
            sync()
            # the collator has made this step's batch already (accelerate fetches one ahead), as in the Trainer
            # at the end of the step before: the workflow's window starts at the same point
            window = window_start(counter)
        loss = model(**next(batches)).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window_loss += loss.detach()
        if step % cfg.logging_steps == 0:
            losses.append(window_loss.item() / cfg.logging_steps)
            window_loss.zero_()
    sync()
    # tokens are counted as the workflow counts them: every batch the collator made (one look-ahead included)
    whole = window_end({"wall": started, "cpu": cpu_started, "tokens": 0, "padded_tokens": 0}, counter)
    return {**whole, "steady": window_end(window, counter), "losses": losses}


def _forever(loader):
    while True:
        yield from loader


class BlockCounter:
    """Stacks blocks of equal length and counts their tokens (the attributes of ``TokenCounter``). Blocks need
    no padding, hence no attention mask, and without a mask the attention takes its causal fast path."""

    def __init__(self):
        self.tokens = self.padded_tokens = 0

    def __call__(self, rows):
        from torch.utils.data import default_collate

        batch = default_collate(rows)
        self.tokens += batch["input_ids"].numel()
        self.padded_tokens = self.tokens
        return batch


def window_start(counter) -> dict:
    """The start of a measured window: the clocks and the tokens ``counter`` (a collator) has made so far."""
    return {"wall": time.perf_counter(), "cpu": time.process_time(), "tokens": counter.tokens,
            "padded_tokens": counter.padded_tokens}


def window_end(start: dict, counter) -> dict:
    """Seconds, CPU seconds, useful and padded tokens since ``start``, and the rates they make."""
    seconds, cpu_seconds = time.perf_counter() - start["wall"], time.process_time() - start["cpu"]
    tokens, padded = counter.tokens - start["tokens"], counter.padded_tokens - start["padded_tokens"]
    return {"runtime_s": seconds, "cpu_s": cpu_seconds, "tokens": tokens, "padded_tokens": padded,
            "tokens_per_s": tokens / seconds, "cpu_tokens_per_s": tokens / cpu_seconds,
            "processed_tokens_per_s": padded / seconds, "processed_tokens_per_cpu_s": padded / cpu_seconds}


def over_ranks(figures: list[dict]) -> dict:
    """Windows of several processes (``window_end``'s figures, one per rank) as one: the tokens of every rank, per
    second of the slowest (wall) and of the busiest (CPU) one."""
    tokens = sum(f["tokens"] for f in figures)
    return {"tokens": tokens, "padded_tokens": sum(f["padded_tokens"] for f in figures),
            "tokens_per_s": tokens / max(f["runtime_s"] for f in figures),
            "cpu_tokens_per_s": tokens / max(f["cpu_s"] for f in figures)}


def loop_main(argv) -> None:
    """``run-loop``: the bare accelerate + peft loop, into a results folder; launched on several processes
    (``accelerate launch``), a bare DDP loop whose summary holds every rank's figures."""
    p = OneLineParser(prog="python -m my_utils bench run-loop", description=bare_loop.__doc__)
    _add_fields(p, LoopConfig, choices={"method": ("lora", "full"), "sampling": ("random", "group_by_length"),
                                        "mixed_precision": ("no", "bf16", "fp16")})
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)
    cfg = LoopConfig(**{f.name: getattr(args, f.name) for f in fields(LoopConfig)})
    if cfg.steps <= cfg.warmup_steps:
        raise UserError(f"--steps must be above --warmup-steps ({cfg.warmup_steps}): the steady state comes after it.")
    from accelerate import PartialState
    from accelerate.utils import gather_object

    join_world(None)  # the world the launcher asked for, on a CPU too
    state = PartialState()

    def body():
        figures = bare_loop(cfg)
        ranks = gather_object([figures]) if state.use_distributed else [figures]
        return {**figures, "world_size": state.num_processes, "ranks": ranks}

    try:
        recorded_run(args.output_dir, asdict(cfg), body, main=state.is_main_process)
    finally:
        if state.use_distributed:
            state.destroy_process_group()  # else gloo may abort the finished process at exit


def _add_fields(parser, cls, choices: dict) -> None:
    """One --option per field of a config dataclass (booleans become flags)."""
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true")
        else:
            kind = type(default) if default is not None else (float if f.name == "learning_rate" else
                                                             int if f.name in ("local_batch_size", "max_length") else str)
            parser.add_argument(flag, type=kind, default=default, choices=choices.get(f.name))


WORKERS = {"run-loop": loop_main}
