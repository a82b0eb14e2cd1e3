"""Lesson 15's distributed checkpoint: a model and its optimizer sharded with FSDP2, saved by
``torch.distributed.checkpoint`` (one file per rank and a metadata file) and loaded by another number of processes.

Under torchrun this module trains ``SAVE_AT`` steps on N processes, saves (synchronously, then asynchronously, each
timed), trains one step more (the uninterrupted run), then loads the checkpoint into a freshly sharded model and
optimizer and trains that step again; rank 0 writes what it measured to ``<out>/sharded.json`` and the
uninterrupted weights to ``<out>/after.pt``:

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m my_utils.lessons.reshard --preset tiny --out runs/reshard

``resume_unsharded`` loads the same checkpoint in one process without a process group, and ``export_pretrained``
turns it into a plain model folder that ``from_pretrained`` loads.

Every step takes the same global batch: each of N processes takes its 1/N of it, and one process takes the N parts
one after another and averages their gradients, as FSDP's reduce-scatter does. The blocks are packed, every token
counts, so the mean of the parts' losses is the loss of the whole batch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path

LR = 1e-3
GLOBAL_BATCH = 8  # packed blocks per step, split over the processes
LENGTH = 64  # tokens per block
SAVE_AT = 2  # steps trained before the checkpoint; the next one is compared


def parts(dataset, step: int, count: int) -> list[dict]:
    """Step ``step``'s global batch (steps count from 1) in ``count`` equal parts, each a batch of tensors."""
    import torch

    rows = dataset[(step - 1) * GLOBAL_BATCH:step * GLOBAL_BATCH]
    size = GLOBAL_BATCH // count
    return [{key: torch.stack([torch.as_tensor(row[key]) for row in rows[i * size:(i + 1) * size]]) for key in rows[0]}
            for i in range(count)]


def new_model(preset, sharded: bool):
    """The preset's model (every weight trained) and AdamW over it; with ``sharded``, each block and the rest
    sharded over the processes by ``fully_shard`` (ZeRO-3, lesson 10's)."""
    import torch

    from my_utils.core.devices import per_rank_device
    from my_utils.workflows.ddp_common import build_model
    from my_utils.workflows.sharding import wrap

    model = build_model(preset).to(per_rank_device())
    if sharded:
        return wrap(model, "zero3", LR, {}, GLOBAL_BATCH)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)


def step(model, optimizer, batches: list[dict]) -> float:
    """One optimizer step on ``batches`` (this process's parts of the global batch), gradients averaged over them;
    the mean loss, averaged over the processes too."""
    import torch.distributed as dist

    from my_utils.core.devices import per_rank_device

    total = 0.0
    for batch in batches:
        loss = model(**{key: value.to(per_rank_device()) for key, value in batch.items()}).loss / len(batches)
        loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return total.item()


def states(model, optimizer) -> dict:
    """The model's and the optimizer's state, as the distributed checkpoint saves and loads them (each process its
    shards; keys by parameter name, the same whatever the sharding)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def load(model, optimizer, checkpoint: Path) -> None:
    """Load ``checkpoint`` into ``model`` and ``optimizer``, however many processes saved it and however many load
    it: each reads the parts of the files that its shards need."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = states(model, optimizer)
    dcp.load(state, checkpoint_id=str(checkpoint))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def whole_weights(model) -> dict:
    """Every weight whole, on the CPU (gathered from the shards on rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def largest_gap(weights: dict, others: dict) -> float:
    """The largest absolute difference between two sets of weights with the same names."""
    return max((weights[name] - others[name]).abs().max().item() for name in weights)


def train_save_resume(preset_name: str, out: Path) -> dict:
    """Run under torchrun: train, save, go on (uninterrupted), then resume a fresh sharded model from the
    checkpoint and take the same step. Rank 0 writes ``sharded.json`` and ``after.pt`` into ``out``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from my_utils.core.blocks import block_dataset
    from my_utils.core.presets import get_preset
    from my_utils.run.launch import check_world_size

    world = check_world_size()
    rank = dist.get_rank()
    preset = get_preset(preset_name)
    dataset = block_dataset(preset, LENGTH)
    torch.manual_seed(0)
    model, optimizer = new_model(preset, sharded=True)
    mine = {n: parts(dataset, n, world)[rank:rank + 1] for n in range(1, SAVE_AT + 2)}
    losses = [step(model, optimizer, mine[n]) for n in range(1, SAVE_AT + 1)]

    started = time.perf_counter()
    dcp.save(states(model, optimizer), checkpoint_id=str(out / "checkpoint"))
    dist.barrier()
    save_s = time.perf_counter() - started
    # async: the state is copied to memory, then written by a thread while training goes on; the thread's collectives
    # take a process group of their own, or they would interleave with the training step's
    writers = dist.new_group(backend="gloo")
    started = time.perf_counter()
    future = dcp.async_save(states(model, optimizer), checkpoint_id=str(out / "checkpoint_async"),
                            process_group=writers)
    async_blocking_s = time.perf_counter() - started
    losses.append(step(model, optimizer, mine[SAVE_AT + 1]))  # the next step, while the thread writes
    future.result()
    dist.barrier()
    async_total_s = time.perf_counter() - started
    after = whole_weights(model)

    model, optimizer = new_model(preset, sharded=True)  # a fresh start, then the checkpoint
    load(model, optimizer, out / "checkpoint")
    resumed_loss = step(model, optimizer, mine[SAVE_AT + 1])
    resumed = whole_weights(model)  # a collective: every rank gathers, rank 0 receives
    gap = largest_gap(after, resumed) if rank == 0 else None
    async_model, async_optimizer = new_model(preset, sharded=True)
    load(async_model, async_optimizer, out / "checkpoint_async")
    async_loss = step(async_model, async_optimizer, mine[SAVE_AT + 1])
    result = {"world_size": world, "losses": losses, "resumed_loss": resumed_loss, "resumed_weight_gap": gap,
              "async_resumed_loss": async_loss, "save_s": save_s, "async_blocking_s": async_blocking_s,
              "async_total_s": async_total_s}
    if rank == 0:
        torch.save(after, out / "after.pt")
        (out / "sharded.json").write_text(json.dumps(result, indent=2))
    return result


def resume_unsharded(preset, out: Path) -> dict:
    """In this process, without a process group: load ``out/checkpoint`` (saved by N processes) into a whole model
    and its optimizer, take the step after it on the whole global batch (in the N parts, gradients averaged), and
    compare the loss and the weights with the uninterrupted run's. Returns the loss, the largest weight
    difference, and the loaded model (before its step) for ``export_pretrained``."""
    import copy

    import torch

    from my_utils.core.blocks import block_dataset

    sharded = json.loads((out / "sharded.json").read_text())
    model, optimizer = new_model(preset, sharded=False)
    with warnings.catch_warnings():  # that it loads in one process without a process group is what is meant here
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        load(model, optimizer, out / "checkpoint")
    loaded = copy.deepcopy(model)
    batches = parts(block_dataset(preset, LENGTH), SAVE_AT + 1, sharded["world_size"])
    loss = step(model, optimizer, batches)
    trained = {name: value.cpu() for name, value in model.state_dict().items()}
    gap = largest_gap(torch.load(out / "after.pt", weights_only=True), trained)
    return {"loss": loss, "weight_gap": gap, "loaded": loaded}


def export_pretrained(model, folder: Path, input_ids) -> dict:
    """Save ``model`` as a plain model folder (safetensors and config.json) and load it back with
    ``from_pretrained``: the largest difference between the two models' weights and between their logits on
    ``input_ids`` (equal weights may give logits a rounding apart: a tensor loaded from a file can take another
    kernel path)."""
    import torch
    from transformers import AutoModelForCausalLM

    from my_utils.core.devices import per_rank_device
    from my_utils.run.launch import is_cpu_only

    if is_cpu_only():  # said, not guessed: DeepSpeed (an extra, which saving asks about) would log a warning
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model.save_pretrained(folder)
    reloaded = AutoModelForCausalLM.from_pretrained(folder).to(per_rank_device())
    input_ids = input_ids.to(per_rank_device())
    with torch.no_grad():
        logit_gap = (model.eval()(input_ids).logits - reloaded.eval()(input_ids).logits).abs().max().item()
    return {"weight_gap": largest_gap(model.state_dict(), reloaded.state_dict()), "logit_gap": logit_gap}


def worker_main(run, module: str, doc: str, argv=None) -> None:
    """The command line of a lesson's worker module run by torchrun (this one, ``sharded_qlora``):
    ``run(preset, out)``, then the process group torn down."""
    from my_utils.run.signals import end_process_group

    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--out", type=Path, required=True, help="the folder it writes its files into")
    args = p.parse_args(argv)
    try:
        run(args.preset, args.out)
    finally:
        end_process_group()


def main(argv=None) -> None:
    worker_main(train_save_resume, "my_utils.lessons.reshard", __doc__, argv)


if __name__ == "__main__":
    main()
