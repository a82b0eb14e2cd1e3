"""Sharded data parallel: DDP and the three ZeRO stages, trained on the same batches from the same weights.

DDP gives every rank a whole copy of the weights, the gradients and AdamW's two moments. ZeRO shards them over the
N ranks instead, one more kind per stage:

- ZeRO-1 (torch's ``ZeroRedundancyOptimizer`` under DDP): the optimizer states; each rank updates its 1/N of the
  weights and broadcasts it;
- ZeRO-2 (FSDP2's ``fully_shard`` with ``reshard_after_forward=False``): the gradients too (reduce-scattered), and the
  weights are stored as shards, gathered whole before forward and kept until backward;
- ZeRO-3 (``fully_shard`` with ``reshard_after_forward=True``): each block's weights are gathered for its forward,
  freed, and gathered again for its backward.

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m my_utils.workflows.sharding --preset tiny
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.sharding

Every rank measures, from the tensors it holds at the last step, the bytes of its weights (the stored shards, and
the whole copies gathered for compute), gradients and optimizer states, and counts the elements it passes through
each collective. The summary sets them beside ``memory_formula`` (float32, as trained here) and the loss curves
side by side: sharding changes where the numbers live, not the numbers.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

from my_utils.run.config import RunSettings, parse_config, setting
from my_utils.run.results import RUNS_ROOT

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
# Per step, in units of P elements, as the ZeRO paper counts them (an all-reduce is a reduce-scatter plus an
# all-gather: 2P). torch's ZeRO-1 all-reduces the gradients and then broadcasts the weights: 3P.
TEXTBOOK_VOLUME = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3}
# The same paper's memory per rank in mixed precision (2-byte weights and gradients; fp32 master weights and two
# moments, 12 bytes), for comparison with the float32 variant this workflow trains in (``memory_formula``).
TEXTBOOK_MIXED_PRECISION = {"ddp": "16P", "zero1": "4P + 12P/N", "zero2": "2P + 14P/N", "zero3": "16P/N"}


@dataclass
class Config(RunSettings):
    strategies: tuple[str, ...] = setting(STRATEGIES, "what to run, in order, each from the same weights: "
                                          + ", ".join(STRATEGIES), choices=STRATEGIES)
    batch_size: int = setting(4, "blocks per process per step")
    max_steps: int = setting(8, "optimizer steps per strategy")
    max_length: int = setting(64, "tokens per packed block")
    learning_rate: float | None = setting(None, "default: the preset's full fine-tuning rate")


def validate(cfg: Config):
    """Check the config before anything starts; returns the preset."""
    from my_utils import UserError
    from my_utils.run.config import check_choice, check_positive

    preset = cfg.check_common()
    preset.require("causal")
    for name in ("batch_size", "max_steps", "max_length"):
        check_positive(f"--{name.replace('_', '-')}", getattr(cfg, name))
    if cfg.learning_rate is not None:
        check_positive("--learning-rate", cfg.learning_rate, float)
    if not cfg.strategies:
        raise UserError("--strategies names none; give one or more of " + ", ".join(STRATEGIES) + ".")
    for strategy in cfg.strategies:
        check_choice("strategy", strategy, STRATEGIES)
    return preset


def resolve(cfg: Config, preset, world_size: int) -> Config:
    from my_utils.core.learning_rate import default_learning_rate

    return replace(cfg, strategies=tuple(cfg.strategies), num_processes=world_size,
                   learning_rate=cfg.learning_rate or default_learning_rate(preset, "full"))


def check_world(world_size: int) -> None:
    from my_utils import UserError

    if world_size < 2:
        raise UserError("Sharding needs 2 or more processes; launch with ACCELERATE_USE_CPU=1 torchrun "
                        "--nproc_per_node 2 -m my_utils.workflows.sharding.")


def check_shardable(model, world_size: int) -> None:
    """Every parameter needs at least one row per rank (FSDP2 splits dimension 0)."""
    from my_utils import UserError

    rows = min(p.shape[0] for p in model.parameters())
    if rows < world_size:
        raise UserError(f"The model is too small to shard over {world_size} processes: a parameter has {rows} rows; "
                        f"use at most {rows} processes.")


def memory_formula(strategy: str, parameters: int, world_size: int) -> dict[str, float]:
    """Bytes per rank for ``parameters`` (P) trained in float32 with AdamW on ``world_size`` (N) ranks.

    Weights take 4P, gradients 4P and AdamW's two moments 8P; each stage divides one more of them by N. FSDP2 stores
    the weights as shards (4P/N) and gathers whole copies for compute: in ZeRO-2 all of them stay from forward to
    backward (4P more, ``gathered``); in ZeRO-3 one block at a time (left out, as the textbook leaves it out). So
    DDP 16P, ZeRO-1 8P + 8P/N, ZeRO-2 4P + 16P/N (the textbook's fp32 ZeRO-2 is 4P + 12P/N: it keeps no shard of
    the weights beside the whole copy) and ZeRO-3 16P/N.
    """
    P, N = parameters, world_size
    sharded = {"ddp": (), "zero1": ("optimizer_states",),
               "zero2": ("weights", "gradients", "optimizer_states"),
               "zero3": ("weights", "gradients", "optimizer_states")}[strategy]
    whole = {"weights": 4 * P, "gradients": 4 * P, "optimizer_states": 8 * P}
    formula = {kind: size / N if kind in sharded else size for kind, size in whole.items()}
    return {**formula, "gathered": 4 * P if strategy == "zero2" else 0}


# ---------------------------------------------------------------------------------------------- measuring


def local_bytes(tensors) -> int:
    """Bytes this rank stores for ``tensors``: a sharded tensor (DTensor) counts its local shard only."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is not None:
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def gathered_bytes(model) -> int:
    """Bytes of whole (gathered, unsharded) weights an FSDP2 model holds now; 0 for a model that is not sharded."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if not isinstance(model, FSDPModule):
        return 0
    return sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))


@contextmanager
def counting_collectives(counts: dict):
    """Count, in ``counts``, the elements this rank passes to each collective called from Python (all-reduce,
    broadcast, and FSDP2's all-gather and reduce-scatter: the whole tensor gathered or reduced)."""
    import torch.distributed as dist

    which = {"all_reduce": 0, "broadcast": 0, "all_gather_single": 0, "reduce_scatter_single": 1}  # the full tensor
    originals = {name: getattr(dist, name) for name in which}

    def counted(name):
        def call(*args, **kwargs):
            tensors = [*args, *kwargs.values()]
            counts[name] = counts.get(name, 0) + tensors[which[name]].numel()
            return originals[name](*args, **kwargs)
        return call

    for name in which:
        setattr(dist, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def count_ddp_all_reduce(ddp_model, counts: dict) -> None:
    """DDP all-reduces gradient buckets in C++: a communication hook counts their elements, then averages them as
    DDP's default does."""
    import torch.distributed as dist

    def hook(state, bucket):
        buffer = bucket.buffer()
        counts["all_reduce"] = counts.get("all_reduce", 0) + buffer.numel()
        work = dist.distributed_c10d.all_reduce(buffer, async_op=True)  # the uncounted original
        return work.get_future().then(lambda future: future.value()[0] / dist.get_world_size())

    ddp_model.register_comm_hook(None, hook)


# ---------------------------------------------------------------------------------------------- training


def wrap(model, strategy: str, learning_rate: float, counts: dict):
    """``model`` and its optimizer for ``strategy``."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    # region: the four strategies
    if strategy in ("ddp", "zero1"):
        model = DistributedDataParallel(model)
        count_ddp_all_reduce(model, counts)
        if strategy == "ddp":
            return model, torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
        # ZeRO-1: each rank keeps AdamW's moments for its 1/N of the parameters only
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                              lr=learning_rate, weight_decay=0.0)
    # ZeRO-2 and 3: every block is a unit whose weights, gradients and moments are sharded over the ranks; the
    # root unit holds the rest (embeddings, final norm). ZeRO-3 frees a block's gathered weights after its forward.
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=strategy == "zero3")
    fully_shard(model, reshard_after_forward=strategy == "zero3")
    return model, torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    # endregion


def start_worker(cfg, preset, resolve_config):
    """What both sharding workflows do in every worker before the results folder exists: join a world of 2 or
    more processes, settle the defaults (``resolve_config(cfg, preset, world_size)``), read the packed blocks (at
    least one global batch) and build the model from the seed, the same weights on every rank. Returns (the resolved
    config, the world size, the blocks, the model)."""
    import torch

    from my_utils.core.data import check_enough_rows
    from my_utils.run.lifecycle import join_world
    from my_utils.workflows.ddp_common import block_dataset, build_model

    world_size = join_world(cfg.num_processes)
    check_world(world_size)
    cfg = resolve_config(cfg, preset, world_size)
    dataset = block_dataset(preset, cfg.max_length)
    check_enough_rows(len(dataset), cfg.batch_size * world_size)
    torch.manual_seed(cfg.seed)
    return cfg, world_size, dataset, build_model(preset, random_init=cfg.random_init)


def rank_batches(dataset, cfg, world_size: int):
    """This rank's batches, epoch after epoch, in an order fixed by the seed (the same in every run)."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from my_utils.workflows.ddp import batches_forever

    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=dist.get_rank(), seed=cfg.seed)
    return batches_forever(DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True), sampler)


def run_strategy(strategy: str, base, cfg: Config, dataset, world_size: int) -> dict:
    """Train a copy of ``base`` for ``cfg.max_steps`` steps with ``strategy``; this rank's losses, memory,
    communication and seconds."""
    import copy

    import torch
    import torch.distributed as dist

    counts = {}
    model, optimizer = wrap(copy.deepcopy(base), strategy, cfg.learning_rate, counts)
    states = optimizer.optim.state if strategy == "zero1" else optimizer.state
    batches = rank_batches(dataset, cfg, world_size)
    losses, memory = [], {}
    started = time.perf_counter()
    for step in range(1, cfg.max_steps + 1):
        counts.clear()
        with counting_collectives(counts):
            loss = model(**next(batches)).loss
            memory["gathered"] = gathered_bytes(model)  # whole weights kept from forward to backward
            loss.backward()
            memory["gradients"] = local_bytes(p.grad for p in model.parameters())
            optimizer.step()
            memory["optimizer_states"] = local_bytes(t for s in states.values() for t in s.values()
                                                     if torch.is_tensor(t))
            optimizer.zero_grad(set_to_none=True)
        memory["weights"] = local_bytes(model.parameters())
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return {"strategy": strategy, "rank": dist.get_rank(), "losses": losses, "memory": dict(memory),
            "communication": dict(counts), "seconds": time.perf_counter() - started}


def train(cfg: Config) -> dict:
    """Run every strategy in ``cfg.strategies``; returns the summary (on every rank; rank 0 also writes it)."""
    preset = validate(cfg)
    from my_utils.core.printing import print0
    from my_utils.run.lifecycle import run_lifecycle
    from my_utils.workflows.ddp_common import worker_report, write_worker_report

    cfg, world_size, dataset, base = start_worker(cfg, preset, resolve)  # every strategy starts from a copy of base
    check_shardable(base, world_size)
    with run_lifecycle(cfg, world_size, default_dir=RUNS_ROOT / "sharding" / f"{cfg.preset}_x{world_size}",
                       workflow="sharding") as life:
        write_worker_report(life.folder, worker_report(base))
        records = []
        for strategy in cfg.strategies:
            records.append(run_strategy(strategy, base, cfg, dataset, world_size))
            print0(f"{strategy}: loss {records[-1]['losses'][0]:.4f} -> {records[-1]['losses'][-1]:.4f}")
        per_rank = life.gather(records)
        parameters = sum(p.numel() for p in base.parameters())
        summary = summarize(cfg, world_size, parameters, per_rank) if life.is_main else None
        if life.is_main:
            memory_plot(summary, life.folder / "memory.png")
        life.finish(summary)
    return life.summary


def summarize(cfg: Config, world_size: int, parameters: int, per_rank: list[list[dict]]) -> dict:
    """Per strategy: the losses, each rank's memory beside the formula, and the communication per step."""
    strategies = {}
    for i, strategy in enumerate(cfg.strategies):
        ranks = [records[i] for records in per_rank]
        counts = ranks[0]["communication"]
        volume = 2 * counts.get("all_reduce", 0) + sum(v for k, v in counts.items() if k != "all_reduce")
        strategies[strategy] = {
            "losses": ranks[0]["losses"],
            "memory": [{"rank": r["rank"], **r["memory"]} for r in ranks],
            "formula": memory_formula(strategy, parameters, world_size),
            "communication": counts, "volume_over_p": volume / parameters,
            "textbook_volume_over_p": TEXTBOOK_VOLUME[strategy],
            "seconds": max(r["seconds"] for r in ranks),
        }
    first = strategies[cfg.strategies[0]]["losses"]
    return {
        "workflow": "sharding", "preset": cfg.preset, "world_size": world_size, "parameters": parameters,
        "batch_size_per_process": cfg.batch_size, "max_length": cfg.max_length, "steps": cfg.max_steps,
        "learning_rate": cfg.learning_rate, "strategies": strategies,
        "max_loss_difference": max(abs(a - b) for s in strategies.values() for a, b in zip(s["losses"], first)),
        "train_loss_first": first[0], "train_loss_final": first[-1],
    }


MEMORY_KINDS = {"weights": "weights (stored)", "gathered": "weights gathered for compute", "gradients": "gradients",
                "optimizer_states": "optimizer states (AdamW)"}


def memory_plot(summary: dict, path):
    """Stacked bars: what each rank holds per strategy, by kind, with the formula's total as a black mark."""
    from my_utils.core.memory import MiB
    from my_utils.core.plots import new_figure, save

    fig = new_figure(7, 3.8)
    ax = fig.add_subplot()
    names, x = [], 0
    for strategy, result in summary["strategies"].items():
        for entry in result["memory"]:
            bottom = 0.0
            for j, (kind, label) in enumerate(MEMORY_KINDS.items()):
                ax.bar(x, entry[kind] / MiB, 0.7, bottom=bottom, color=f"C{j}", label=label if x == 0 else None)
                bottom += entry[kind] / MiB
            ax.plot([x - 0.35, x + 0.35], [sum(result["formula"].values()) / MiB] * 2, "k-", lw=2,
                    label="formula (total)" if x == 0 else None)
            names.append(f"{strategy}\nrank {entry['rank']}")
            x += 1
    ax.set_xticks(range(len(names)), names, fontsize="small")
    ax.set(ylabel="MiB per rank", ylim=(0, None),
           title=f"{summary['parameters']:,} parameters in float32 on {summary['world_size']} ranks")
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="outside right upper", fontsize="small")
    return save(fig, path)


DESCRIPTION = ("DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP2) on the same batches from the same weights: losses, memory per "
               "rank against the formulas, communication per step. Needs 2+ processes: ACCELERATE_USE_CPU=1 "
               "torchrun --nproc_per_node 2 -m my_utils.workflows.sharding. Writes a results folder and prints its "
               "summary.")


def parse_args(argv=None) -> Config:
    return parse_config(Config, argv, prog="python -m my_utils.workflows.sharding", description=DESCRIPTION)


def main(argv=None) -> dict:
    from my_utils.run.cli import run_main

    return run_main(lambda: train(parse_args(argv)), prefix="sharding")


if __name__ == "__main__":
    from my_utils.run.cli import run_as_script

    run_as_script(main)
