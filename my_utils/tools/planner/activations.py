"""What autograd keeps for backward, per transformer layer: the activation model the plan is built on."""

from __future__ import annotations

from my_utils.tools.planner.layout import ACTIVATIONS, Architecture

# Autocast leaves the residual stream in fp32 (an fp32 tensor plus a bf16 one is fp32) and runs layer norms in fp32:
# the norms' inputs and outputs stay 4 bytes whatever the compute dtype.
RESIDUAL_BYTES = 4
GATED_MLP_BYTES = 2  # the factors of act(gate(x)) * up(x), both kept for the product's backward


def norm_bytes(arch: Architecture, tokens: int, trains: bool) -> float:
    """Bytes one norm keeps for backward: its fp32 input and, per token, its statistics (LayerNorm's kernel: the
    mean and 1/std; RMSNorm: 1/rms). An RMSNorm is written in Python (``weight * (x * rsqrt(mean(x^2) + eps))``),
    so when its weight trains the product keeps the normalised input too, a tensor of its own."""
    stats = 1 if arch.norm == "rms" else 2
    own = tokens * (arch.hidden * RESIDUAL_BYTES + stats * 4)
    return own + (tokens * arch.hidden * RESIDUAL_BYTES if arch.norm == "rms" and trains else 0)


def residual_masks(arch: Architecture, tokens: int, act_bytes: int, device: str) -> float:
    """Bytes of one layer's two residual dropout masks (none without dropout): a CPU dropout keeps its mask as a full
    tensor of the activation dtype, CUDA one byte per element."""
    return 2 * tokens * arch.hidden * (act_bytes if device == "cpu" else 1) if arch.dropout else 0


def layer_activations(arch: Architecture, batch: int, seq: int, act_bytes: int, kept: dict[str, float], *,
                      held: dict[str, float] | None = None, device: str = "cuda", rank: int = 0,
                      norms_train: bool = False, quantized_up: bool = False) -> float:
    """Bytes autograd keeps for one transformer layer until the backward pass, computing in ``act_bytes``
    (2: bf16 autocast over fp32 weights, see ``RESIDUAL_BYTES``).

    ``kept`` counts, per part ('qkv', 'out', 'up', 'down') and per block, the layers whose input is saved because
    their weight trains (full fine-tuning) or carries an adapter (LoRA); a frozen layer keeps nothing of its
    input. ``held`` counts the quantized layers that keep their input as they got it (bitsandbytes' 8-bit
    matmul keeps it for the input's gradient). A quantized layer returns its input's dtype, not autocast's:
    with the MLP's first projections quantized (``quantized_up``) the activation function's tensors and the down
    projection's input stay fp32, as the norm's output they read is. The 'qkv' and 'up' layers read a norm's fp32 output: under
    autocast each of them keeps its own bf16 copy; so does every LoRA adapter (``rank`` > 0) under autocast, as
    peft casts its input to the adapter's fp32 dtype and autocast casts it back; otherwise, and for the other
    parts, the layers reading one tensor share it. ``norms_train`` (full fine-tuning) adds what a norm keeps for
    its weight's gradient (``norm_bytes``).
    The MLP keeps its activation's tensors (``ACTIVATIONS``); a gated one (SwiGLU) also both factors of
    act(gate) x up, and its down projection reads their product. Attention keeps queries, keys and values at the
    queries' width: with grouped-query attention transformers repeats the keys and values to every query head
    before the kernel whenever a padding mask is passed (as with a padded batch; an unpadded one lets the kernel
    share them, and keeps less).
    Two things depend on the ``device``: a fused attention kernel keeps only its inputs, output and one number
    per head and query, but on a CPU none takes attention dropout, so the plain path keeps three (batch x heads
    x seq x seq) matrices (weights, dropout mask, dropped weights), in float32 even under autocast, as are its
    queries, keys and values; and a CPU dropout keeps its mask as a full tensor of the activation dtype where CUDA
    keeps one byte per element.
    """
    held = held or {}
    tokens = batch * seq
    th, tf, tq = tokens * arch.hidden, tokens * arch.intermediate, tokens * arch.attention_width
    saved, relu_like = ACTIVATIONS[arch.activation]
    if arch.gated_mlp:
        saved, relu_like = saved + GATED_MLP_BYTES, False
    fused = device != "cpu" or not arch.attention_dropout
    autocast = act_bytes < RESIDUAL_BYTES

    # The plain path on a CPU computes attention in float32 even under autocast (torch upcasts its inputs).
    attention_bytes = act_bytes if fused else RESIDUAL_BYTES
    mlp_bytes = RESIDUAL_BYTES if autocast and quantized_up else act_bytes
    input_bytes = {"qkv": RESIDUAL_BYTES, "up": RESIDUAL_BYTES, "out": attention_bytes, "down": mlp_bytes}

    def inputs(part: str, size: int, already_kept: bool = False) -> float:
        n, n_held = kept.get(part, 0), held.get(part, 0)
        if autocast and (part in ("qkv", "up") or rank):  # each adapted layer keeps its own compute-dtype copy
            return n * size * act_bytes + (size * input_bytes[part] if n_held and not already_kept else 0)
        return size * act_bytes if (n or n_held) and not already_kept else 0

    own = (
        2 * norm_bytes(arch, tokens, norms_train)  # what the two norms keep
        + 3 * tq * attention_bytes  # queries, keys and values (the fused kernel keeps them, or views of the fused
        # projection)
        + act_bytes * (
            tq * fused  # the attention output, kept by a fused kernel (otherwise by its projection, if it trains)
            + tokens * rank * sum(kept.values())  # LoRA keeps each adapter's A x input for B's gradient
        )
        + mlp_bytes * saved * tf  # the activation function's own tensors (and a gated MLP's two factors)
    )
    projections = (inputs("qkv", th) + inputs("out", tq, already_kept=fused) + inputs("up", th)
                   + inputs("down", tf, already_kept=relu_like))
    if fused:
        attention = 4 * batch * arch.heads * seq + batch * seq * seq * act_bytes  # log-sum-exp, padding mask
    else:
        # weights, mask (on a CPU, of the weights' dtype) and dropped weights
        attention = batch * arch.heads * seq * seq * 3 * attention_bytes
    return own + projections + attention + residual_masks(arch, tokens, act_bytes, device)


