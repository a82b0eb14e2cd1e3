"""Sharded data parallel: DDP and the three ZeRO stages, trained on the same batches from the same weights.

DDP gives every rank a whole copy of the weights, the gradients and AdamW's two moments. ZeRO shards them over the
N ranks instead, one more kind per stage:

- ZeRO-1 (torch's ``ZeroRedundancyOptimizer`` under DDP): the optimizer states; each rank updates its 1/N of the
  weights and broadcasts it;
- ZeRO-2 (FSDP2's ``fully_shard`` with ``reshard_after_forward=False``): the gradients too (reduce-scattered), and the
  weights are stored as shards, gathered whole before forward and kept until backward;
- ZeRO-3 (``fully_shard`` with ``reshard_after_forward=True``): each block's weights are gathered for its forward,
  freed, and gathered again for its backward.

DeepSpeed's ZeRO-2 and ZeRO-3 (``deepspeed.initialize``) run beside them when the DeepSpeed extra is installed
(``pip install -e ".[deepspeed]"``): ``--strategies deepspeed_zero2 deepspeed_zero3``.

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
from typing import ClassVar

from my_utils import UserError
from my_utils.core.blocks import block_dataset
from my_utils.core.data import check_enough_rows
from my_utils.core.memory import MiB
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.plots import new_figure, save
from my_utils.core.printing import print0
from my_utils.run.cli import command_line
from my_utils.run.config import LocalBatchSettings, check_choices, setting
from my_utils.run.divergence import check_finite
from my_utils.run.faults import step_done
from my_utils.run.lifecycle import join_world, run_lifecycle
from my_utils.workflows.ddp import batches_forever
from my_utils.workflows.ddp_common import build_model, worker_report, write_worker_report

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
DEEPSPEED_STRATEGIES = ("deepspeed_zero2", "deepspeed_zero3")  # an extra: pip install -e ".[deepspeed]"
# Per step, in units of P elements, as the ZeRO paper counts them (an all-reduce is a reduce-scatter plus an
# all-gather: 2P). torch's ZeRO-1 all-reduces the gradients and then broadcasts the weights: 3P.
TEXTBOOK_VOLUME = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3, "deepspeed_zero2": 2, "deepspeed_zero3": 3}
# The same paper's memory per rank in mixed precision (2-byte weights and gradients; fp32 master weights and two
# moments, 12 bytes), for comparison with the float32 variant this workflow trains in (``memory_formula``).
TEXTBOOK_MIXED_PRECISION = {"ddp": "16P", "zero1": "4P + 12P/N", "zero2": "2P + 14P/N", "zero3": "16P/N"}


DESCRIPTION = ("DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP2) on the same batches from the same weights: losses, memory per "
               "rank against the formulas, communication per step. Needs 2+ processes: ACCELERATE_USE_CPU=1 "
               "torchrun --nproc_per_node 2 -m my_utils.workflows.sharding. With the DeepSpeed extra, its ZeRO-2 and "
               "3 as well (--strategies deepspeed_zero2 deepspeed_zero3). Writes a results folder and prints its "
               "summary.")


@dataclass
class Config(LocalBatchSettings):
    strategies: tuple[str, ...] = setting(STRATEGIES, "what to run, in order, each from the same weights: "
                                          + ", ".join(STRATEGIES + DEEPSPEED_STRATEGIES) + " (DeepSpeed's need its "
                                          "extra)", choices=STRATEGIES + DEEPSPEED_STRATEGIES)
    TRAINING_DEFAULTS: ClassVar[dict] = {"local_batch_size": 4, "max_steps": 8, "max_length": 64}
    SETTING_HELP: ClassVar[dict] = {"local_batch_size": "blocks per process per step",
                                    "max_steps": "optimizer steps per strategy", "max_length": "tokens per packed block"}


def validate(cfg: Config):
    """Check the config before anything starts; returns the preset."""
    preset = cfg.check_common()
    preset.require("causal")
    check_choices("--strategies", "strategy", cfg.strategies, STRATEGIES + DEEPSPEED_STRATEGIES)
    wanted = [s for s in cfg.strategies if s in DEEPSPEED_STRATEGIES]
    if wanted and not deepspeed_installed():
        raise UserError(f"--strategies {wanted[0]} needs DeepSpeed, an extra of the course: pip install -e "
                        "\".[deepspeed]\" (it keeps the installed torch).")
    return preset


def deepspeed_installed() -> bool:
    from importlib.util import find_spec

    return find_spec("deepspeed") is not None


def resolve(cfg: Config, preset, world_size: int) -> Config:
    return replace(cfg, **cfg.settled(preset), strategies=tuple(cfg.strategies), num_processes=world_size)


def check_world(world_size: int, workflow: str) -> None:
    if world_size < 2:
        raise UserError(f"my_utils.workflows.{workflow} needs 2 or more processes; launch with ACCELERATE_USE_CPU=1 "
                        f"torchrun --nproc_per_node 2 -m my_utils.workflows.{workflow}.")


def check_shardable(model, world_size: int) -> None:
    """Every parameter needs at least one row per rank (FSDP2 splits dimension 0)."""
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

    DeepSpeed is built for mixed precision: its optimizer steps a float32 ``master`` copy of the rank's partition
    (4P/N) and copies it back into the weights, even when they are float32 already. Its ZeRO-2 keeps the weights
    whole (4P): 4P + 16P/N, as FSDP2's; its ZeRO-3 stores a shard (4P/N): 20P/N, 4P/N more than FSDP2's.
    """
    P, N = parameters, world_size
    sharded = {"ddp": (), "zero1": ("optimizer_states",),
               "zero2": ("weights", "gradients", "optimizer_states"),
               "zero3": ("weights", "gradients", "optimizer_states"),
               "deepspeed_zero2": ("gradients", "optimizer_states"),
               "deepspeed_zero3": ("weights", "gradients", "optimizer_states")}[strategy]
    whole = {"weights": 4 * P, "gradients": 4 * P, "optimizer_states": 8 * P}
    formula = {kind: size / N if kind in sharded else size for kind, size in whole.items()}
    return {**formula, "gathered": 4 * P if strategy == "zero2" else 0,
            "master": 4 * P / N if strategy in DEEPSPEED_STRATEGIES else 0}


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
    """Bytes of whole (gathered, unsharded) weights a sharded model holds now: FSDP2's plain tensors beside its
    DTensor shards, DeepSpeed ZeRO-3's parameters whose data is present (released ones hold none); 0 for a model
    that is not sharded."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if isinstance(model, FSDPModule):
        return sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))
    return sum(p.numel() * p.element_size() for p in model.parameters() if hasattr(p, "ds_tensor"))


@contextmanager
def counting_collectives(counts: dict):
    """Count, in ``counts``, the elements this rank passes to each collective called from Python (all-reduce,
    broadcast, and the all-gather and reduce-scatter of FSDP2 and DeepSpeed: the whole tensor gathered or reduced)."""
    import sys

    import torch.distributed as dist

    # (owner, attribute, counted as, position of the whole tensor among the arguments)
    targets = [(dist, "all_reduce", "all_reduce", 0), (dist, "broadcast", "broadcast", 0),
               (dist, "all_gather_single", "all_gather", 0), (dist, "reduce_scatter_single", "reduce_scatter", 1)]
    deepspeed_backend = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
    if deepspeed_backend is not None:  # DeepSpeed calls these two through references it took when it started
        targets += [(deepspeed_backend, "all_gather_function", "all_gather", 0),
                    (deepspeed_backend, "reduce_scatter_function", "reduce_scatter", 1)]
    originals = [getattr(owner, attribute) for owner, attribute, _, _ in targets]

    def counted(function, name, position):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + [*args, *kwargs.values()][position].numel()
            return function(*args, **kwargs)
        return call

    for (owner, attribute, name, position), function in zip(targets, originals):
        setattr(owner, attribute, counted(function, name, position))
    try:
        yield counts
    finally:
        for (owner, attribute, _, _), function in zip(targets, originals):
            setattr(owner, attribute, function)


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


def wrap(model, strategy: str, learning_rate: float, counts: dict, batch_size: int):
    """``model`` and its optimizer for ``strategy`` (for DeepSpeed's, its engine and its ZeRO optimizer)."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    if strategy in DEEPSPEED_STRATEGIES:
        return deepspeed_engine(model, int(strategy[-1]), learning_rate, batch_size)
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



def deepspeed_zero(stage: int) -> dict:
    """DeepSpeed's ``zero_optimization`` for ``stage`` as this lesson runs it: every parameter sharded, and under
    ZeRO-3 each block's gathered weights freed after use (configs/zero3_config.json ships the same for GPUs)."""
    zero = {"stage": stage,
            "stage3_param_persistence_threshold": 0}  # default 1e5: smaller parameters stay whole on every rank
    if stage == 3:  # free each block's gathered weights after use, as FSDP2 does; by default DeepSpeed keeps up to
        # 1e9 of them gathered from forward to backward (a smaller model never frees any)
        zero |= {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
    return zero

def deepspeed_engine(model, stage: int, learning_rate: float, batch_size: int):
    """DeepSpeed's ZeRO ``stage`` (2 or 3) around ``model``, stepping torch's AdamW over its partitions (DeepSpeed's
    own Adam would compile C++ first, for minutes). Returns the engine and DeepSpeed's ZeRO optimizer."""
    import importlib
    import warnings

    import torch

    import deepspeed  # on a CPU-only machine join_world has told it so (DS_ACCELERATOR), which it would warn about

    # On a CPU DeepSpeed compiles a shared-memory all-reduce on first use (about 35 s on 2 cores); the other
    # strategies communicate through gloo, and so does DeepSpeed here.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    # DeepSpeed 0.19 calls the collectives by the names torch 2.13 deprecated (the count above covers both)
    warnings.filterwarnings("ignore", message=r"`torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)`",
                            category=FutureWarning)
    deepspeed.utils.logger.setLevel("WARNING")
    # region: DeepSpeed's ZeRO-2 and 3
    config = {"train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0,  # DeepSpeed's default clips the gradients' norm to 1.0; torch's loops do not
              "zero_optimization": deepspeed_zero(stage), "zero_allow_untested_optimizer": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    engine, zero_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, zero_optimizer
    # endregion


def deepspeed_gradient_bytes(optimizer) -> int:
    """This DeepSpeed rank's reduced gradients after backward: its partition, in one flat buffer (ZeRO-3) or in
    ``averaged_gradients`` (ZeRO-2)."""
    if hasattr(optimizer, "grad_partitions_flat_buffer"):
        return local_bytes([optimizer.grad_partitions_flat_buffer])
    return local_bytes(t for group in optimizer.averaged_gradients.values() for t in group)


def deepspeed_weight_bytes(engine, optimizer) -> dict[str, int]:
    """The weights a DeepSpeed rank holds after its optimizer step (whole in ZeRO-2; in ZeRO-3 this rank's shards,
    ``ds_tensor``) and its float32 master partition."""
    stage3 = hasattr(optimizer, "fp32_partitioned_groups_flat")
    master = optimizer.fp32_partitioned_groups_flat if stage3 else optimizer.single_partition_of_fp32_groups
    return {"weights": local_bytes(getattr(p, "ds_tensor", p) for p in engine.module.parameters()),
            "master": local_bytes(master)}


def start_worker(cfg, preset, resolve_config, workflow: str):
    """What the multi-process workflows on packed blocks (``workflow``: sharding, sharded_lora, traps) do in every
    worker before the results folder exists: join a world of 2 or more processes, settle the defaults (``resolve_config(cfg, preset, world_size)``), read the packed blocks (at
    least one global batch) and build the model from the seed, the same weights on every rank. Returns (the resolved
    config, the world size, the blocks, the model)."""
    import torch

    world_size = join_world(cfg.num_processes, cfg.timeout_s)
    check_world(world_size, workflow)
    cfg = resolve_config(cfg, preset, world_size)
    dataset = block_dataset(preset, cfg.max_length)
    check_enough_rows(len(dataset), cfg.global_batch(world_size))
    torch.manual_seed(cfg.seed)
    return cfg, world_size, dataset, build_model(preset, random_init=cfg.random_init)


def rank_batches(dataset, cfg, world_size: int):
    """This rank's batches, epoch after epoch, in an order fixed by the seed (the same in every run)."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=dist.get_rank(), seed=cfg.seed)
    # its own generator: each epoch's iterator draws a seed from it, which would otherwise come from the global one
    # and shift the dropout masks of a run resumed from a checkpoint (it skips ahead through fresh iterators)
    loader = DataLoader(dataset, batch_size=cfg.local_batch_size, sampler=sampler, drop_last=True,
                        generator=torch.Generator().manual_seed(cfg.seed))
    return batches_forever(loader, sampler)


def run_strategy(strategy: str, base, cfg: Config, dataset, world_size: int) -> dict:
    """Train a copy of ``base`` for ``cfg.max_steps`` steps with ``strategy``; this rank's losses, memory,
    communication and seconds."""
    import copy

    import torch
    import torch.distributed as dist

    counts = {}
    model, optimizer = wrap(copy.deepcopy(base), strategy, cfg.learning_rate, counts, cfg.local_batch_size)
    # AdamW's states, inside whatever wraps the optimizer
    states = (optimizer.optim.state if strategy == "zero1" else
              optimizer.optimizer.state if strategy in DEEPSPEED_STRATEGIES else optimizer.state)
    batches = rank_batches(dataset, cfg, world_size)
    losses, memory = [], {"master": 0}
    started = time.perf_counter()
    for step in range(1, cfg.max_steps + 1):
        counts.clear()
        with counting_collectives(counts):
            loss = model(**next(batches)).loss
            memory["gathered"] = gathered_bytes(model)  # whole weights kept from forward to backward
            if strategy in DEEPSPEED_STRATEGIES:  # the engine reduces, steps and zeroes the gradients
                model.backward(loss)
                memory["gradients"] = deepspeed_gradient_bytes(optimizer)
                check_finite(step, loss, model.parameters(), cfg.learning_rate)  # the engine keeps the gradients
                model.step()
                memory |= deepspeed_weight_bytes(model, optimizer)
            else:
                loss.backward()
                memory["gradients"] = local_bytes(p.grad for p in model.parameters())
                check_finite(step, loss, model.parameters(), cfg.learning_rate)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                memory["weights"] = local_bytes(model.parameters())
            memory["optimizer_states"] = local_bytes(t for s in states.values() for t in s.values() if torch.is_tensor(t))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
        step_done(step, dist.get_rank())  # the step a failure names; the tests' faults
    return {"strategy": strategy, "process": dist.get_rank(), "losses": losses, "memory": dict(memory),
            "communication": dict(counts), "seconds": time.perf_counter() - started}


def train(cfg: Config) -> dict:
    """Run every strategy in ``cfg.strategies``; returns the summary (on every rank; rank 0 also writes it)."""
    preset = validate(cfg)

    cfg, world_size, dataset, base = start_worker(cfg, preset, resolve, "sharding")  # every strategy starts from a copy of base
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
            print(f"memory per process, measured against the formulas: {life.folder / 'memory.png'} (and summary.json)",
                  flush=True)
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
            "memory": [{"process": r["process"], **r["memory"]} for r in ranks],
            "formula": memory_formula(strategy, parameters, world_size),
            "communication": counts, "volume_over_p": volume / parameters,
            "textbook_volume_over_p": TEXTBOOK_VOLUME[strategy],
            "seconds": max(r["seconds"] for r in ranks),
        }
    first = strategies[cfg.strategies[0]]["losses"]
    return {
        "workflow": "sharding", "preset": cfg.preset, "world_size": world_size, "parameters": parameters,
        "local_batch_size": cfg.local_batch_size, "global_batch_size": cfg.global_batch(world_size),
        "max_length": cfg.max_length, "steps": cfg.max_steps,
        "learning_rate": cfg.learning_rate, "strategies": strategies,
        "max_loss_difference": max(abs(a - b) for s in strategies.values() for a, b in zip(s["losses"], first)),
        "train_loss_first": first[0], "train_loss_final": first[-1],
    }


MEMORY_KINDS = {"weights": "weights (stored)", "gathered": "weights gathered for compute", "gradients": "gradients",
                "optimizer_states": "optimizer states (AdamW)", "master": "float32 master partition (DeepSpeed)"}


def memory_plot(summary: dict, path):
    """Stacked bars: what each rank holds per strategy, by kind, with the formula's total as a black mark."""
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
            names.append(f"{strategy}\nrank {entry['process']}")
            x += 1
    ax.set_xticks(range(len(names)), names, fontsize="small")
    ax.set(ylabel="MiB per rank", ylim=(0, None),
           title=f"{summary['parameters']:,} parameters in float32 on {summary['world_size']} ranks")
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="outside right upper", fontsize="small")
    return save(fig, path)


parse_args, main = command_line(Config, train, __name__, DESCRIPTION)
