"""The model itself split: tensor parallel and pipeline parallel in the plan, alone or with data parallel.

Tensor parallel (``tp`` processes) is Megatron's plan as lesson 09 trains it (``my_utils.workflows.tensor_parallel``):
every projection in the blocks is split ``tp`` ways (queries, keys, values, gate and up by output feature, the
attention output and down projections by input feature, their biases kept whole), and so are the heads and the MLP's
inner width, with every activation inside attention and the MLP. An untied embedding and output layer are split by
vocabulary; a tied one stays whole, as the workflow keeps it. What stays whole on every process: the norms, the
residual stream (the norms' inputs, the inputs of the query/key/value and up projections, the dropout masks) and the
logits, which are gathered for the loss (the plain loss over the whole vocabulary). Sequence parallel splits the
residual stream's norms and masks by position as well; the projections still take their input gathered whole.

Pipeline parallel (``pp`` stages) gives each process a run of consecutive blocks (the first stage also the
embeddings, the last the final norm and the output layer: its own copy when the embeddings are tied, as
``my_utils.workflows.pipeline_parallel`` unties them) and splits each batch into ``microbatches``. A stage keeps the
activations of each micro-batch from its forward to its backward: GPipe runs every forward first (all M in flight on
every stage), 1F1B starts a backward as soon as one can, so stage s holds S - s of them (at most M). Lesson 08 reads
both counts from the stages' timelines. The plan is the busiest stage's.
"""

from __future__ import annotations

from dataclasses import replace

from my_utils import UserError
from my_utils.tools.planner.activations import norm_bytes, residual_masks
from my_utils.tools.planner.arithmetic import ADAMW_STATE_BYTES, DTYPES, TRAINABLE_BYTES, Plan, estimate, shard
from my_utils.tools.planner.layout import Architecture, in_block, lora_parameters, role_of
from my_utils.core.pipeline import in_flight

def check_split(method: str, *, tp: int, pp: int, quantize: str, zero: int, gradient_checkpointing: bool) -> None:
    """One sentence for a split the planner does not model (those the model does not allow are the workflows'
    refusals: ``my_utils.core.splits``)."""
    if tp > 1 and method != "full":
        raise UserError("The planner models tensor parallel for full fine-tuning, as lesson 09 trains it; plan "
                        "LoRA with --pp or data parallel.")
    if pp > 1 and zero > 1:
        raise UserError("The planner models ZeRO-1 with pipeline parallel, as DeepSpeed runs them together; use "
                        "--zero 1 or 0.")
    if (tp > 1 or pp > 1) and (quantize != "none" or gradient_checkpointing):
        raise UserError("The planner does not model quantized weights or gradient checkpointing with --tp or --pp; "
                        "plan them without.")


def _linear_params(shape) -> int:
    d_in, d_out, bias = shape
    return d_in * d_out + (d_out if bias else 0)


def tensor_shard(arch: Architecture, tp: int) -> Architecture:
    """What one of ``tp`` processes holds of ``arch`` under Megatron's plan: a model of its own, with the heads, the
    MLP's inner width and the split layers divided (the vocabulary it gathers stays whole)."""
    if tp == 1:
        return arch
    linears, removed = {}, 0
    for name, (d_in, d_out, bias) in arch.linears.items():
        part = role_of(name) if in_block(name) else "vocab" if name == arch.output_layer else None
        if part in ("qkv", "up") or (part == "vocab" and not arch.tied_embeddings):
            shard = (d_in, d_out // tp, bias)  # column-parallel: its output features, and their biases
        elif part in ("out", "down"):
            shard = (d_in // tp, d_out, bias)  # row-parallel: its input features; the bias is added once, whole
        else:
            shard = (d_in, d_out, bias)
        linears[name] = shard
        removed += _linear_params((d_in, d_out, bias)) - _linear_params(shard)
    if not arch.tied_embeddings and arch.output_layer:  # the input embedding, split by vocabulary like the output
        removed += arch.vocab * arch.hidden - arch.vocab * arch.hidden // tp
    return replace(arch, heads=arch.heads // tp, kv_heads=arch.kv_heads // tp,
                   attention_width=arch.attention_width // tp, intermediate=arch.intermediate // tp,
                   linears=linears, total_params=arch.total_params - removed)


def sequence_parallel_saving(arch: Architecture, tokens: int, tp: int, trains_norms: bool, act_bytes: int,
                             device: str) -> tuple[float, float]:
    """What sequence parallel takes off one process's saved activations, (in the blocks, outside them): all but
    1/tp of every norm's tensors (two per block, and those outside the blocks) and of the residual dropout masks."""
    kept = 1 - 1 / tp
    masks = residual_masks(arch, tokens, act_bytes, device)
    return (arch.layers * (2 * norm_bytes(arch, tokens, trains_norms) + masks) * kept,
            arch.extra_norms * norm_bytes(arch, tokens, trains_norms) * kept)


def stage_layers(layers: int, stages: int, stage: int) -> int:
    """Blocks of stage ``stage`` (0 first): an even split, the first stages taking one more when it is not even."""
    return layers // stages + (stage < layers % stages)


def _block_params(arch: Architecture) -> float:
    """Parameters of one transformer block: its linear layers and its norms."""
    linears = sum(_linear_params(shape) for name, shape in arch.linears.items() if in_block(name))
    norms = sum(count for name, count in arch.norm_params.items() if in_block(name))
    return (linears + norms) / arch.layers


def pipeline_stage(micro: Plan, arch: Architecture, *, stages: int, stage: int, schedule: str, microbatches: int,
                   method: str, rank: int, targets) -> Plan:
    """Stage ``stage``'s share of ``micro``, the whole model's plan for one micro-batch (and ``arch`` what each
    process holds of the model's width: ``tensor_shard``)."""
    first, last = stage == 0, stage == stages - 1
    blocks = stage_layers(arch.layers, stages, stage)
    per_block = _block_params(arch)
    output = _linear_params(arch.linears[arch.output_layer]) if arch.output_layer else 0
    final_norms = sum(count for name, count in arch.norm_params.items() if not in_block(name))
    # the embeddings: whatever is outside the blocks but the final norm and an untied output layer
    embeddings = arch.total_params - arch.layers * per_block - final_norms - (0 if arch.tied_embeddings else output)
    params = blocks * per_block + first * embeddings + last * (final_norms + output)
    adapters = 0 if method == "full" else lora_parameters(arch, rank, targets) * blocks / arch.layers
    trainable = params if method == "full" else adapters + (arch.head_params if last else 0)
    held = in_flight(schedule, stages, microbatches, stage)
    edges = micro.saved_activations - micro.saved_in_blocks
    saved = held * (micro.saved_in_blocks * blocks / arch.layers + (edges if last else 0))
    return replace(micro, batch=micro.batch * microbatches, total_params=round(params + adapters),
                   trainable_params=round(trainable), weights=4 * (params + adapters),
                   gradients=trainable * TRAINABLE_BYTES, optimizer=trainable * ADAMW_STATE_BYTES,
                   saved_activations=saved, saved_in_blocks=held * micro.saved_in_blocks * blocks / arch.layers,
                   backward_extra=micro.backward_extra if last else 0.0,
                   ddp_buckets=trainable * TRAINABLE_BYTES if micro.processes > 1 else 0.0,
                   pp=stages, stage=stage, in_flight=held, microbatches=microbatches, schedule=schedule)


def split_estimate(arch: Architecture, method: str, *, tp: int = 1, pp: int = 1, microbatches: int = 1,
                   schedule: str = "1f1b", sequence_parallel: bool = False, quantize: str = "none", rank: int = 8,
                   targets=(), batch: int, seq: int, processes: int = 1, dtype: str = "fp32",
                   gradient_checkpointing: bool = False, device: str = "cuda", zero: int = 0,
                   chunked_loss: bool = True, stage: int | None = None) -> Plan:
    """The plan of one process when ``processes`` data-parallel replicas each split the model over ``tp`` x ``pp``
    processes (``batch`` per replica): pipeline stage ``stage``'s (default: the busiest), each of its
    tensor-parallel processes alike."""
    held = tensor_shard(arch, tp)
    settings = dict(quantize=quantize, rank=rank, targets=targets, seq=seq, processes=processes, dtype=dtype,
                    gradient_checkpointing=gradient_checkpointing, device=device,
                    chunked_loss=chunked_loss and tp == 1)  # tensor parallel gathers the logits for the plain loss
    micro = estimate(held, method, batch=batch // microbatches if pp > 1 else batch, **settings)
    if tp > 1 and sequence_parallel:
        in_blocks, outside = sequence_parallel_saving(arch, micro.batch * seq, tp, method == "full",
                                                     DTYPES[dtype], device)
        micro = replace(micro, saved_activations=micro.saved_activations - in_blocks - outside,
                        saved_in_blocks=micro.saved_in_blocks - in_blocks)
    micro = replace(micro, tp=tp, sequence_parallel=sequence_parallel and tp > 1)
    if pp == 1:
        return shard(micro, held, zero)
    stages = [pipeline_stage(micro, held, stages=pp, stage=s, schedule=schedule, microbatches=microbatches,
                             method=method, rank=rank, targets=targets) for s in range(pp)]
    planned = max(stages, key=lambda p: p.peak) if stage is None else stages[stage]
    return replace(planned, zero=zero, optimizer=planned.optimizer / processes) if zero else planned
