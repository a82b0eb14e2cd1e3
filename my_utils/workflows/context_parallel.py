"""Context parallel: causal attention over a sequence split by position, as a ring of processes (ring attention).

    # a shell, 2 processes on a CPU (gloo): each holds half of every sequence's queries, keys and values
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m my_utils.workflows.context_parallel --seq-len 512

Sequence parallel (``tensor_parallel --sequence-parallel``) splits the work between the attention blocks by position
but gathers the whole sequence for attention itself. Context parallel splits attention too: process r holds the
r-th block of positions of the queries, keys and values. Attention needs every earlier key, so the key/value blocks
travel around a ring: at each of N steps a process attends its queries to the block it holds, then passes that block
on and receives the previous process's. Blocks are merged exactly with their log-sum-exp (as flash attention merges
tiles), so nothing of size sequence x sequence is ever held. Causal masking skips every block from later positions:
process r computes r + 1 blocks, so the last process works most (real implementations cut the sequence in 2N chunks
and give each process one early and one late chunk to even that out). Backward runs the same ring and sends each
key/value block's gradient home with it. Written in plain torch after picotron's; torch's own context-parallel API
and accelerate's ``cp_size`` need GPU attention kernels (flash or cuDNN SDPA), so they do not run on a CPU.

The run checks the output and the gradients of queries, keys and values against ``scaled_dot_product_attention`` on
the whole sequence, and counts the bytes each process sends against the ring's arithmetic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from my_utils import UserError
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.printing import get_world_size, print0, rank_print
from my_utils.core.stats import check_tolerances
from my_utils.run.cli import command_line
from my_utils.run.config import RunSettings, check_positive, setting
from my_utils.run.lifecycle import join_world, process_group_backend, run_lifecycle

MAX_CHECK_BYTES = 4 * 2**30  # a laptop's share for the reference attention the ring is checked against


DESCRIPTION = ("Context parallel: causal ring attention over a sequence split by position, checked against whole-"
               "sequence attention (output and gradients). Needs 2+ processes: torchrun --nproc_per_node 2 -m "
               "my_utils.workflows.context_parallel ..., or (on a CPU) ACCELERATE_USE_CPU=1 accelerate launch "
               "--config_file configs/cpu_x2.yaml -m ...")


@dataclass
class Config(RunSettings):
    seq_len: int = setting(512, "positions per sequence, split into one block per process")
    global_batch_size: int = setting(2, "sequences")
    heads: int = setting(4, "attention heads")
    head_dim: int = setting(32, "features per head")


def validate(cfg: Config) -> None:
    """Check the config before any process group starts."""
    cfg.check_common()
    for name in ("seq_len", "global_batch_size", "heads", "head_dim"):
        check_positive(f"--{name.replace('_', '-')}", getattr(cfg, name))
    # the whole-attention check's float32 scores, at most
    scores = cfg.global_batch_size * cfg.heads * cfg.seq_len**2 * 4
    if scores > MAX_CHECK_BYTES:
        raise UserError(f"The check against whole attention could hold {scores / 2**30:.0f} GiB of scores at --seq-len "
                        f"{cfg.seq_len}; lower --seq-len, --global-batch-size or --heads.")
    world_size = cfg.num_processes or get_world_size()
    if cfg.seq_len % world_size:
        raise UserError(f"--seq-len {cfg.seq_len} does not split into {world_size} equal blocks; make it a "
                        f"multiple of {world_size}.")


class Ring:
    """Passes tensors one process on around the ring (to rank + 1, from rank - 1) and counts the bytes sent."""

    def __init__(self):
        import torch.distributed as dist

        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.bytes_sent = 0

    def pass_on(self, *tensors):
        import torch
        import torch.distributed as dist

        received = [torch.empty_like(t) for t in tensors]
        ops = []
        for t, r in zip(tensors, received):
            ops += [dist.P2POp(dist.isend, t.contiguous(), (self.rank + 1) % self.size),
                    dist.P2POp(dist.irecv, r, (self.rank - 1) % self.size)]
            self.bytes_sent += t.numel() * t.element_size()
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return received


# region: ring attention
def block_scores(q, k, diagonal: bool):
    """Scaled scores of queries ``q`` against keys ``k``; on the diagonal block, future positions masked."""
    import torch

    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if diagonal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def ring_forward(q, k, v, ring: Ring):
    """This process's attention output and log-sum-exp, merging one key/value block per ring step."""
    import torch

    out, lse = torch.zeros_like(q), torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype, device=q.device)
    for step in range(ring.size):
        source = (ring.rank - step) % ring.size  # whose block this process holds now
        if source <= ring.rank:  # blocks from later positions are all masked: skipped
            scores = block_scores(q, k, diagonal=source == ring.rank)
            block_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
            new_lse = torch.logaddexp(lse, block_lse)
            out = out * torch.exp(lse - new_lse) + torch.exp(scores - new_lse) @ v
            lse = new_lse
        if step < ring.size - 1:
            k, v = ring.pass_on(k, v)
    return out, lse


def ring_backward(dout, q, k, v, out, lse, ring: Ring):
    """Gradients of q, k, v: each key/value block travels with its gradient, which arrives home after N passes."""
    import torch

    delta = (dout * out).sum(dim=-1, keepdim=True)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for step in range(ring.size):
        source = (ring.rank - step) % ring.size
        if source <= ring.rank:
            p = torch.exp(block_scores(q, k, diagonal=source == ring.rank) - lse)  # the final probabilities
            dv += p.transpose(-1, -2) @ dout
            ds = p * (dout @ v.transpose(-1, -2) - delta)
            dq += ds @ k * q.shape[-1] ** -0.5
            dk += ds.transpose(-1, -2) @ q * q.shape[-1] ** -0.5
        if step < ring.size - 1:
            k, v, dk, dv = ring.pass_on(k, v, dk, dv)
        else:
            dk, dv = ring.pass_on(dk, dv)  # the last pass brings each block's gradient home
    return dq, dk, dv
# endregion


def ring_attention(ring: Ring):
    """Causal ring attention as an autograd function of this process's (q, k, v) blocks."""
    import torch

    class RingAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = ring_forward(q, k, v, ring)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            return ring_backward(dout, *ctx.saved_tensors, ring)

    return RingAttention.apply


# The largest difference from whole attention that counts as equal: float32 rounding of the same sums in another
# order (the reference runs differ by at most 4e-6)
TOLERANCES = {"max_abs_diff": 1e-5}


def ring_bytes(cfg: Config, world_size: int, element_size: int = 4) -> dict:
    """Bytes each process sends per step, by arithmetic: forward passes K and V on N - 1 times; backward passes K, V
    on N - 1 times and their gradients N times."""
    block = cfg.global_batch_size * cfg.heads * (cfg.seq_len // world_size) * cfg.head_dim * element_size
    return {"forward": 2 * (world_size - 1) * block, "backward": 2 * (world_size - 1) * block + 2 * world_size * block}


def check_against_full_attention(cfg: Config, ring: Ring) -> dict:
    """This process's block of the output and of the gradients, ring against whole-sequence attention."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(cfg.seed)  # the same whole tensors on every process
    shape = (cfg.global_batch_size, cfg.heads, cfg.seq_len, cfg.head_dim)
    q, k, v, grad = (torch.randn(shape) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=True)
    expected.backward(grad)
    mine = slice(ring.rank * (cfg.seq_len // ring.size), (ring.rank + 1) * (cfg.seq_len // ring.size))
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    attention = ring_attention(ring)
    started = time.perf_counter()
    out = attention(*local)
    forward_bytes, forward_s = ring.bytes_sent, time.perf_counter() - started
    out.backward(grad[:, :, mine])
    diffs = {"output": float((out.detach() - expected.detach()[:, :, mine]).abs().max())}
    for name, mine_t, whole_t in zip("qkv", local, whole):
        diffs[f"grad_{name}"] = float((mine_t.grad - whole_t.grad[:, :, mine]).abs().max())
    return {"max_abs_diff": diffs, "bytes_sent": {"forward": forward_bytes, "backward": ring.bytes_sent - forward_bytes},
            "blocks_computed": sum(1 for step in range(ring.size) if (ring.rank - step) % ring.size <= ring.rank),
            "forward_s": forward_s}


def train(cfg: Config) -> dict:
    """Run the ring-attention check on every process; returns the summary on every rank (rank 0 writes it)."""
    import torch.distributed as dist

    validate(cfg)
    world_size = join_world(cfg.num_processes, cfg.timeout_s)
    if world_size < 2:
        raise UserError("context_parallel splits each sequence over processes but this run has one; launch it with "
                        "torchrun --nproc_per_node 2 or accelerate launch --num_processes 2.")
    cfg = replace(cfg, num_processes=world_size)
    with run_lifecycle(cfg, world_size, default_dir=RUNS_ROOT / "context_parallel" / f"ring_x{world_size}",
                       workflow="context_parallel") as life:
        report = check_against_full_attention(cfg, Ring())
        rank_print(f"{report['blocks_computed']} of {world_size} blocks computed; largest difference from whole "
                   f"attention {max(report['max_abs_diff'].values()):.1e}")
        reports = life.gather({"process": dist.get_rank(), "world_size_seen": dist.get_world_size(), **report})
        summary = None
        if life.is_main:
            summary = {"workflow": "context_parallel", "world_size": world_size, "backend": process_group_backend(),
                       "world_sizes_seen": [r["world_size_seen"] for r in reports],
                       "seq_len": cfg.seq_len, "global_batch_size": cfg.global_batch_size, "heads": cfg.heads,
                       "head_dim": cfg.head_dim, "block_len": cfg.seq_len // world_size,
                       "max_abs_diff": {k: max(r["max_abs_diff"][k] for r in reports) for k in reports[0]["max_abs_diff"]},
                       "tolerances": TOLERANCES,
                       "bytes_sent": [r["bytes_sent"] for r in reports], "bytes_expected": ring_bytes(cfg, world_size),
                       "blocks_computed": [r["blocks_computed"] for r in reports],
                       "forward_s": [r["forward_s"] for r in reports]}
        life.finish(summary)
        print0(f"ring attention over {world_size} processes: largest difference from whole attention "
               f"{max(life.summary['max_abs_diff'].values()):.1e}")
    check_tolerances(life.summary, "Ring attention and whole attention")
    return life.summary


parse_args, main = command_line(Config, train, __name__, DESCRIPTION)
