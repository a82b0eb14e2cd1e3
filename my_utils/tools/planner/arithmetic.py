"""The plan: one process's peak tensor memory, part by part, for a method, a batch, a compute dtype and a ZeRO
stage (the rules are in the package's docstring)."""

from __future__ import annotations

from dataclasses import dataclass

from my_utils.core.chunked_loss import CHUNK_BYTES
from my_utils.tools.planner.activations import RESIDUAL_BYTES, layer_activations, norm_bytes
from my_utils.tools.planner.layout import (Architecture, in_block, lora_modules, lora_parameters,
                                           per_block, role_of)

METHODS = ("full", "lora", "qlora")
DTYPES = {"fp32": 4, "bf16": 2}
NF4_CONSTANTS = 1 / 64 + 4 / (64 * 256)  # per weight: an 8-bit absmax per 64 weights + an fp32 one per 256 blocks
NF4_BYTES = 0.5 + NF4_CONSTANTS  # and the 4 bits
NF4_LAYER_BYTES = 4 * (16 + 256)  # each 4-bit layer's code tables (fp32): NF4's 16 values, double quantization's 256
ADAMW_STATE_BYTES = 8  # exp_avg and exp_avg_sq, fp32
TRAINABLE_BYTES = 4  # trainable parameters and their gradients are fp32 (LoRA adapters, full-FT master weights)


@dataclass
class Plan:
    preset: str
    method: str  # full, lora, qlora-4bit, qlora-8bit
    dtype: str
    rank: int | None
    batch: int  # per process
    seq: int
    processes: int
    gradient_checkpointing: bool
    chunked_loss: bool
    total_params: int
    trainable_params: int
    weights: float
    gradients: float  # the .grad tensors
    optimizer: float
    saved_activations: float  # what autograd keeps from the forward pass for backward
    backward_extra: float  # what backward adds while the saved activations are still held
    ddp_buckets: float = 0.0  # DDP's flat copy of the gradients, with several processes
    zero: int = 0  # ZeRO stage: what the processes shard (see the module's docstring)
    gathered: float = 0.0  # whole weights gathered for compute under ZeRO-2 and 3
    overhead: float = 0.0  # CUDA context, or the CPU process's baseline
    overhead_what: str = ""
    saved_in_blocks: float = 0.0  # the part of saved_activations that the transformer blocks keep
    tp: int = 1  # tensor-parallel processes per replica (model_parallel.py)
    sequence_parallel: bool = False
    pp: int = 1  # pipeline stages per replica
    stage: int = 0  # the pipeline stage planned: the busiest
    microbatches: int = 1
    schedule: str = ""
    in_flight: int = 1  # micro-batches the stage holds between their forward and their backward

    @property
    def activations(self) -> float:
        """Activation memory at the peak: the saved activations and backward's transient."""
        return self.saved_activations + self.backward_extra

    @property
    def peak(self) -> float:
        return (self.weights + self.gathered + self.gradients + self.ddp_buckets + self.optimizer + self.activations
                + self.overhead)

    def parts(self) -> list[tuple[str, float, str]]:
        """(part, bytes, how it was computed) for each row of the plan."""
        shard = f", / {self.processes} (ZeRO-{self.zero})" if self.zero else ""
        split = "".join([", this process's share" if self.tp > 1 or self.pp > 1 else "",
                         f", tensor parallel over {self.tp}" if self.tp > 1 else "",
                         f", stage {self.stage} of {self.pp}" if self.pp > 1 else ""])
        kept_whole = ", the 4-bit constants whole" if self.method == "qlora-4bit" else ""
        rows = [("weights", self.weights, f"{self.total_params:,} parameters" + split
                 + (shard + kept_whole if self.zero >= 2 else ""))]
        if self.gathered:
            rows.append(("gathered weights", self.gathered, "every weight, whole, from forward to backward"
                         if self.zero == 2 else "the root unit and one block, whole"))
        rows.append(("gradients", self.gradients, f"{self.trainable_params:,} trainable x 4 B"
                     + (shard if self.zero >= 2 else "")))
        if self.ddp_buckets:
            rows.append(("DDP gradient buckets", self.ddp_buckets, "a flat copy of the gradients, to all-reduce"))
        rows += [
            ("optimizer states", self.optimizer, f"AdamW: {self.trainable_params:,} x 2 x 4 B" + shard),
            ("saved activations", self.saved_activations, (
                f"micro-batch {self.batch // self.microbatches} x seq {self.seq}, {self.in_flight} of "
                f"{self.microbatches} in flight ({self.schedule})" if self.pp > 1 else f"batch {self.batch} x seq {self.seq}")
             + (f", inside attention and the MLP / {self.tp}" if self.tp > 1 else "")
             + (", norms / tp (sequence parallel)" if self.sequence_parallel else "")
             + (", bf16 autocast (with weight copies)" if self.dtype == "bf16" else "")
             + (", checkpointed" if self.gradient_checkpointing else "")),
            ("backward transient", self.backward_extra, self._transient() if self.backward_extra else ""),
        ]
        if self.overhead:
            rows.append(("runtime", self.overhead, self.overhead_what))
        return rows

    def _transient(self) -> str:
        if self.chunked_loss:
            return "the larger of one recomputed layer and one chunk of the loss's logits" \
                if self.gradient_checkpointing else "one chunk of the loss's logits (the chunked loss makes its gradients in forward)"
        return "loss gradients over the vocabulary" + (", one recomputed layer" if self.gradient_checkpointing else "")


ZERO_STAGES = (0, 1, 2, 3)


def nf4_constants(arch: Architecture) -> float:
    """The bytes of a 4-bit model's quantization constants: the absmax values and each layer's code tables."""
    quantized = sum(arch.linears[n][0] * arch.linears[n][1] for n in arch.quantizable)
    return quantized * NF4_CONSTANTS + NF4_LAYER_BYTES * len(arch.quantizable)


def shard(plan: Plan, arch: Architecture, zero: int) -> Plan:
    """``plan`` (plain DDP) with ZeRO stage ``zero`` over its processes (see the module's docstring). Over a 4-bit
    base (QLoRA) FSDP2 shards the packed weights (half a byte each); their quantization constants, which
    bitsandbytes keeps on each module outside the parameters, stay whole in every process."""
    from dataclasses import replace

    if not zero:
        return plan
    n = plan.processes
    if zero == 1:
        return replace(plan, zero=1, optimizer=plan.optimizer / n)
    # FSDP2: no DDP buckets; the weights stored as shards and gathered whole for compute
    packed = frozenset(arch.quantizable) if plan.method == "qlora-4bit" else frozenset()
    constants = nf4_constants(arch) if packed else 0.0
    whole = plan.weights - constants
    block = sum(i * o * (0.5 if name in packed else 4) + (4 * o if bias else 0)
                for name, (i, o, bias) in arch.linears.items() if in_block(name))
    block /= arch.layers
    root = max(whole - block * arch.layers, 0.0)
    return replace(plan, zero=zero, weights=whole / n + constants, gradients=plan.gradients / n,
                   optimizer=plan.optimizer / n, ddp_buckets=0.0, gathered=whole if zero == 2 else root + block)


def estimate(arch: Architecture, method: str, *, quantize: str = "none", rank: int = 8, targets=(), batch: int,
             seq: int, processes: int = 1, dtype: str = "fp32", gradient_checkpointing: bool = False,
             device: str = "cuda", zero: int = 0, chunked_loss: bool = True) -> Plan:
    """The plan for an architecture (``plan`` fills in a preset's defaults and checks the arguments)."""
    dtype_bytes = DTYPES[dtype]
    in_blocks = [n for n in arch.linears if in_block(n)]
    if method == "full":
        lora = 0
        trainable = arch.total_params
        kept = per_block(arch, in_blocks)
    else:
        lora = lora_parameters(arch, rank, targets)
        trainable = lora + arch.head_params
        kept = per_block(arch, lora_modules(arch, targets))
    quantized_parts = per_block(arch, [n for n in in_blocks if n in arch.quantizable]) if quantize != "none" else {}
    held = quantized_parts if quantize == "8bit" else {}
    total = arch.total_params + (trainable if method != "full" else 0)  # + adapters, head copy
    autocast = dtype_bytes < RESIDUAL_BYTES

    # weights
    if quantize == "none":
        weights = total * 4  # the base model and the adapters in fp32
    else:
        quantized = sum(arch.linears[n][0] * arch.linears[n][1] for n in arch.quantizable)
        rows = sum(arch.linears[n][1] for n in arch.quantizable)
        stored = quantized / 2 + nf4_constants(arch) if quantize == "4bit" else quantized + 4 * rows
        weights = stored + (arch.total_params - quantized) * 4 + trainable * TRAINABLE_BYTES
    gradients = trainable * TRAINABLE_BYTES
    optimizer = trainable * ADAMW_STATE_BYTES

    # Autocast multiplies bf16 copies of the weights, and a product whose input needs a gradient keeps its copy
    # for backward (bitsandbytes dequantizes inside its own function and keeps nothing).
    copies = {True: 0, False: 0}  # elements, in the blocks and outside them
    first_block_copies = 0  # of them, the first block's query/key/value projections (see below)
    if autocast:
        for n, (d_in, d_out, _) in arch.linears.items():
            if n == arch.output_layer and chunked_loss:
                continue  # the chunked loss casts the output layer's weight inside its function, keeping no copy
            if n not in arch.quantizable or quantize == "none":
                copies[in_block(n)] += d_in * d_out
                first_block_copies += d_in * d_out / arch.layers if in_block(n) and role_of(n) == "qkv" else 0
        copies[True] += lora

    # saved activations: the layers, then the embeddings and the head
    tokens = batch * seq
    one_layer = layer_activations(arch, batch, seq, dtype_bytes, kept, held=held, device=device,
                                  rank=rank if method != "full" else 0, norms_train=method == "full",
                                  quantized_up=bool(quantized_parts.get("up"))) \
        + copies[True] * dtype_bytes / arch.layers
    if gradient_checkpointing:
        layers = arch.layers * tokens * arch.hidden * RESIDUAL_BYTES  # each layer's input; backward recomputes
    else:
        layers = arch.layers * one_layer
        if method != "full" and kept.get("qkv"):
            # Adapters leave the embeddings frozen: the first block's input needs no gradient, so until its first
            # adapters (on the attention's input projections) nothing keeps anything: not the first norm (of a
            # pre-LN block), not the frozen projections' bf16 weight copies, not a quantized layer's input.
            # (Adapters that start later in the block leave more of the first block unkept: there the plan errs
            # high, by less than one block.)
            held_input = tokens * arch.hidden * RESIDUAL_BYTES if autocast and held.get("qkv") else 0
            layers -= (norm_bytes(arch, tokens, False) * arch.norm_first + first_block_copies * dtype_bytes
                       + held_input)
    # the inputs of the norms outside the blocks, the embedding dropout's mask, the weight copies outside
    mask_bytes = RESIDUAL_BYTES if device == "cpu" else 1
    edges = (arch.extra_norms * norm_bytes(arch, tokens, method == "full")
             + tokens * arch.hidden * arch.embedding_dropout * mask_bytes + copies[False] * dtype_bytes)
    backward_extra = one_layer if gradient_checkpointing else 0
    if arch.role == "causal" and chunked_loss:
        # my_utils.core.chunked_loss keeps, from forward to backward, the gradients it computed: the hidden
        # states' (fp32) and, where the output layer trains, its weight's; the logits exist one chunk at a time
        # (fp32, the log-sum-exp's temporary, and under autocast the product's bf16), every activation still held.
        edges += tokens * arch.hidden * 4 + (arch.vocab * arch.hidden * 4 if method == "full" else 0)
        rows = min(tokens, max(1, CHUNK_BYTES // (4 * arch.vocab)))
        backward_extra = max(backward_extra, rows * arch.vocab * (2 * 4 + (dtype_bytes if autocast else 0)))
    elif arch.role == "causal":
        edges += tokens * arch.vocab * 4  # the loss keeps fp32 log-probabilities
        # Backward starts by making their gradient and the logits' gradient (fp32, then cast to the compute
        # dtype) while every saved activation is still held.
        backward_extra += tokens * arch.vocab * (2 * 4 + (dtype_bytes if autocast else 0))
        if method == "full":
            edges += tokens * arch.hidden * dtype_bytes  # the input of the (trainable) output layer
    return shard(Plan(preset=arch.name, method=method if method != "qlora" else f"qlora-{quantize}", dtype=dtype,
                      rank=rank if method != "full" else None, batch=batch, seq=seq, processes=processes,
                      gradient_checkpointing=gradient_checkpointing,
                      chunked_loss=chunked_loss and arch.role == "causal", total_params=total, trainable_params=trainable,
                      weights=weights, gradients=gradients, optimizer=optimizer, saved_activations=layers + edges,
                      saved_in_blocks=layers,
                      backward_extra=backward_extra, ddp_buckets=gradients if processes > 1 else 0), arch, zero)
