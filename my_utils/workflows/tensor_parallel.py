"""Tensor parallel (Megatron-style), with or without sequence parallel, training a Llama-family causal LM.

    # a shell, 2 processes on a CPU (gloo): every process holds half of every attention and MLP matrix
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m my_utils.workflows.tensor_parallel --preset tiny
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.tensor_parallel --preset tiny --sequence-parallel
    # checkpoints every 4 steps (torch's distributed checkpoint: each process writes its own shards), and a resume
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m my_utils.workflows.tensor_parallel --preset tiny \
        --save-steps 4 --output-dir runs/tensor_parallel/mine [--resume]

The plan is Megatron-LM's (Shoeybi et al. 2019): in each decoder layer the query, key and value projections are
split by output (column-parallel: each process computes its own attention heads) and the output projection by
input (row-parallel: each process multiplies its heads' slice, one all-reduce sums the parts); the MLP's gate and
up projections are column-parallel and its down projection row-parallel. The embedding is split by vocabulary and
the output layer by vocabulary too (its logits gathered). With ``--sequence-parallel`` (Korthikanti et al. 2022)
the norms between those blocks work on a slice of the sequence each, and every all-reduce becomes a
reduce-scatter and an all-gather: the same bytes moved, and the activations around the norms split too.

Each run first proves the split model is the same model: on one batch, a forward, a backward and an SGD step give
the loss, the gradients and the parameters of an unsplit copy held by the same process, and the collectives of
each phase are counted (``CommDebugMode``) against the plan's arithmetic. Then it trains a few AdamW steps. The
``tiny`` preset's model is a 4-layer Llama built from ``assets/tiny/llama/config.json`` with random weights (GPT-2's
``Conv1D`` layers cannot be split by ``parallelize_module``); ``smollm2-135m`` is the real one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar

from my_utils import UserError
from my_utils.core.data import token_blocks
from my_utils.core.devices import per_rank_device
from my_utils.core.memory import peak_bytes, snapshot
from my_utils.core.models import check_available, load_tokenizer
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.printing import get_world_size, native_stderr_silenced, print0, rank_print
from my_utils.core.splits import check_tensor_split, model_config
from my_utils.core.stats import check_tolerances
from my_utils.run.callbacks import SavedActivations
from my_utils.run.cli import command_line
from my_utils.run.config import GlobalBatchSettings, setting
from my_utils.run.checkpoints import saved_step
from my_utils.run.divergence import check_finite
from my_utils.run.faults import step_done
from my_utils.run.lifecycle import check_resumable, join_world, process_group_backend, resume_after_restart, run_lifecycle

COLLECTIVE_NAMES = {"all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
                    "reduce_scatter_tensor": "reduce_scatter"}  # functional collectives' names and c10d's


DESCRIPTION = ("Tensor parallel (Megatron: attention heads and MLP columns split over processes), optionally with "
               "sequence parallel, training a Llama-family model, checked against an unsplit copy. Needs 2+ processes: "
               "torchrun --nproc_per_node 2 -m my_utils.workflows.tensor_parallel ..., or (on a CPU) "
               "ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m ...")


@dataclass
class Config(GlobalBatchSettings):
    TRAINING_DEFAULTS: ClassVar[dict] = {"global_batch_size": 8, "max_length": 64, "max_steps": 12,
                                         "learning_rate": 1e-3}
    SETTING_HELP: ClassVar[dict] = {"global_batch_size": "sequences per step (every process sees the same batch)",
                                    "max_length": "tokens per sequence", "max_steps": "AdamW steps after the one-step "
                                    "check", "learning_rate": "the rate of the check's SGD step and of the AdamW steps"}
    sequence_parallel: bool = setting(False, "split the norms' work by sequence position too (Megatron-SP)")
    save_steps: int = setting(0, "save a checkpoint (each process's shards of the model and optimizer) every N steps; "
                                 "0: never")
    resume: bool = setting(False, "continue --output-dir from its newest whole checkpoint, on as many processes")


CHECKPOINTS = "checkpoints"
RESUME_MAY_DIFFER = frozenset({"resume", "output_dir", "save_steps", "timeout_s"})  # where and how, not what it trains


def validate(cfg: Config):
    """Check the config before any process group starts; returns the preset and the model's config."""
    preset = cfg.check_common()
    preset.require("causal")
    config = model_config(preset)
    if cfg.max_length > config.max_position_embeddings:
        raise UserError(f"--max-length {cfg.max_length} is beyond the model's {config.max_position_embeddings} "
                        "positions; lower it.")
    check_tensor_split(config, cfg.num_processes or get_world_size(), cfg.sequence_parallel, cfg.max_length)
    if cfg.save_steps < 0:
        raise UserError(f"--save-steps must be 0 (never) or positive, got {cfg.save_steps}.")
    if cfg.resume:
        from dataclasses import asdict

        world_size = cfg.num_processes or get_world_size()  # run.json records the settings as they were resolved
        check_resumable(cfg.output_dir, asdict(replace(cfg, num_processes=world_size)), may_differ=RESUME_MAY_DIFFER,
                        workflow="tensor_parallel", checkpoints=CHECKPOINTS)
    return preset, config


# region: the Megatron plan
def megatron_plan(sequence_parallel: bool, tied: bool) -> tuple[dict, dict]:
    """``parallelize_module`` plans: (the model's top, every decoder layer).

    Without sequence parallel the activations between blocks are whole on every process (Replicate); with it they
    are split by position (Shard(1)), the norms work on their slice (SequenceParallel), and each block gathers the
    sequence at its entrance and scatters its sum at its exit. A tied embedding and output layer (SmolLM2) stay
    whole: one weight cannot be split two ways.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    between = Shard(1) if sequence_parallel else Replicate()  # the activations between blocks
    keep = not sequence_parallel  # hand plain tensors on when nothing is split by position
    layer = {
        # every block takes the whole sequence once (one all-gather, or nothing), so its column-parallel inputs
        # share one gradient sum in backward (one all-reduce per block: Megatron's "f")
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": between},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                        use_local_output=False),
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),  # each process: its own heads
        "self_attn.o_proj": RowwiseParallel(output_layouts=between, use_local_output=keep),  # sum (or scatter)
        "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                  use_local_output=False),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=between, use_local_output=keep),
    }
    top = {}
    if sequence_parallel:
        layer |= {"input_layernorm": SequenceParallel(use_local_output=False),
                  "post_attention_layernorm": SequenceParallel(use_local_output=False)}
        top["model.norm"] = SequenceParallel(use_local_output=False)
    if tied:
        if sequence_parallel:
            top["model.embed_tokens"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=between,
                                                            use_local_output=False)
            top["lm_head"] = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                                use_local_output=True)
    else:
        top["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between,
                                                    use_local_output=keep)  # split by vocabulary
        top["lm_head"] = ColwiseParallel(input_layouts=between, output_layouts=Replicate())  # logits gathered
    return top, layer
# endregion


def expected_collectives(layers: int, sequence_parallel: bool, tied: bool) -> dict:
    """The plan's collectives per phase, by arithmetic.

    Each decoder layer has two blocks (attention, MLP). Without sequence parallel a block ends in an all-reduce in
    forward and begins with one in backward (Megatron's g and f); with it, a block begins with an all-gather and
    ends with a reduce-scatter, and backward swaps them. A vocabulary-split embedding sums its parts like a block's
    end; a vocabulary-split output layer gathers its logits, and its input is a block's beginning. A whole (tied)
    embedding and output layer only cut or gather the sequence. With sequence parallel, each norm's weight
    gradient is a sum over the positions of every process: one all-reduce per norm at the optimizer step.
    """
    from collections import Counter

    blocks, norms = 2 * layers, 2 * layers + 1
    forward, backward, step = Counter(), Counter(), Counter()
    if sequence_parallel:
        forward.update(all_gather=blocks + 1, reduce_scatter=blocks)  # + the output layer's input
        backward.update(all_gather=blocks + 1, reduce_scatter=blocks)  # + the embedding's output
        step.update(all_reduce=norms)
        if not tied:
            forward.update(reduce_scatter=1, all_gather=1)  # the embedding's sum, scattered; the logits gathered
            backward.update(reduce_scatter=1)  # the output layer's input gradient
    else:
        forward.update(all_reduce=blocks)
        backward.update(all_reduce=blocks)
        if not tied:
            forward.update(all_reduce=1, all_gather=1)  # the embedding's sum; the logits gathered
            backward.update(all_reduce=1)  # the output layer's input gradient
    return {"forward": dict(forward), "backward": dict(backward), "optimizer": dict(step)}


class CountedCollectives:
    """Counts the collectives issued inside it (``CommDebugMode``); ``counts``: {short name: count} afterwards."""

    def __enter__(self):
        import warnings

        from torch.distributed.tensor.debug import CommDebugMode

        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()  # its module hooks warn about models that return no plain tensors
        warnings.filterwarnings("ignore", message=".*backward hook", category=UserWarning)
        self._mode = CommDebugMode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._warnings.__exit__(*exc)
        self.counts = {COLLECTIVE_NAMES.get(str(op).split(".")[-1], str(op)): n
                       for op, n in self._mode.get_comm_counts().items() if n}


def build_model(preset, config, cfg: Config):
    """The model, with the same weights on every process (drawn from --seed, or the preset's pretrained ones)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    if preset.name == "tiny" or cfg.random_init:
        model = AutoModelForCausalLM.from_config(config)
    else:
        check_available(preset.causal_model)
        model = AutoModelForCausalLM.from_pretrained(preset.causal_model)
    model.config.use_cache = False
    return model


def whole(tensor):
    """A DTensor gathered whole (a collective: every process calls it in the same order), a tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def split(model, mesh, sequence_parallel: bool) -> None:
    """Apply the Megatron plan to ``model`` in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    top, layer = megatron_plan(sequence_parallel, model.config.tie_word_embeddings)
    parallelize_module(model, mesh, top)
    for block in model.model.layers:
        parallelize_module(block, mesh, layer)


def one_step_check(model, mesh, batch, cfg: Config) -> dict:
    """Forward, backward and one SGD step on ``batch`` by ``model`` split over the mesh, and by an unsplit copy:
    the differences, the collectives of each phase and the activations each keeps for backward. The split model
    keeps the step and drops its gradients."""
    import copy

    import torch

    reference = copy.deepcopy(model)
    with SavedActivations(reference) as saved_whole:
        reference_loss = reference(input_ids=batch, labels=batch).loss
    reference_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=cfg.learning_rate).step()
    split(model, mesh, cfg.sequence_parallel)
    with CountedCollectives() as forward, SavedActivations(model) as saved:
        loss = model(input_ids=batch, labels=batch).loss
    with CountedCollectives() as backward:
        loss.backward()
    pairs = list(zip(model.parameters(), reference.parameters()))
    grad_scale = max(float(q.grad.abs().max()) for _, q in pairs)
    grad_diff = max(float((whole(p.grad) - q.grad).abs().max()) for p, q in pairs) / grad_scale
    with CountedCollectives() as step:
        torch.optim.SGD(model.parameters(), lr=cfg.learning_rate).step()
    with torch.no_grad():
        param_diff = max(float((whole(p) - q).abs().max()) for p, q in pairs)
    model.zero_grad(set_to_none=True)  # training starts from no gradient, as a resumed run does
    return {"loss": loss.item(), "reference_loss": reference_loss.item(), "grad_rel_diff": grad_diff,
            "param_max_diff": param_diff,
            "collectives": {"forward": forward.counts, "backward": backward.counts, "optimizer": step.counts},
            "saved_activation_bytes": saved.bytes, "saved_activation_bytes_whole": saved_whole.bytes}


def parameter_split(model, world_size: int) -> dict:
    """What each process holds of the split model: its parameter count, and the formula's (split matrices / N,
    the rest whole, named)."""
    from torch.distributed.tensor import DTensor, Replicate

    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    whole_names = [n for n, p in model.named_parameters()
                   if not isinstance(p, DTensor) or all(isinstance(s, Replicate) for s in p.placements)]
    named = dict(model.named_parameters())
    kept = sum(named[n].numel() for n in whole_names)
    split_total = sum(p.numel() for p in model.parameters()) - kept
    layer0 = {n.removeprefix("model.layers.0."): list(p.to_local().shape) for n, p in named.items()
              if n.startswith("model.layers.0.") and isinstance(p, DTensor) and p.dim() == 2}
    return {"local": local, "formula": kept + split_total // world_size, "whole": kept, "split": split_total,
            "whole_names": sorted({n.split(".")[-2] for n in whole_names}), "layer0_shapes": layer0}


def train(cfg: Config) -> dict:
    """Check the split model against an unsplit copy, then train it; returns the summary on every rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cfg = resume_after_restart(cfg)  # restarted by torchrun --max-restarts: go on from the newest checkpoint
    preset, config = validate(cfg)
    world_size = join_world(cfg.num_processes, cfg.timeout_s)
    if world_size < 2:
        raise UserError("tensor_parallel splits every matrix over processes but this run has one; launch it with "
                        "torchrun --nproc_per_node 2 or accelerate launch --num_processes 2.")
    cfg = replace(cfg, num_processes=world_size)
    device = per_rank_device()
    data = token_blocks(preset, load_tokenizer(preset), cfg.global_batch_size * (cfg.max_steps + 1), cfg.max_length)
    batches = data.to(device).split(cfg.global_batch_size)
    mode = "tp+sp" if cfg.sequence_parallel else "tp"
    with run_lifecycle(cfg, world_size, default_dir=RUNS_ROOT / "tensor_parallel" / f"{cfg.preset}_{mode}",
                       checkpoints=CHECKPOINTS, workflow="tensor_parallel") as life:
        model = build_model(preset, config, cfg).to(device)
        mesh = init_device_mesh(torch.device(device).type, (world_size,))
        check = one_step_check(model, mesh, batches[0], cfg)
        rank_print(f"loss {check['loss']:.6f} (unsplit copy {check['reference_loss']:.6f}); gradients differ by "
                   f"{check['grad_rel_diff']:.1e} of their largest, parameters after the step by "
                   f"{check['param_max_diff']:.1e}")
        losses, runtime = train_steps(model, batches[1:], cfg, life)
        waited = collective_wait(model, batches[-1])
        reports = life.gather({"process": dist.get_rank(), "world_size_seen": dist.get_world_size(), **check,
                               "parameters": parameter_split(model, world_size), "losses": losses,
                               "collective_wait": waited,
                               "memory": {"process": dist.get_rank(), "end": snapshot(device)}})
        life.finish(summarize(cfg, mode, config, world_size, reports, runtime) if life.is_main else None)
        print0(f"{mode}: every process holds {life.summary['parameters_local'][0]:,} of "
               f"{life.summary['total_parameters']:,} parameters; loss {life.summary['train_loss_first']:.3f} -> "
               f"{life.summary['train_loss_final']:.3f}")
    check_tolerances(life.summary, "The split model and the unsplit model")
    return life.summary


def collective_wait(model, batch) -> dict:
    """One more forward and backward on ``batch``, under torch's profiler: how long this process waited for its
    collectives (``wait_tensor``: communication that no computation hid), as seconds and as a share of the step.
    Its gradients are cleared afterwards."""
    from torch.profiler import ProfilerActivity, profile

    with native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU]) as profiled:
        started = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        step = time.perf_counter() - started
    waited = sum(e.cpu_time_total for e in profiled.events() if e.name.endswith("::wait_tensor")) / 1e6
    model.zero_grad(set_to_none=True)
    return {"step_s": step, "waited_s": waited, "share": waited / step}


def train_steps(model, batches, cfg: Config, life) -> tuple[list[float], float]:
    """AdamW steps on the split model, logged one by one (from the checkpoint's step on, for a resumed run); every
    process sees the same batch. Returns this process's losses and the runtime."""
    import torch
    import torch.distributed as dist

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    done = 0
    if life.checkpoint is not None:
        load_checkpoint(model, optimizer, life.checkpoint)
        done = saved_step(life.checkpoint)  # from its sealed manifest, not its folder's name
    losses, started = [], time.perf_counter()
    for step, batch in enumerate(batches[done:], start=done + 1):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        check_finite(step, loss, model.parameters(), cfg.learning_rate)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        life.log({"step": step, "loss": losses[-1]})
        if cfg.save_steps and step % cfg.save_steps == 0:
            save_checkpoint(model, optimizer, life.folder / CHECKPOINTS / f"checkpoint-{step}", step)
        step_done(step, dist.get_rank())  # the step a failure names; the tests' faults
    return losses, time.perf_counter() - started


def save_checkpoint(model, optimizer, folder, step: int) -> None:
    """The model and optimizer as torch's distributed checkpoint: each process writes its own shards (no gather),
    then rank 0 the step and the manifest that makes the checkpoint whole. Every process must call it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from my_utils.run.checkpoints import write_checkpoint_manifest
    from my_utils.run.results import atomic_write_json

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
    if dist.get_rank() == 0:
        atomic_write_json(folder / "trainer_state.json", {"global_step": step})
    dist.barrier()  # every shard written
    if dist.get_rank() == 0:
        write_checkpoint_manifest(folder)
    dist.barrier()


def load_checkpoint(model, optimizer, folder) -> None:
    """The model and optimizer state of ``save_checkpoint``'s ``folder``, each process reading its own shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


# The largest differences from the unsplit model that count as equal: float32 rounding of the same sums split over
# processes (the gradients relative to the largest of them; the parameters after one step, absolute)
TOLERANCES = {"grad_rel_diff": 1e-5, "param_max_diff": 1e-6}


def summarize(cfg: Config, mode: str, config, world_size: int, reports: list, runtime: float) -> dict:
    """summary.json: the one-step check, the collectives against the plan's count, what each process holds, the
    training losses."""
    first = reports[0]
    tied = config.tie_word_embeddings
    return {
        "workflow": "tensor_parallel", "mode": mode, "preset": cfg.preset, "world_size": world_size,
        "world_sizes_seen": [r["world_size_seen"] for r in reports], "backend": process_group_backend(),
        "global_batch_size": cfg.global_batch_size, "max_length": cfg.max_length,
        "steps": cfg.max_steps, "learning_rate": cfg.learning_rate, "layers": config.num_hidden_layers,
        "tied_embeddings": tied,
        "loss": first["loss"], "reference_loss": first["reference_loss"],
        "grad_rel_diff": max(r["grad_rel_diff"] for r in reports),
        "param_max_diff": max(r["param_max_diff"] for r in reports),
        "tolerances": TOLERANCES,
        "collectives": first["collectives"],
        "collectives_expected": expected_collectives(config.num_hidden_layers, cfg.sequence_parallel, tied),
        "total_parameters": first["parameters"]["whole"] + first["parameters"]["split"],
        "parameters_local": [r["parameters"]["local"] for r in reports],
        "parameters_formula": first["parameters"]["formula"],
        "parameters_whole": first["parameters"]["whole_names"],
        "layer0_shapes": first["parameters"]["layer0_shapes"],
        "full_shapes": {"q_proj": [config.num_attention_heads * config.head_dim, config.hidden_size],
                        "k_proj": [config.num_key_value_heads * config.head_dim, config.hidden_size],
                        "o_proj": [config.hidden_size, config.num_attention_heads * config.head_dim],
                        "gate_proj": [config.intermediate_size, config.hidden_size],
                        "down_proj": [config.hidden_size, config.intermediate_size]},
        "saved_activation_bytes": [r["saved_activation_bytes"] for r in reports],
        "saved_activation_bytes_whole": first["saved_activation_bytes_whole"],
        # this process's steps: a resumed run's begin after its checkpoint
        "train_losses": first["losses"], "train_loss_first": first["losses"][0] if first["losses"] else None,
        "train_loss_final": first["losses"][-1] if first["losses"] else None, "runtime_s": runtime,
        "samples_per_s": len(first["losses"]) * cfg.global_batch_size / runtime if first["losses"] else None,
        # one more forward and backward, profiled: the share of it each process spent waiting for collectives
        "collective_wait_share": [r["collective_wait"]["share"] for r in reports],
        "memory": [r["memory"] for r in reports],
        "peak_memory_bytes": max(peak_bytes(r["memory"]["end"]) for r in reports),
    }


parse_args, main = command_line(Config, train, __name__, DESCRIPTION)
