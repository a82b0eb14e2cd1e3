"""Traps of distributed fine-tuning that need several processes, each sprung and then cured on the same batches.

- ``reentrant_ddp``: LoRA under DDP with reentrant activation checkpointing and ``find_unused_parameters=True``
  stops in backward with "Expected to mark a variable ready only once" (peft #313, trl #4782). Cured by
  non-reentrant checkpointing.
- ``evaluate_first``: ``Trainer.evaluate()`` before ``Trainer.train()`` leaves the model unwrapped; every rank then
  trains alone and the run ends with exit code 0, its ranks' adapters apart. Cured by evaluating without the
  Trainer before training (``my_utils.core.evaluation.held_out_loss``).
- ``sharded_save``: LoRA on a ZeRO-3 base, saved the way an unsharded model is, by rank 0 alone. Under DeepSpeed's
  ZeRO-3 (when DeepSpeed is installed) rank 0 holds empty placeholders and writes an adapter of no elements
  (DeepSpeed #4295, peft #2892); under FSDP2 (without DeepSpeed) it writes its own shard of each tensor (accelerate
  PR #4206). Neither reloads. Cured by gathering the adapter whole first (``deepspeed.zero.GatheredParameters``,
  ``my_utils.workflows.sharded_lora.save_whole``).
- ``frozen_upcast``: a bfloat16 base with LoRA, cast to float32 whole before ``fully_shard`` (as accelerate's FSDP2
  preparation did under mixed precision, accelerate #3844): each rank stores its frozen shards at twice the bytes.
  Cured by keeping the frozen weights in bfloat16 and only the trainable ones in float32. Both are measured against
  the bytes the frozen weights take whole on one process.

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m my_utils.workflows.traps --preset tiny

Each trap records what the trap gave and what the cure gave (summary.json); lesson 12 (traps) reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from my_utils import UserError
from my_utils.core.adapters import AdapterSpec
from my_utils.core.models import add_adapter
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.printing import native_stderr_silenced, print0
from my_utils.core.tables import text_table
from my_utils.run.cli import command_line
from my_utils.run.config import LocalBatchSettings, check_choice, check_choices, setting
from my_utils.run.divergence import check_finite
from my_utils.run.faults import course_trainer_class
from my_utils.run.lifecycle import run_lifecycle
from my_utils.workflows.ddp_common import worker_report, write_worker_report
from my_utils.workflows.sharded_lora import probe_logits, save_whole
from my_utils.workflows.sharding import deepspeed_engine, deepspeed_installed, local_bytes, rank_batches, start_worker

TRAPS = ("reentrant_ddp", "evaluate_first", "sharded_save", "frozen_upcast")
ZERO3 = ("deepspeed", "fsdp2")  # what shards the base in sharded_save


DESCRIPTION = ("Traps of distributed fine-tuning that need several processes (reentrant checkpointing under DDP, "
               "evaluating before training, saving a sharded adapter), each sprung and cured. Needs 2+ processes: "
               "ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m my_utils.workflows.traps. Writes a results "
               "folder and prints what each trap and cure gave.")


@dataclass
class Config(LocalBatchSettings):
    traps: tuple[str, ...] = setting(TRAPS, "which traps to spring and cure, in order: " + ", ".join(TRAPS),
                                     choices=TRAPS)
    zero3: str | None = setting(None, "what shards the base in sharded_save: deepspeed (DeepSpeed's ZeRO-3) or fsdp2 "
                                "(FSDP2's fully_shard)", choices=ZERO3, unset="deepspeed where installed, else fsdp2")
    TRAINING_DEFAULTS: ClassVar[dict] = {"local_batch_size": 4, "max_steps": 3, "max_length": 64}
    SETTING_HELP: ClassVar[dict] = {"local_batch_size": "blocks per process per step",
                                    "max_steps": "optimizer steps per trap and per cure",
                                    "max_length": "tokens per packed block"}
    METHOD: ClassVar[str] = "lora"


def validate(cfg: Config):
    preset = cfg.check_common()
    preset.require("causal")
    check_choices("--traps", "trap", cfg.traps, TRAPS)
    if cfg.zero3 is not None:
        check_choice("--zero3", cfg.zero3, ZERO3)
    if cfg.zero3 == "deepspeed" and not deepspeed_installed():
        raise UserError("--zero3 deepspeed needs DeepSpeed, an extra of the course: pip install -e \".[deepspeed]\"; "
                        "or use --zero3 fsdp2.")
    return preset


def resolve(cfg: Config, preset, world_size: int) -> Config:
    zero3 = cfg.zero3 or ("deepspeed" if deepspeed_installed() else "fsdp2")
    return replace(cfg, **cfg.settled(preset), traps=tuple(cfg.traps), zero3=zero3, num_processes=world_size)


def lora_copy(base, preset):
    """A fresh LoRA model on a copy of ``base`` (the same initial adapter on every rank: the seed is reset)."""
    import copy

    import torch

    torch.manual_seed(0)
    return add_adapter(copy.deepcopy(base), AdapterSpec().resolved(preset.lora_targets))


def adapter_spread(model) -> float:
    """The largest difference, over every adapter element, between the ranks' copies (0: they agree)."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.detach().flatten() for n, p in model.named_parameters() if "lora_" in n])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return (high - low).abs().max().item()


def train_steps(model, optimizer, batches, steps: int, **forward) -> list[float]:
    """``steps`` plain optimizer steps; this rank's losses."""
    losses = []
    for step in range(1, steps + 1):
        loss = model(**next(batches), **forward).loss
        loss.backward()
        check_finite(step, loss, model.parameters(), optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def checkpointed_ddp(model, reentrant: bool):
    """``model``'s blocks under activation checkpointing (reentrant or not), then DDP searching for unused
    parameters, as a Trainer with ``gradient_checkpointing`` and ``ddp_find_unused_parameters=True`` does."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             apply_activation_checkpointing,
                                                                             checkpoint_wrapper)
    from torch.nn.parallel import DistributedDataParallel

    block = type(model.base_model.model.transformer.h[0])
    # region: the reentrant trap
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=impl)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper,
                                   check_fn=lambda module: isinstance(module, block))
    model.enable_input_require_grads()  # reentrant checkpointing needs inputs that require grad (lesson 12, trap 2)
    return DistributedDataParallel(model, find_unused_parameters=True)
    # endregion


def reentrant_ddp(base, preset, cfg: Config, batches) -> dict:
    """Reentrant checkpointing under DDP stops in backward; non-reentrant trains, the ranks in step."""
    import torch

    outcome = {}
    for name, reentrant in (("trap", True), ("cure", False)):
        model = checkpointed_ddp(lora_copy(base, preset), reentrant)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate)
        try:
            # DDP's find_unused_parameters=True is the trap's own setting (a Trainer's, kept for the cure): its
            # C++ warning that it found no unused parameter says nothing new here
            with native_stderr_silenced():
                losses = train_steps(model, optimizer, batches(), cfg.max_steps, use_cache=False)
            outcome[name] = {"error": None, "losses": losses, "adapter_spread": adapter_spread(model.module)}
        except RuntimeError as error:  # every rank fails at the same point of the same step
            outcome[name] = {"error": str(error).split(". ")[0] + ".", "losses": None, "adapter_spread": None}
    return outcome


def evaluate_first(base, preset, cfg: Config, dataset, folder) -> dict:
    """``Trainer.evaluate()`` before ``train()``: DDP never wraps the model and the ranks' adapters part. The
    course's Trainer (``course_trainer_class``) stops such a run before its first step."""
    from transformers import PrinterCallback, Trainer, TrainingArguments

    outcome = {}
    for name, trainer_class, evaluate_before in (("trap", Trainer, True), ("cure", Trainer, False),
                                                 ("guarded", course_trainer_class(), True)):
        model = lora_copy(base, preset)
        args = TrainingArguments(output_dir=str(folder / f"trainer_{name}"),
                                 per_device_train_batch_size=cfg.local_batch_size,
                                 per_device_eval_batch_size=cfg.local_batch_size, max_steps=cfg.max_steps,
                                 learning_rate=cfg.learning_rate, report_to="none", save_strategy="no", use_cpu=True,
                                 seed=cfg.seed, ddp_find_unused_parameters=False, disable_tqdm=True)
        trainer = trainer_class(model=model, args=args, train_dataset=dataset, eval_dataset=dataset[:8])
        trainer.remove_callback(PrinterCallback)  # its metrics dicts: the table at the end says what counts
        try:
            # region: evaluating first
            if evaluate_before:
                trainer.evaluate()
            trainer.train()
            # endregion
            outcome[name] = {"wrapped": type(trainer.model_wrapped).__name__, "adapter_spread": adapter_spread(model),
                             "error": None}
        except UserError as error:  # every rank stops at its first step
            outcome[name] = {"wrapped": None, "adapter_spread": None, "error": str(error)}
    return outcome


def sharded_save(base, preset, cfg: Config, dataset, batches, folder) -> dict:
    """LoRA on a ZeRO-3 base, saved naively by rank 0 and saved whole; each reloaded into an unsharded model, whose
    outputs must be the trained sharded model's. Under DeepSpeed's ZeRO-3 (``--zero3 deepspeed``, the default where
    DeepSpeed is installed: the naive save writes its empty placeholders) or FSDP2 (the naive save writes rank 0's
    shards)."""
    import copy

    import torch
    import torch.distributed as dist
    from peft import PeftModel
    from safetensors.torch import load_file

    # every adapter element, counted before sharding (a ZeRO-3 parameter's numel() is its placeholder's: 0)
    expected = sum(p.numel() for p in lora_copy(base, preset).parameters() if p.requires_grad)
    save = {"deepspeed": deepspeed_save, "fsdp2": fsdp2_save}[cfg.zero3]
    trained = save(lora_copy(base, preset), cfg, batches, dataset, folder)
    outcome = {"form": {"deepspeed": "deepspeed_zero3", "fsdp2": "fsdp2"}[cfg.zero3], "expected_elements": expected}
    if dist.get_rank() == 0:
        for name, path in (("trap", folder / "naive_adapter"), ("cure", folder / "whole" / "adapter")):
            saved = load_file(path / "adapter_model.safetensors")
            entry = {"bytes": (path / "adapter_model.safetensors").stat().st_size,
                     "elements": sum(v.numel() for v in saved.values()), "error": None, "logit_gap": None}
            try:
                reloaded = PeftModel.from_pretrained(copy.deepcopy(base), path)
                logits = torch.tensor(probe_logits(reloaded, dataset))
                entry["logit_gap"] = (logits - trained).abs().max().item()
            except RuntimeError as error:  # torch's "size mismatch" on loading a shard into the whole tensor
                entry["error"] = str(error).strip().splitlines()[-1].strip()
            outcome[name] = entry
    return outcome


def deepspeed_save(model, cfg: Config, batches, dataset, folder):
    """Train ``model`` under DeepSpeed's ZeRO-3, then save its adapter naively (trap) and gathered (cure); the
    trained model's probe logits."""
    import torch
    import torch.distributed as dist

    import deepspeed

    engine, _ = deepspeed_engine(model, 3, cfg.learning_rate, cfg.local_batch_size)
    for _, batch in zip(range(cfg.max_steps), batches()):
        engine.backward(engine(**batch).loss)  # DeepSpeed's loop: the engine runs backward and the step
        engine.step()
    trained = torch.tensor(probe_logits(engine, dataset))
    model = engine.module
    # region: saving a sharded adapter
    if dist.get_rank() == 0:  # the trap: rank 0 saves as for one process; ZeRO-3 left it empty placeholders
        model.save_pretrained(folder / "naive_adapter", safe_serialization=True)
    adapter = [p for p in model.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(adapter):  # the cure: every rank joins the gathering, rank 0 writes
        if dist.get_rank() == 0:
            model.save_pretrained(folder / "whole" / "adapter", safe_serialization=True)
    # endregion
    dist.barrier()
    return trained


def fsdp2_save(model, cfg: Config, batches, dataset, folder):
    """Train ``model`` on an FSDP2 base, then save its adapter naively (trap: rank 0's shards) and gathered
    (cure, ``sharded_lora.save_whole``); the trained model's probe logits."""
    import torch
    import torch.distributed as dist
    from peft import get_peft_model_state_dict
    from torch.distributed.fsdp import fully_shard

    for block in model.base_model.model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate)
    train_steps(model, optimizer, batches(), cfg.max_steps)
    trained = torch.tensor(probe_logits(model, dataset))
    if dist.get_rank() == 0:  # the trap: rank 0 writes the adapter as it holds it, its own shard of each tensor
        naive = {k: v.to_local().contiguous() for k, v in get_peft_model_state_dict(model).items()}
        model.save_pretrained(folder / "naive_adapter", state_dict=naive, safe_serialization=True)
    save_whole(model, None, folder / "whole")  # the cure: every rank joins the gathering, rank 0 writes
    return trained


def frozen_upcast(base, preset) -> dict:
    """The bytes each rank stores for the frozen and the trainable weights of a sharded bfloat16 base with LoRA,
    cast to float32 whole (the trap) or not (the cure: peft keeps the adapters in float32 already), beside the
    bytes of the frozen weights of the same model whole on one process (``unsharded_frozen_bytes``)."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    outcome = {}
    for name in ("trap", "cure"):
        model = lora_copy(copy.deepcopy(base).to(torch.bfloat16), preset)  # as loaded with dtype=torch.bfloat16
        outcome.setdefault("unsharded_frozen_bytes", local_bytes(p for p in model.parameters() if not p.requires_grad))
        # region: the upcast trap
        if name == "trap":
            model.to(torch.float32)  # every weight, frozen or not, for mixed precision's float32 master copy
        for block in model.base_model.model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        # endregion
        outcome[name] = {kind: local_bytes(p for p in model.parameters() if p.requires_grad == trainable)
                         for kind, trainable in (("frozen_bytes", False), ("trainable_bytes", True))}
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, outcome[name]["frozen_bytes"])
        outcome[name]["frozen_bytes_per_rank"] = every_rank
    return outcome


def train(cfg: Config) -> dict:
    """Spring and cure each trap in ``cfg.traps``; returns the summary (on every rank; rank 0 also writes it)."""
    preset = validate(cfg)

    cfg, world_size, dataset, base = start_worker(cfg, preset, resolve, "traps")
    with run_lifecycle(cfg, world_size, default_dir=RUNS_ROOT / "traps" / f"{cfg.preset}_x{world_size}",
                       workflow="traps") as life:
        write_worker_report(life.folder, worker_report(base))
        results = {}

        def batches():  # the same batches for the trap and for its cure
            return rank_batches(dataset, cfg, world_size)

        for trap in cfg.traps:
            if trap == "reentrant_ddp":
                results[trap] = reentrant_ddp(base, preset, cfg, batches)
            elif trap == "frozen_upcast":
                results[trap] = frozen_upcast(base, preset)
            elif trap == "evaluate_first":
                results[trap] = evaluate_first(base, preset, cfg, dataset, life.folder)
            else:
                results[trap] = sharded_save(base, preset, cfg, dataset, batches, life.folder)
        summary = {"workflow": "traps", "preset": cfg.preset, "world_size": world_size,
                   "local_batch_size": cfg.local_batch_size, "global_batch_size": cfg.global_batch(world_size),
                   "steps_per_trap": cfg.max_steps, "traps": results} if life.is_main else None
        life.finish(summary)
        print0(outcome_table(results))
    return life.summary


def outcome_table(results: dict) -> str:
    """Each trap and its cure (and the course's guard, where there is one), a row each: what happened."""
    from my_utils.core.memory import format_bytes

    def said(trap: str, entry: dict) -> str:
        if entry.get("error"):
            return entry["error"]
        if trap == "reentrant_ddp":
            losses = entry["losses"]
            return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, the ranks' adapters apart by {entry['adapter_spread']:.1e}"
        if trap == "evaluate_first":
            return f"trained as {entry['wrapped']}, the ranks' adapters apart by {entry['adapter_spread']:.1e}"
        if trap == "sharded_save":
            return (f"{entry['elements']:,} of {results[trap]['expected_elements']:,} adapter parameters saved, logits "
                    f"off by {entry['logit_gap']:.1e}")
        return "frozen weights per rank: " + ", ".join(map(format_bytes, entry["frozen_bytes_per_rank"]))

    rows = [[trap, variant, said(trap, result[variant])] for trap, result in results.items()
            for variant in ("trap", "cure", "guarded") if isinstance(result.get(variant), dict)]
    return text_table(["trap", "run", "what happened"], rows, names=(2,))


parse_args, main = command_line(Config, train, __name__, DESCRIPTION)
