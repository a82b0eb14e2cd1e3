"""LoRA on a sharded base (FSDP2): a frozen base and its adapters, both sharded over the ranks; the adapter saved
whole, and a resumed run that restores it on every rank.

Two failures are known from other stacks: a ZeRO-3 run that saves an empty adapter (each rank holds only its shard
and the save writes rank 0's), and an FSDP resume that leaves most of the adapter at its initial values (a shard
loaded into one rank only). Here a save gathers the full adapter to rank 0 (``get_model_state_dict`` with
``full_state_dict``) and writes it with peft; a resume loads it on every rank before the model is sharded, and the
optimizer's state is broadcast from rank 0 into every rank's shards.

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m my_utils.workflows.sharded_lora --preset tiny --save-steps 2
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m my_utils.workflows.sharded_lora --preset tiny --save-steps 2 \\
        --output-dir runs/sharded_lora/mine --resume

A checkpoint holds the adapter and the optimizer whole, so a run resumes on another number of processes as well, given
the same global batch (``--local-batch-size`` times the processes): ``torchrun --nproc_per_node 4 ... --resume
--local-batch-size 2`` continues a run of 2 processes with 4 each (``COURSE_OVERSUBSCRIBE=1`` where a CPU has fewer
cores than that).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar
from pathlib import Path

from my_utils import UserError
from my_utils.core.adapters import AdapterSpec, complete_adapter_folder
from my_utils.core.models import add_adapter, check_lora_targets, load_tokenizer
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.printing import print0
from my_utils.run.checkpoints import load_rng_state, saved_step
from my_utils.run.cli import command_line, file_system_refusal
from my_utils.run.config import LocalBatchSettings, check_choice, setting
from my_utils.run.divergence import check_finite
from my_utils.run.faults import step_done
from my_utils.run.lifecycle import check_resumable, resume_after_restart, run_lifecycle
from my_utils.workflows.ddp_common import worker_report, write_worker_report
from my_utils.workflows.sharding import rank_batches, start_worker

STAGES = ("zero2", "zero3")
CHECKPOINTS = "checkpoints"
# where and how, not what it trains; the process count and the batch per process too, if the global batch stays
# (check_same_global_batch): the checkpoint is whole, and the ranks' batches together are the same examples
LAYOUT = ("num_processes", "local_batch_size")
RESUME_MAY_DIFFER = frozenset({"resume", "output_dir", "save_steps", "timeout_s", *LAYOUT})


DESCRIPTION = ("LoRA on a base sharded with FSDP2 (ZeRO-2 or 3): the adapter saved whole, checkpoints that resume on "
               "every rank. Needs 2+ processes: ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m "
               "my_utils.workflows.sharded_lora. Writes a results folder and prints its summary.")


@dataclass
class Config(LocalBatchSettings):
    adapter: AdapterSpec = setting(AdapterSpec, "the LoRA adapter")
    stage: str = setting("zero3", "zero2 keeps the gathered weights from forward to backward; zero3 frees them",
                         choices=STAGES)
    TRAINING_DEFAULTS: ClassVar[dict] = {"local_batch_size": 4, "max_steps": 6, "max_length": 64}
    SETTING_HELP: ClassVar[dict] = {"local_batch_size": "blocks per process per step",
                                    "max_length": "tokens per packed block"}
    METHOD: ClassVar[str] = "lora"
    save_steps: int = setting(0, "save a checkpoint (the whole adapter and the optimizer) every N steps; 0: never")
    resume: bool = setting(False, "continue --output-dir from its newest whole checkpoint")


def validate(cfg: Config):
    preset = cfg.check_common()
    preset.require("causal")
    cfg.adapter.check_lora_only("sharded LoRA")
    check_choice("stage", cfg.stage, STAGES)
    if cfg.save_steps < 0:
        raise UserError(f"--save-steps must be 0 (never) or positive, got {cfg.save_steps}.")
    if cfg.resume:
        from dataclasses import asdict

        resolved = resolve(cfg, preset, cfg.num_processes or 2)  # run.json records the resolved settings
        check_resumable(cfg.output_dir, asdict(resolved), may_differ=RESUME_MAY_DIFFER, workflow="sharded_lora",
                        checkpoints=CHECKPOINTS)
    return preset


def resolve(cfg: Config, preset, world_size: int) -> Config:
    return replace(cfg, **cfg.settled(preset), adapter=cfg.adapter.resolved(preset.lora_targets),
                   num_processes=world_size)


def check_same_global_batch(cfg: Config, world_size: int) -> int:
    """Before resuming on ``world_size`` processes: the global batch is the one the run trained with, whatever the
    process count; returns the process count it trained on. The sampler deals each step's examples out to the
    ranks, so the same global batch is the same examples at every step, on any number of processes."""
    from my_utils.run.results import read_json

    recorded = read_json(Path(cfg.output_dir) / "run.json")["config"]
    before, per_process = recorded["num_processes"], recorded["local_batch_size"]
    wanted = before * per_process
    if cfg.global_batch(world_size) != wanted:
        fits = f"--local-batch-size {wanted // world_size}" if wanted % world_size == 0 else None
        raise UserError(f"The run in {cfg.output_dir} trained global batches of {wanted} ({per_process} per process "
                        f"on {before}); on {world_size} process(es) resume with "
                        + (fits if fits else f"a process count that divides {wanted}") + ".")
    return before


def sharded_lora_model(base, cfg: Config, checkpoint: Path | None):
    """``base`` with LoRA adapters (restored from ``checkpoint`` on every rank), then sharded."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard

    model = add_adapter(base, cfg.adapter)
    if checkpoint is not None:  # before sharding: every rank loads the whole adapter, then keeps its shard
        set_peft_model_state_dict(model, load_file(checkpoint / "adapter" / "adapter_model.safetensors"))
    # region: LoRA on a sharded base
    for block in model.base_model.model.transformer.h:
        fully_shard(block, reshard_after_forward=cfg.stage == "zero3")
    fully_shard(model, reshard_after_forward=cfg.stage == "zero3")
    # endregion
    return model


def save_whole(model, optimizer, folder: Path, step: int | None = None) -> None:
    """Gather the adapter (and, for a checkpoint with ``step``, the optimizer) whole to rank 0 and write them
    there; every rank must call it. A write the file system refuses (a full disk) stops every rank with rank 0's
    sentence (UserError), not rank 0 alone while the others wait for it."""
    import torch
    import torch.distributed as dist
    from peft import get_peft_model_state_dict
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    from my_utils.run.checkpoints import save_rng_state, write_checkpoint_manifest
    from my_utils.run.results import atomic_write_json

    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered to rank 0, on the CPU
    state = get_model_state_dict(model, options=whole)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=whole) if step is not None else None
    if step is not None:  # every rank's generators: a resume then draws the same dropout masks
        save_rng_state(folder, dist.get_rank())
    refused = [None]
    if dist.get_rank() == 0:
        try:
            adapter = get_peft_model_state_dict(model, state_dict=state)
            model.save_pretrained(folder / "adapter", state_dict=adapter, safe_serialization=True)
            if step is not None:
                torch.save(optimizer_state, folder / "optimizer.pt")
                atomic_write_json(folder / "trainer_state.json", {"global_step": step})
        except OSError as e:
            refused[0] = file_system_refusal(e)
            if refused[0] is None:
                raise
    dist.broadcast_object_list(refused, src=0)  # also the barrier: rank 0 has written, or said why not
    if refused[0] is not None:
        raise UserError(refused[0])
    if step is not None and dist.get_rank() == 0:  # last: the manifest lists every rank's files
        write_checkpoint_manifest(folder)
    dist.barrier()


def restore_optimizer(model, optimizer, checkpoint: Path) -> None:
    """The optimizer state saved whole in ``checkpoint``, read by rank 0 and broadcast into every rank's shards."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True) if dist.get_rank() == 0 else {}
    set_optimizer_state_dict(model, optimizer, saved,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def probe_logits(model, dataset) -> list[float]:
    """The first logits of a fixed batch, in eval mode (no adapter dropout): the saved adapter, reloaded anywhere,
    must give them again."""
    import torch

    probe = torch.as_tensor(dataset[0]["input_ids"])[None]
    model.eval()
    try:
        with torch.no_grad():
            return model(input_ids=probe).logits[0, :4, :4].flatten().tolist()
    finally:
        model.train()


def train(cfg: Config) -> dict:
    """Train LoRA on a sharded base; returns the summary (on every rank; rank 0 also writes it)."""
    cfg = resume_after_restart(cfg)  # restarted by torchrun --max-restarts: go on from the newest checkpoint
    preset = validate(cfg)
    import torch
    import torch.distributed as dist

    cfg, world_size, dataset, base = start_worker(cfg, preset, resolve, "sharded_lora")
    check_lora_targets(base, cfg.adapter.targets, cfg.adapter.rank)  # before the results folder exists
    trained_on = check_same_global_batch(cfg, world_size) if cfg.resume else world_size
    if cfg.resume:
        dist.barrier()  # every rank has read run.json before rank 0 rewrites it for the resume
    with run_lifecycle(cfg, world_size, default_dir=RUNS_ROOT / "sharded_lora" / f"{cfg.preset}_{cfg.stage}",
                       checkpoints=CHECKPOINTS, workflow="sharded_lora", layout=LAYOUT) as life:
        write_worker_report(life.folder, worker_report())
        model = sharded_lora_model(base, cfg, life.checkpoint)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                                      weight_decay=0.0)
        done, losses = 0, []
        if life.checkpoint is not None:
            restore_optimizer(model, optimizer, life.checkpoint)
            if trained_on == world_size:
                load_rng_state(life.checkpoint, dist.get_rank())
            else:  # each rank drew its own masks for its own part of the batch: there is no state to give back
                print0(f"resumed on {world_size} process(es) from a run on {trained_on}: the same examples and "
                       "weights, but fresh random states (adapter dropout draws other masks)")
            done = saved_step(life.checkpoint)  # from its sealed manifest, not its folder's name
        batches = rank_batches(dataset, cfg, world_size)
        for _ in range(done):  # the batches the checkpoint had already trained on
            next(batches)
        for step in range(done + 1, cfg.max_steps + 1):
            loss = model(**next(batches)).loss
            loss.backward()
            check_finite(step, loss, model.parameters(), cfg.learning_rate)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world_size)
            life.log({"step": step, "loss": losses[-1]})
            if cfg.save_steps and step % cfg.save_steps == 0:
                save_whole(model, optimizer, life.folder / CHECKPOINTS / f"checkpoint-{step}", step)
            step_done(step, dist.get_rank())  # the step a failure names; the tests' faults
        save_whole(model, optimizer, life.folder)
        logits = probe_logits(model, dataset)
        summary = None
        if life.is_main:
            summary = {"workflow": "sharded_lora", "preset": cfg.preset, "stage": cfg.stage,
                       "world_size": world_size, "steps": cfg.max_steps,
                       "local_batch_size": cfg.local_batch_size, "global_batch_size": cfg.global_batch(world_size),
                       # of this process's steps (a resumed run's first is its first step after the checkpoint)
                       "train_loss_first": losses[0] if losses else None,
                       "train_loss_final": losses[-1] if losses else None,
                       "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
                       "adapter_bytes": (life.folder / "adapter" / "adapter_model.safetensors").stat().st_size,
                       "probe_logits": logits}
            complete_adapter_folder(life.folder / "adapter", load_tokenizer(preset), life.run.info, summary)
        life.finish(summary)
    return life.summary


parse_args, main = command_line(Config, train, __name__, DESCRIPTION)
