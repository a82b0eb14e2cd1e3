"""2D parallel: data parallel x tensor parallel on a (dp, tp) device mesh, simulated in one process.

    # 4 ranks (2 data-parallel replicas of a model split over 2 tensor-parallel ranks), simulated in this process
    python -m my_utils.workflows.parallel_2d --dp 2 --tp 2
    python -m my_utils.workflows.parallel_2d --dp 2 --tp 2 --sequence-parallel

Large trainings compose kinds of parallelism on a mesh of devices: tensor parallel inside a machine (fast links,
a collective in every layer), data parallel across machines (one gradient sum per step). Rank (i, j) of a
(dp, tp) mesh holds the j-th slice of every split matrix (``tensor_parallel``'s Megatron plan, applied on the mesh's
``tp`` dimension) and sees the i-th share of the batch; after backward, the ranks of each ``dp`` group average their
gradients, as DDP would. A third dimension, pipeline parallel (``pipeline_parallel``), would give each (dp, tp) plane
some of the layers: 3D parallel.

The ranks are simulated with torch's ``LocalTensor``: one process holds every rank's shard of each tensor and runs
the collectives on them, so the mesh needs no more processes than this laptop has cores (4 real processes on 2
cores would work too, but slowly). The run checks that one step (forward, backward, gradient average, SGD step)
gives the loss, gradients and parameters of the unsplit model on the whole batch, counts the collectives of each
phase, and records each rank's mesh coordinates and shard shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from my_utils import UserError
from my_utils.core.data import token_blocks
from my_utils.core.models import load_tokenizer
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.printing import get_world_size, print0
from my_utils.core.splits import check_tensor_split, model_config
from my_utils.core.stats import check_tolerances
from my_utils.run.cli import command_line
from my_utils.run.config import RunSettings, check_positive, setting
from my_utils.run.lifecycle import run_lifecycle
from my_utils.workflows.tensor_parallel import build_model, whole

MAX_RANKS = 16  # simulated ranks cost this process memory and time in proportion


DESCRIPTION = ("2D parallel: data parallel x Megatron tensor parallel on a (dp, tp) mesh, its ranks simulated in one "
               "process with torch's LocalTensor; one step checked against the unsplit model.")


@dataclass
class Config(RunSettings):
    dp: int = setting(2, "data-parallel replicas (the mesh's first dimension)")
    tp: int = setting(2, "tensor-parallel ranks per replica (the mesh's second dimension)")
    sequence_parallel: bool = setting(False, "split the norms' work by position too, within each tp group")
    global_batch_size: int = setting(8, "sequences per step over all replicas, split evenly between them")
    max_length: int = setting(32, "tokens per sequence")
    learning_rate: float = setting(1e-3, "the rate of the checked SGD step")


def validate(cfg: Config):
    """Check the config before anything starts; returns the preset and the model's config."""
    preset = cfg.check_common()
    if get_world_size() > 1:  # WORLD_SIZE, set by torchrun and accelerate launch
        raise UserError("parallel_2d simulates its ranks in one process; run it with python -m, not a launcher.")
    for name in ("dp", "tp", "global_batch_size", "max_length"):
        check_positive(f"--{name.replace('_', '-')}", getattr(cfg, name))
    check_positive("--learning-rate", cfg.learning_rate, float)
    if cfg.dp * cfg.tp > MAX_RANKS:
        raise UserError(f"--dp {cfg.dp} x --tp {cfg.tp} is {cfg.dp * cfg.tp} simulated ranks, more than "
                        f"{MAX_RANKS}; choose a smaller mesh.")
    if cfg.global_batch_size % cfg.dp:
        raise UserError(f"--global-batch-size {cfg.global_batch_size} does not split over {cfg.dp} replicas; make it a "
                        "multiple of --dp.")
    config = model_config(preset)
    check_tensor_split(config, cfg.tp, cfg.sequence_parallel, cfg.max_length)
    return preset, config


def simulated_world(ranks: int):
    """A process group of ``ranks`` simulated ranks in this process (the "fake" backend: collectives on
    ``LocalTensor`` run inside the tensor, not over a network); closed by the caller."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend

    dist.init_process_group("fake", rank=0, world_size=ranks, store=dist.HashStore())


def own_copies(model) -> None:
    """Give every simulated rank its own copy of every parameter, as each real process builds its own model: one
    plain tensor would be shared by all ranks, and the whole parameters (the norms) would take every rank's
    optimizer step."""
    import torch
    from torch.distributed._local_tensor import local_tensor_mode

    mode, copies = local_tensor_mode(), {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in copies:  # a tied weight stays one parameter
                copies[id(p)] = torch.nn.Parameter(mode.rank_map(lambda rank: p.detach().clone()))
            setattr(module, name, copies[id(p)])


# region: data parallel x tensor parallel
def two_d_step(model, mesh, batch, learning_rate: float, sequence_parallel: bool) -> dict:
    """One training step on the (dp, tp) mesh: split on tp, each replica its share of the batch, gradients
    averaged over dp, one SGD step. Returns the loss per rank and the collectives of each phase."""
    import torch
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensor

    from my_utils.workflows.tensor_parallel import CountedCollectives, split

    own_copies(model)
    split(model, mesh["tp"], sequence_parallel)
    dp, tp = mesh.shape
    shares = batch.chunk(dp)
    mine = LocalTensor({rank: shares[rank // tp] for rank in range(dp * tp)})  # rank (i, j) = i * tp + j
    with CountedCollectives() as forward:
        loss = model(input_ids=mine, labels=mine).loss
    with CountedCollectives() as backward:
        loss.backward()
    with CountedCollectives() as average:
        for p in model.parameters():  # DDP's job, written out: the sum over the replicas, then / dp
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(grad, group=mesh.get_group("dp"))
            grad.div_(dp)
    torch.optim.SGD(model.parameters(), lr=learning_rate).step()
    return {"loss": loss, "collectives": {"forward": forward.counts, "backward": backward.counts,
                                          "gradient average": average.counts}}
# endregion


def per_rank(mode, value) -> list:
    """A simulated tensor's value on each rank, in rank order (a value that is no LocalTensor is every rank's)."""
    from torch.distributed._local_tensor import LocalTensor

    if not isinstance(value, LocalTensor):
        return [value] * len(mode.ranks)
    shards = {}
    mode.tensor_map(value, lambda rank, shard: shards.setdefault(rank, shard.detach().clone()))
    return [shards[rank] for rank in sorted(shards)]


def train(cfg: Config) -> dict:
    """Check one 2D step against the unsplit model; returns the summary."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    preset, config = validate(cfg)
    ranks = cfg.dp * cfg.tp
    batch = token_blocks(preset, load_tokenizer(preset), cfg.global_batch_size, cfg.max_length)
    with run_lifecycle(cfg, 1, default_dir=RUNS_ROOT / "parallel_2d" / f"dp{cfg.dp}_tp{cfg.tp}",
                       workflow="parallel_2d", simulated_ranks=ranks) as life:
        model = build_model(preset, config, cfg)
        reference = copy.deepcopy(model)
        reference_loss = reference(input_ids=batch, labels=batch).loss
        reference_loss.backward()
        reference_grads = [p.grad.clone() for p in reference.parameters()]
        torch.optim.SGD(reference.parameters(), lr=cfg.learning_rate).step()
        simulated_world(ranks)
        try:
            with LocalTensorMode(ranks) as mode:
                mesh = init_device_mesh("cpu", (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
                step = two_d_step(model, mesh, batch, cfg.learning_rate, cfg.sequence_parallel)
                with torch.no_grad():
                    grad_diff = max(max(per_rank(mode, (whole(p.grad) - g).abs().max()))
                                    for p, g in zip(model.parameters(), reference_grads))
                    param_diff = max(max(per_rank(mode, (whole(p) - q).abs().max()))
                                     for p, q in zip(model.parameters(), reference.parameters()))
                layer0 = {n.removeprefix("model.layers.0."): list(p.to_local().shape)
                          for n, p in model.named_parameters() if n.startswith("model.layers.0.") and p.dim() == 2}
                losses = [float(x) for x in per_rank(mode, step["loss"])]
                coordinates = {int(mesh.mesh[i, j]): [i, j] for i in range(cfg.dp) for j in range(cfg.tp)}
        finally:
            dist.destroy_process_group()
        summary = {
            "workflow": "parallel_2d", "simulated_ranks": ranks, "mesh": {"dp": cfg.dp, "tp": cfg.tp},
            "sequence_parallel": cfg.sequence_parallel, "global_batch_size": cfg.global_batch_size,
            "local_batch_size": cfg.global_batch_size // cfg.dp, "max_length": cfg.max_length,
            "coordinates": [coordinates[rank] for rank in range(ranks)], "losses_per_rank": losses,
            "loss_mean_over_replicas": sum(losses) / ranks, "reference_loss": reference_loss.item(),
            "grad_max_diff": float(grad_diff), "grad_scale": max(float(g.abs().max()) for g in reference_grads),
            "param_max_diff": float(param_diff), "collectives": step["collectives"],
            "parameters": len(reference_grads), "layer0_shapes": layer0,
        }
        # what counts as equal to the unsplit model: float32 rounding of the same sums split over the mesh (the
        # gradients within 1e-5 of the largest of them, the parameters after one step within 1e-6)
        summary["tolerances"] = {"grad_max_diff": 1e-5 * summary["grad_scale"], "param_max_diff": 1e-6}
        life.finish(summary)
        print0(f"dp {cfg.dp} x tp {cfg.tp}: mean loss over replicas {summary['loss_mean_over_replicas']:.6f}, "
               f"unsplit model {summary['reference_loss']:.6f}; gradients within {grad_diff:.1e}")
    check_tolerances(life.summary, "The mesh's model and the unsplit model")
    return life.summary


parse_args, main = command_line(Config, train, __name__, DESCRIPTION)
