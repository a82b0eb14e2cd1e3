"""Memory planner: predict the peak memory of one training process before running it, and say whether it fits.

    python -m my_utils plan --preset opt-350m --method qlora --rank 8 --batch-size 16 --max-length 128 --device T4
    python -m my_utils plan --preset gpt2 --method full --dtype bf16 --processes 4 --memory 24GiB
    python -m my_utils plan --preset opt-350m --method full --processes 8 --zero 3 --device A100-40GB
    python -m my_utils plan --preset tiny --method lora --batch-size 16 --max-length 64 --device cpu   # a CPU process

The architecture comes from the preset's shipped ``config.json``, built on PyTorch's ``meta`` device (shapes,
no memory) for exact parameter counts (tied embeddings counted once); the LoRA parameters are counted from the
target modules' shapes. The planner knows the module layouts of the GPT-2, OPT, RoBERTa and Llama families
(``MODELLED``: LayerNorm or RMSNorm, a plain or a gated (SwiGLU) MLP, fused, separate or grouped-query attention)
and refuses, in one sentence, a model it cannot lay out rather than print a wrong number. The
peak is split into parts, each computed from a stated rule, each comparable with what a run measures from its
tensors (``compare_with_run``):

- weights: every parameter at its stored size: fp32 4 bytes (the workflows load the base model in fp32; bf16
  is autocast, which computes in bf16 from fp32 weights), NF4 (QLoRA, double quantization) 0.5 byte + 1/64
  byte of block constants, int8 1 byte + an fp32 scale per output row. Quantization covers the linear layers
  except the output embedding; the other weights stay in fp32 (peft's k-bit preparation), as do the adapters.
- gradients: 4 bytes per trainable parameter; with several processes DDP adds its gradient buckets, a flat
  copy of the gradients to all-reduce, as a line of their own.
- optimizer states: AdamW keeps two fp32 tensors per trainable parameter: 8 bytes per parameter.
- saved activations: what autograd keeps for the backward pass, layer by layer, from hidden size, intermediate
  size, heads, layers, sequence and batch (see ``layer_activations``), plus what the loss keeps: with the
  workflow's chunked loss (``my_utils.core.chunked_loss``) the gradients it computed in forward, of the hidden
  states and, in full fine-tuning, of the output layer's weight; with the plain loss (``--plain-loss``) the
  log-probabilities over the vocabulary. Under bf16 autocast also the bf16 weight copies the matrix products
  keep. With gradient checkpointing only each layer's input is kept.
- transient: what comes on top while the saved activations are all held: one chunk of the chunked loss's
  logits, or the plain loss's gradients over the vocabulary (and with gradient checkpointing, the one layer being
  recomputed).

With ``--zero`` the data-parallel processes shard what DDP replicates (ZeRO, as lesson 10 measures it with torch's
ZeroRedundancyOptimizer and FSDP2): stage 1 divides the optimizer states by the number of processes, stage 2 also the
gradients and the stored weights, but gathers every weight whole from forward to backward (FSDP2's
``reshard_after_forward=False``), stage 3 gathers only the unit at work: the root (embeddings, norms outside the
blocks) and one block.

The sum is the planned peak of tensor memory per process (= per device: without ZeRO, data-parallel processes each
hold a full replica). On a GPU the plan adds the CUDA context (``CUDA_CONTEXT``, outside torch's counters); on a CPU
the process also holds Python, torch and the libraries (``--device cpu`` measures them here, in a fresh
process, and adds them).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from typing import NamedTuple

from my_utils import UserError
from my_utils.core.chunked_loss import CHUNK_BYTES
from my_utils.core.memory import GiB, MiB, format_bytes
from my_utils.core.models import FUSED_ACTIVATIONS

METHODS = ("full", "lora", "qlora")
DTYPES = {"fp32": 4, "bf16": 2}
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4 bits + an 8-bit absmax per 64 weights + an fp32 per 256 blocks
ADAMW_STATE_BYTES = 8  # exp_avg and exp_avg_sq, fp32
TRAINABLE_BYTES = 4  # trainable parameters and their gradients are fp32 (LoRA adapters, full-FT master weights)
# Autocast leaves the residual stream in fp32 (an fp32 tensor plus a bf16 one is fp32) and runs layer norms in fp32:
# the norms' inputs and outputs stay 4 bytes whatever the compute dtype.
RESIDUAL_BYTES = 4
CUDA_CONTEXT = 600 * MiB  # CUDA context, cuBLAS workspace: on the device but outside torch's allocated bytes
# Usable memory of common GPUs, as torch reports it (a few percent under the marketing figure).
DEVICES = {
    "RTX-3070": 7.8 * GiB,
    "T4": 14.6 * GiB,
    "V100-16GB": 15.8 * GiB,
    "V100-32GB": 31.7 * GiB,
    "L4": 22.0 * GiB,
    "A10G": 22.0 * GiB,
    "RTX-3090": 23.6 * GiB,
    "RTX-4090": 23.6 * GiB,
    "A100-40GB": 39.4 * GiB,
    "A100-80GB": 79.2 * GiB,
    "H100": 79.1 * GiB,
    "H200": 139.8 * GiB,
}
# Activation functions: how many tensors of the MLP's inner size each one saves for backward, and whether the
# next linear layer's input is one of them (ReLU saves its output, which is the input of the down projection).
# A gated MLP (Llama's SwiGLU: down(act(gate(x)) * up(x))) adds the product's two factors, and the down
# projection's input is then the product, a tensor of its own.
ACTIVATIONS = {
    "gelu_new": (4, False),  # written in Python: x, tanh(...), 0.5*x and 1+tanh(...) are all kept
    "gelu": (1, False),
    "gelu_pytorch_tanh": (1, False),
    "relu": (1, True),
    "silu": (1, False),
}
# The model types whose module layout the planner knows, each checked against what autograd saves
# (tests/test_planner.py); any other is refused rather than planned with a guess.
MODELLED = ("gpt2", "opt", "roberta", "llama")
GATED_MLP_BYTES = 2  # the factors of act(gate(x)) * up(x), both kept for the product's backward


@dataclass(frozen=True)
class Architecture:
    """What the planner needs to know about a model, read from its config and its meta-device build."""

    name: str
    model_type: str
    role: str  # "causal" or "classifier"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    activation: str
    dropout: bool  # residual dropout: active in training, it keeps a mask per layer
    attention_dropout: bool  # dropout on attention weights: on a CPU, no fused attention kernel takes it
    fused_qkv: bool  # one projection makes queries, keys and values (GPT-2's c_attn)
    extra_norms: int  # norms outside the blocks (final norm, embedding norm): each keeps its input
    norm: str  # "layer" (LayerNorm: keeps its input, a mean and a 1/std per token) or "rms" (RMSNorm, see _norm_bytes)
    norm_first: bool  # a block normalises its input (pre-LN: GPT-2, Llama) rather than its residual sums (post-LN)
    gated_mlp: bool  # down(act(gate(x)) * up(x)), Llama's SwiGLU; otherwise down(act(up(x)))
    attention_width: int  # query heads x head size: the width of queries, and of keys and values as attention gets them
    kv_heads: int  # key/value heads (grouped-query attention when fewer than the query heads)
    embedding_dropout: bool  # a dropout module outside the blocks (on the embeddings)
    total_params: int
    linears: dict = field(repr=False)  # module name -> (in features, out features, has bias)
    quantizable: tuple = field(repr=False)  # names of the linear layers bitsandbytes would quantize
    head_params: int = 0  # classification head (trained beside LoRA adapters)
    output_layer: str = ""  # a causal LM's projection onto the vocabulary
    positions: int | None = None  # the longest sequence the model takes (its position embeddings), if it has a limit
    norm_params: dict = field(default_factory=dict, repr=False)  # normalisation module name -> its parameters


def _first(config, names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _is_norm(module) -> bool:
    """A normalisation layer: torch's LayerNorm or a model's own (LlamaRMSNorm, T5LayerNorm...), by class name."""
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _refuse(name: str, why: str) -> UserError:
    """The one-sentence error for a model the planner cannot lay out (``why`` says what it does not know)."""
    return UserError(f"The memory planner cannot model {name}: {why}, and a guess would be a wrong number; measure "
                     "a short run of it instead (its summary.json records each part of its memory).")


@lru_cache(maxsize=None)
def architecture(preset: str, role: str | None = None) -> Architecture:
    """The preset's model (causal LM, else classifier) built from its shipped config on the meta device."""
    from transformers import AutoConfig

    from my_utils.core.presets import get_preset

    p = get_preset(preset)
    role = role or ("causal" if p.causal_model else "classifier")
    folder = p.offline_config.get(role)
    if not folder:
        raise UserError(f"Preset {preset!r} ships no {role} config to plan with; use one of tiny, gpt2, opt-350m, "
                        "smollm2-135m.")
    try:
        config = AutoConfig.from_pretrained(folder)
    except OSError:
        raise UserError(f"No config.json in {folder}; the preset's assets are missing, reinstall the course.") from None
    return architecture_from_config(config, preset, role)


def architecture_from_config(config, name: str, role: str = "causal") -> Architecture:
    """Build ``config``'s model on the meta device and read what the planner needs from it; a model type or a
    module layout the planner does not know (``MODELLED``) raises UserError."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    from my_utils.core.models import max_positions

    if config.model_type not in MODELLED:
        raise _refuse(name, f"it knows the layouts of {', '.join(MODELLED[:-1])} and {MODELLED[-1]} models, "
                            f"not {config.model_type!r}")
    with torch.device("meta"):  # shapes only: nothing is allocated
        if role == "causal":
            model = AutoModelForCausalLM.from_config(config)
        else:
            config.num_labels = 2  # the head's size barely matters; two classes as in the classification lesson
            model = AutoModelForSequenceClassification.from_config(config)
    skip = get_keys_to_not_convert(model)
    linears, quantizable = {}, []
    for module_name, module in model.named_modules():
        if isinstance(module, Conv1D):  # GPT-2's linear layers store the weight as (in, out)
            linears[module_name] = (*module.weight.shape, module.bias is not None)
        elif type(module) is torch.nn.Linear:
            linears[module_name] = (module.in_features, module.out_features, module.bias is not None)
        else:
            continue
        if should_convert_module(module_name, skip):
            quantizable.append(module_name)
    outside = [(n, m) for n, m in model.named_modules() if not re.search(r"\.\d+(\.|$)", n)]
    norms = [(n, m) for n, m in model.named_modules() if _is_norm(m)]
    output = model.get_output_embeddings() if role == "causal" else None
    head = ()
    if role == "classifier":
        head = tuple(n for n in ("classifier", "score") if hasattr(model, n))
    hidden = _first(config, ("hidden_size", "n_embd", "d_model"))
    layers = _first(config, ("num_hidden_layers", "n_layer"))
    heads = _first(config, ("num_attention_heads", "n_head"))
    head_dim = _first(config, ("head_dim",), hidden // heads)
    kv_heads = _first(config, ("num_key_value_heads",), heads)
    activation = _first(config, ("activation_function", "hidden_act"), "gelu")
    activation = FUSED_ACTIVATIONS.get(activation, activation)  # as build_causal_lm computes it
    dropout = _first(config, ("resid_pdrop", "dropout", "hidden_dropout_prob"), 0.0) > 0
    attention_dropout = _first(config, ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob"), 0.0) > 0
    in_blocks = [n for n in linears if _in_block(n)]
    gated = any(n.rsplit(".", 1)[-1] == "gate_proj" for n in in_blocks)
    _check_layout(name, linears, in_blocks, norms, layers, activation, gated, heads * head_dim, kv_heads * head_dim)
    return Architecture(
        name=name,
        model_type=config.model_type,
        role=role,
        hidden=hidden,
        intermediate=_first(config, ("intermediate_size", "ffn_dim", "n_inner"), 4 * hidden),
        layers=layers,
        heads=heads,
        vocab=config.vocab_size,
        activation=activation,
        dropout=dropout,
        attention_dropout=attention_dropout,
        fused_qkv=any(_role_of(n) == "qkv" and out == 3 * inp for n, (inp, out, _) in linears.items()),
        extra_norms=sum(not _in_block(n) for n, _ in norms),
        norm="rms" if any(type(m).__name__.endswith("RMSNorm") for _, m in norms) else "layer",
        norm_first=config.model_type in ("gpt2", "llama") or bool(getattr(config, "do_layer_norm_before", False)),
        gated_mlp=gated,
        attention_width=heads * head_dim,
        kv_heads=kv_heads,
        embedding_dropout=dropout and any(isinstance(m, torch.nn.Dropout) for _, m in outside),
        total_params=sum(p.numel() for p in model.parameters()),
        output_layer=next((n for n, m in model.named_modules() if m is output), "") if output is not None else "",
        linears=linears,
        quantizable=tuple(quantizable),
        head_params=sum(p.numel() for n in head for p in getattr(model, n).parameters()),
        positions=max_positions(config),
        norm_params={n: sum(p.numel() for p in m.parameters()) for n, m in norms},
    )


def _check_layout(name, linears, in_blocks, norms, layers, activation, gated, q_width, kv_width) -> None:
    """Refuse a module layout the activation model does not describe: each block must be attention (queries,
    keys and values, an output projection) and an MLP (up, or gate and up, then down) between two norms of one
    kind, with an activation whose saved tensors are known."""
    if activation not in ACTIVATIONS:
        raise _refuse(name, f"it does not know what the activation {activation!r} keeps for backward")
    kinds = {type(m).__name__.endswith("RMSNorm") for _, m in norms}
    in_block_norms = sum(_in_block(n) for n, _ in norms)
    if len(kinds) > 1 or in_block_norms != 2 * layers:
        raise _refuse(name, f"its {layers} blocks hold {in_block_norms} norms of {len(kinds)} kinds, where it "
                            "knows two of one kind per block")
    unknown = sorted({n.rsplit(".", 1)[-1] for n in in_blocks if _role_of(n) == "other"})
    roles = Counter(_role_of(n) for n in in_blocks)
    missing = [r for r in ("qkv", "out", "up", "down") if not roles[r]]
    if unknown or missing:
        raise _refuse(name, f"its blocks' linear layers ({', '.join(unknown or missing)}) are not the attention "
                            "and MLP projections it knows")
    if roles["up"] != layers * (1 + gated) or roles["down"] != layers:
        raise _refuse(name, "its MLP is neither up-activation-down nor Llama's gate-and-up")
    for n in in_blocks:  # separate projections: queries of every head, keys and values of the key/value heads
        last, width = n.rsplit(".", 1)[-1], linears[n][1]
        if (last == "q_proj" and width != q_width) or (last in ("k_proj", "v_proj") and width != kv_width):
            raise _refuse(name, f"its {last} makes {width} features where its config says "
                                f"{q_width if last == 'q_proj' else kv_width}")


def lora_modules(arch: Architecture, targets) -> list[str]:
    """The linear layers peft adapts: those whose name is, or ends with, a target; "all-linear" is every linear
    layer inside the blocks (peft leaves the output head out)."""
    from my_utils.core.adapters import ALL_LINEAR

    targets = tuple(targets)
    if targets == (ALL_LINEAR,):
        return [n for n in arch.linears if _in_block(n)]
    found = [n for n in arch.linears if n.rsplit(".", 1)[-1] in targets or n in targets]
    if not found:
        raise UserError(f"No linear layer of {arch.name} is called {', '.join(targets)}; "
                        f"choose from {', '.join(sorted({n.rsplit('.', 1)[-1] for n in arch.linears}))}.")
    return found


def lora_parameters(arch: Architecture, rank: int, targets) -> int:
    """A rank-r adapter on a (d_in -> d_out) layer adds A (r x d_in) and B (d_out x r): r (d_in + d_out)."""
    return sum(rank * (arch.linears[n][0] + arch.linears[n][1]) for n in lora_modules(arch, targets))


def _matching(names, targets) -> list[str]:
    """The module ``names`` that peft's ``target_modules`` select: a string is a regular expression the whole name
    must match; a list holds names that a module's name equals or ends with (after a dot)."""
    if isinstance(targets, str):
        return [n for n in names if re.fullmatch(targets, n)]
    return [n for n in names if any(n == t or n.endswith("." + t) for t in targets)]


def adapter_parameters(arch: Architecture, peft: dict) -> int:
    """The trainable parameters of the adapter that peft's config ``peft`` (as peft resolved it: its
    adapter_config.json, target modules named) adds to ``arch``, by each method's arithmetic. Methods:

    - LORA: A (r x d_in) and B (d_out x r) per adapted layer; DoRA adds a magnitude per output feature.
    - LOHA: two such pairs, their Hadamard product the update: 2 r (d_in + d_out).
    - IA3: a scaling vector per adapted layer, over its outputs (over its inputs for a feed-forward module).
    - VERA: two scaling vectors per layer (d_out and r); the random projections A and B are shared and frozen.
    - LN_TUNING: the adapted norms' own weights (and biases), trained in a copy.
    - PROMPT_TUNING: a d_model vector per virtual token. P_TUNING: those, and the MLP that makes them
      (d -> h -> h -> d, with biases). PREFIX_TUNING: keys and values per virtual token and layer, as wide
      as the attention's key/value heads.
    """
    kind, targets = peft["peft_type"], peft.get("target_modules") or []
    tokens = peft.get("num_virtual_tokens", 0)
    layers = _matching(arch.linears, targets) if kind in ("LORA", "LOHA", "IA3", "VERA") else []
    if kind == "LORA":
        dora = sum(arch.linears[n][1] for n in layers) if peft.get("use_dora") else 0
        return sum(peft["r"] * (arch.linears[n][0] + arch.linears[n][1]) for n in layers) + dora
    if kind == "LOHA":
        return sum(2 * peft["r"] * (arch.linears[n][0] + arch.linears[n][1]) for n in layers)
    if kind == "IA3":
        feedforward = set(_matching(layers, peft.get("feedforward_modules") or []))
        return sum(arch.linears[n][0] if n in feedforward else arch.linears[n][1] for n in layers)
    if kind == "VERA":
        return sum(arch.linears[n][1] + peft["r"] for n in layers)
    if kind == "LN_TUNING":
        return sum(arch.norm_params[n] for n in _matching(arch.norm_params, targets))
    if kind == "PROMPT_TUNING":
        return tokens * arch.hidden
    if kind == "P_TUNING":
        d, h = arch.hidden, peft["encoder_hidden_size"]
        return tokens * d + (d * h + h) + (h * h + h) + (h * d + d)
    if kind == "PREFIX_TUNING" and not peft.get("prefix_projection"):
        return tokens * arch.layers * 2 * arch.kv_heads * (arch.attention_width // arch.heads)
    raise UserError(f"The planner does not count the parameters of {kind}"
                    f"{' with prefix_projection' if kind == 'PREFIX_TUNING' else ''}; measure a short run of it.")


def _role_of(name: str) -> str:
    """Which part of a transformer block a linear layer is: 'qkv', 'out', 'up' (the MLP's first projections:
    up, and a gated MLP's gate), 'down' or 'other'."""
    last = name.rsplit(".", 1)[-1]
    if last in ("c_attn", "q_proj", "k_proj", "v_proj", "query", "key", "value", "qkv", "Wqkv"):
        return "qkv"
    if last in ("out_proj", "o_proj") or re.search(r"attn\.c_proj$|attention\.output\.dense$", name):
        return "out"
    if last in ("c_fc", "fc1", "up_proj", "gate_proj") or re.search(r"intermediate\.dense$", name):
        return "up"  # a gated MLP's gate and up projections both read the norm's output
    if last in ("fc2", "down_proj") or re.search(r"mlp\.c_proj$|\d\.output\.dense$", name):
        return "down"
    return "other"


def _in_block(name: str) -> bool:
    """Whether a module is inside one of the repeated transformer blocks ('...h.3.attn.c_attn')."""
    return re.search(r"\.\d+\.", name) is not None


def _per_block(arch: Architecture, names) -> dict[str, float]:
    """How many of the linear layers ``names`` each block has, per part ('qkv', 'out', 'up', 'down', 'other')."""
    counts = {}
    for n in names:
        counts[_role_of(n)] = counts.get(_role_of(n), 0) + 1 / arch.layers
    return counts


def _norm_bytes(arch: Architecture, tokens: int, trains: bool) -> float:
    """Bytes one norm keeps for backward: its fp32 input and, per token, its statistics (LayerNorm's kernel: the
    mean and 1/std; RMSNorm: 1/rms). An RMSNorm is written in Python (``weight * (x * rsqrt(mean(x^2) + eps))``),
    so when its weight trains the product keeps the normalised input too, a tensor of its own."""
    stats = 1 if arch.norm == "rms" else 2
    own = tokens * (arch.hidden * RESIDUAL_BYTES + stats * 4)
    return own + (tokens * arch.hidden * RESIDUAL_BYTES if arch.norm == "rms" and trains else 0)


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
    its weight's gradient (``_norm_bytes``).
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
    mask_bytes = act_bytes if device == "cpu" else 1
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
        2 * _norm_bytes(arch, tokens, norms_train)  # what the two norms keep
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
    masks = 2 * th * mask_bytes if arch.dropout else 0  # the two residual dropouts
    return own + projections + attention + masks


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
        rows = [("weights", self.weights, f"{self.total_params:,} parameters" + (shard if self.zero >= 2 else ""))]
        if self.gathered:
            rows.append(("gathered weights", self.gathered, "every weight, whole, from forward to backward"
                         if self.zero == 2 else "the root unit and one block, whole"))
        rows.append(("gradients", self.gradients, f"{self.trainable_params:,} trainable x 4 B"
                     + (shard if self.zero >= 2 else "")))
        if self.ddp_buckets:
            rows.append(("DDP gradient buckets", self.ddp_buckets, "a flat copy of the gradients, to all-reduce"))
        rows += [
            ("optimizer states", self.optimizer, f"AdamW: {self.trainable_params:,} x 2 x 4 B" + shard),
            ("saved activations", self.saved_activations, f"batch {self.batch} x seq {self.seq}"
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
# The adapter settings the arithmetic models; any other set away from its default is refused, so a new peft
# option in AdapterSpec is never planned silently as plain LoRA.
MODELLED_ADAPTER_FIELDS = ("rank", "alpha", "targets", "rslora", "adapter_config", "peft")


def check_adapter_modelled(adapter) -> None:
    """One sentence if ``adapter`` (an AdapterSpec) uses a setting or a method whose memory the planner does not
    model (it models LoRA's; ``adapter_parameters`` counts the other methods' parameters)."""
    from my_utils.core.adapters import LORA, read_adapter_file

    for f in fields(adapter):
        if f.name not in MODELLED_ADAPTER_FIELDS and getattr(adapter, f.name) != f.default:
            raise UserError(f"The planner does not model the memory of --{f.name.replace('_', '-')} "
                            f"{getattr(adapter, f.name)!r}; plan without it and measure the run.")
    written = adapter.peft or (read_adapter_file(adapter.adapter_config) if adapter.adapter_config else {})
    if adapter.peft_type != LORA or written.get("use_dora"):
        name = "DoRA" if adapter.peft_type == LORA else adapter.peft_type
        raise UserError(f"The planner models the memory of LoRA, not of {name} ({adapter.adapter_config}); plan "
                        "LoRA at a similar size and measure a short run of it.")


def plan(preset: str, method: str = "lora", *, adapter=None, batch_size: int | None = None,
         max_length: int | None = None, processes: int = 1, dtype: str = "fp32", quantize: str | None = None,
         gradient_checkpointing: bool = False, device: str = "cuda", zero: int = 0, chunked_loss: bool = True) -> Plan:
    """Predict one process's peak tensor memory for fine-tuning ``preset`` with ``method`` (full, lora, qlora).

    ``adapter`` is an AdapterSpec (default: rank 8 on the preset's targets); ``quantize`` is '4bit' (NF4, the
    default for qlora) or '8bit'; ``batch_size`` is per process; ``max_length`` is the padded sequence length
    (default: the preset's); ``device`` is 'cuda' or 'cpu' (see ``layer_activations``); ``zero`` the ZeRO stage
    over ``processes`` (0: plain DDP); ``chunked_loss`` the LoRA workflow's loss (its default), else the plain one.
    """
    from my_utils.core.adapters import AdapterSpec
    from my_utils.core.presets import get_preset
    from my_utils.run.config import check_positive

    p = get_preset(preset)
    method, quantize = _method(method, quantize)
    if dtype not in DTYPES:
        raise UserError(f"Unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}.")
    if device not in ("cuda", "cpu"):
        raise UserError(f"Unknown device kind {device!r}; choose cuda or cpu.")
    batch = p.batch_size if batch_size is None else batch_size
    seq = p.max_length if max_length is None else max_length
    for name, value in (("--batch-size", batch), ("--max-length", seq), ("--processes", processes)):
        check_positive(name, value)
    check_zero(zero, processes, quantize)
    adapter = adapter or AdapterSpec()
    if method != "full":
        adapter.check()
        check_adapter_modelled(adapter)
    arch = architecture(preset)
    if arch.positions and seq > arch.positions:
        raise UserError(f"--max-length {seq} is longer than {preset} allows ({arch.positions} positions); use "
                        f"--max-length {arch.positions} or less.")
    adapter = adapter.resolved(p.lora_targets if arch.role == "causal" else p.classifier_lora_targets)
    widths = {name.rsplit(".", 1)[-1]: min(inp, out) for name, (inp, out, _) in arch.linears.items()}
    width = min((w for name, w in widths.items() if name in adapter.targets), default=None)
    if method != "full" and width is not None and adapter.rank > width:
        raise UserError(f"LoRA rank {adapter.rank} is above the width of the layers it adapts ({width}), where a "
                        f"rank-{width} update is already a full one; use --rank {width} or less.")
    return estimate(arch, method, quantize=quantize, rank=adapter.rank, targets=adapter.targets, batch=batch, seq=seq,
                    processes=processes, dtype=dtype, gradient_checkpointing=gradient_checkpointing, device=device,
                    zero=zero, chunked_loss=chunked_loss)


def check_zero(zero: int, processes: int, quantize: str) -> None:
    """One sentence for a ZeRO stage that does not exist, has nothing to shard over, or is not modelled."""
    if zero not in ZERO_STAGES:
        raise UserError(f"--zero {zero} is not a ZeRO stage; choose one of {', '.join(map(str, ZERO_STAGES))}.")
    if zero and processes < 2:
        raise UserError(f"ZeRO shards over processes: --zero {zero} needs --processes 2 or more.")
    if zero and quantize != "none":
        raise UserError("The planner does not model ZeRO over quantized weights; plan --zero with full or lora.")


def shard(plan: Plan, arch: Architecture, zero: int) -> Plan:
    """``plan`` (plain DDP) with ZeRO stage ``zero`` over its processes (see the module's docstring)."""
    from dataclasses import replace

    if not zero:
        return plan
    n = plan.processes
    if zero == 1:
        return replace(plan, zero=1, optimizer=plan.optimizer / n)
    # FSDP2: no DDP buckets; the weights stored as shards and gathered whole for compute
    whole = plan.weights
    block = 4 * sum(i * o + (o if bias else 0) for name, (i, o, bias) in arch.linears.items() if _in_block(name))
    block /= arch.layers
    root = max(whole - block * arch.layers, 0.0)
    return replace(plan, zero=zero, weights=whole / n, gradients=plan.gradients / n, optimizer=plan.optimizer / n,
                   ddp_buckets=0.0, gathered=whole if zero == 2 else root + block)


def estimate(arch: Architecture, method: str, *, quantize: str = "none", rank: int = 8, targets=(), batch: int,
             seq: int, processes: int = 1, dtype: str = "fp32", gradient_checkpointing: bool = False,
             device: str = "cuda", zero: int = 0, chunked_loss: bool = True) -> Plan:
    """The plan for an architecture (``plan`` fills in a preset's defaults and checks the arguments)."""
    dtype_bytes = DTYPES[dtype]
    in_blocks = [n for n in arch.linears if _in_block(n)]
    if method == "full":
        lora = 0
        trainable = arch.total_params
        kept = _per_block(arch, in_blocks)
    else:
        lora = lora_parameters(arch, rank, targets)
        trainable = lora + arch.head_params
        kept = _per_block(arch, lora_modules(arch, targets))
    quantized_parts = _per_block(arch, [n for n in in_blocks if n in arch.quantizable]) if quantize != "none" else {}
    held = quantized_parts if quantize == "8bit" else {}
    total = arch.total_params + (trainable if method != "full" else 0)  # + adapters, head copy
    autocast = dtype_bytes < RESIDUAL_BYTES

    # weights
    if quantize == "none":
        weights = total * 4  # the base model and the adapters in fp32
    else:
        quantized = sum(arch.linears[n][0] * arch.linears[n][1] for n in arch.quantizable)
        rows = sum(arch.linears[n][1] for n in arch.quantizable)
        stored = quantized * NF4_BYTES if quantize == "4bit" else quantized + 4 * rows
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
                copies[_in_block(n)] += d_in * d_out
                first_block_copies += d_in * d_out / arch.layers if _in_block(n) and _role_of(n) == "qkv" else 0
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
            layers -= (_norm_bytes(arch, tokens, False) * arch.norm_first + first_block_copies * dtype_bytes
                       + held_input)
    # the inputs of the norms outside the blocks, the embedding dropout's mask, the weight copies outside
    mask_bytes = RESIDUAL_BYTES if device == "cpu" else 1
    edges = (arch.extra_norms * _norm_bytes(arch, tokens, method == "full")
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
                      backward_extra=backward_extra, ddp_buckets=gradients if processes > 1 else 0), arch, zero)


def _method(method: str, quantize: str | None) -> tuple[str, str]:
    """Normalise (method, quantize): 'qlora' means 4-bit unless 8-bit is asked; 'qlora-8bit' is accepted too."""
    if method.startswith("qlora-"):
        named = method.split("-", 1)[1]
        if quantize not in (None, "none", named):
            raise UserError(f"--method {method} and --quantize {quantize} disagree; give one of them.")
        method, quantize = "qlora", named
    if method not in METHODS:
        raise UserError(f"Unknown method {method!r}; choose one of {', '.join(METHODS)}.")
    if method == "qlora":
        quantize = quantize if quantize not in (None, "none") else "4bit"
        if quantize not in ("4bit", "8bit"):
            raise UserError(f"Unknown quantization {quantize!r}; choose 4bit or 8bit.")
    elif quantize not in (None, "none"):
        raise UserError("Quantized weights go with --method qlora; drop --quantize or use --method qlora.")
    return method, quantize or "none"


def longest_example(preset: str, max_length: int | None = None) -> int:
    """Tokens in the preset's longest training example: what dynamic padding pads a batch to, at most (the
    ``seq`` to plan with for the shipped data)."""
    from my_utils.core.data import load_instructions, tokenize_instructions
    from my_utils.core.models import load_tokenizer
    from my_utils.core.presets import get_preset

    p = get_preset(preset)
    rows, _ = load_instructions(p.instruction_data)
    return max(len(x["input_ids"]) for x in tokenize_instructions(rows, load_tokenizer(p), max_length or p.max_length))


# ---------------------------------------------------------------------------------------------- the runtime


BASELINE_IMPORTS = "import torch, transformers, accelerate, peft; from transformers import Trainer"


def measure_baseline_rss(quantize: str = "none") -> int:
    """Resident memory of a fresh Python process that has imported the training stack (torch, transformers,
    the Trainer, accelerate, peft; bitsandbytes for a quantized run) and run one small backward pass (which
    loads the compute kernels): what a CPU training process holds before its model and data."""
    code = (
        f"{BASELINE_IMPORTS}\n"
        + ("import bitsandbytes\n" if quantize != "none" else "")
        + "layer = torch.nn.Linear(64, 64)\n"
        + "torch.optim.AdamW(layer.parameters(), fused=True).zero_grad()\n"
        + "layer(torch.randn(8, 64)).sum().backward()\n"
        + "from my_utils.core.memory import process_rss\n"
        + "print(process_rss())\n"
    )
    from my_utils.run.launch import clean_env

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), check=True)
    return int(out.stdout.strip().splitlines()[-1])


def with_runtime(p: Plan, device: str = "cuda", baseline: int | None = None) -> Plan:
    """Add what a process holds beside its tensors: on a GPU the CUDA context, on a CPU ``baseline`` (measure it
    with ``measure_baseline_rss``)."""
    if device == "cpu":
        if baseline is not None:
            p.overhead, p.overhead_what = baseline, "process baseline: Python, torch, libraries (measured)"
    else:
        p.overhead, p.overhead_what = CUDA_CONTEXT, "CUDA context and workspaces (typical)"
    return p


# ---------------------------------------------------------------------------------------------- what fits per card

FITS_PRESETS = ("gpt2", "smollm2-135m", "opt-350m")
FITS_CARDS = ("T4", "A10G", "A100-40GB", "H100")
# (method, dtype, ZeRO stages planned): full fine-tuning in bf16 autocast, LoRA and QLoRA
FITS_ROWS = (("full", "bf16", ZERO_STAGES), ("lora", "bf16", (0, 3)), ("qlora", "bf16", (0,)))


def largest_batch(preset: str, method: str, memory: float, *, limit: int = 4096, **settings) -> int:
    """The largest batch per process whose planned peak (CUDA context included) fits ``memory`` bytes, at most
    ``limit``; 0 when not even one example fits. ``settings`` go to ``plan``."""
    def fits(batch: int) -> bool:
        return with_runtime(plan(preset, method, batch_size=batch, **settings)).peak <= memory

    low, high = 0, limit  # fits(low) holds (or low is 0); the answer is in [low, high]
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def fits_table(processes: int = 8) -> str:
    """A markdown table of what fits per card: for each real preset and method, with plain DDP and with ZeRO over
    ``processes`` GPUs, the largest batch per GPU that each of ``FITS_CARDS`` holds at the preset's sequence length
    (the planned peak, CUDA context included)."""
    from my_utils.core.presets import get_preset
    from my_utils.core.tables import markdown_table

    rows = []
    for preset in FITS_PRESETS:
        for method, dtype, stages in FITS_ROWS:
            for zero in stages:
                batches = [largest_batch(preset, method, DEVICES[card], processes=processes, dtype=dtype, zero=zero)
                           for card in FITS_CARDS]
                rows.append([preset, method, f"ZeRO-{zero}" if zero else "DDP", str(get_preset(preset).max_length),
                             *(str(b) if b else "does not fit" for b in batches)])
    return markdown_table(["preset", "method (bf16 autocast)", f"over {processes} GPUs", "seq", *FITS_CARDS], rows)


# ---------------------------------------------------------------------------------------------- a run against its plan


class Row(NamedTuple):
    component: str
    measured: float  # bytes, from the run's tensors
    predicted: float  # bytes, from the plan
    ratio: float  # predicted / measured


# (component, key in a run's memory breakdown, attribute of a Plan)
COMPARED = (("weights", "weights", "weights"), ("gradients", "gradients", "gradients"),
            ("optimizer states", "optimizer_states", "optimizer"),
            ("saved activations", "saved_activations", "saved_activations"))


def plan_for_run(summary: dict, rank: int = 0) -> Plan:
    """The plan for what a run of the LoRA workflow did on process ``rank``: its preset, method, quantization,
    LoRA rank and targets, mixed precision, processes, device, and the shape of the first batch it trained on
    (the batch its memory callback measured the saved activations of)."""
    from my_utils.core.adapters import AdapterSpec

    if summary.get("workflow") != "lora" or not summary.get("first_batches"):
        raise UserError("Only a LoRA-workflow summary (my_utils.workflows.lora) records what the plan needs; "
                        "pass the summary.json of such a run.")
    quantization = summary["quantization"]
    first = summary["first_batches"][rank]
    method = "full" if summary["method"] == "full" else "lora" if quantization is None else "qlora"
    recorded = summary.get("adapter")  # None for full fine-tuning
    adapter = AdapterSpec(**{**recorded, "targets": tuple(recorded["targets"] or ())}) if recorded else None
    return plan(summary["preset"], method, adapter=adapter,
                quantize=None if quantization is None else f"{quantization['bits']}bit",
                batch_size=first["batch_size"], max_length=first["seq_len"],
                processes=summary["world_size"], gradient_checkpointing=summary.get("gradient_checkpointing", False),
                chunked_loss=summary.get("chunked_loss", False),  # runs from before it had the plain loss
                dtype="fp32" if summary["mixed_precision"] == "no" else "bf16",  # fp16 autocast: 2 bytes as bf16
                device="cuda" if summary["memory"][rank]["end"]["device"].startswith("cuda") else "cpu")


def compare_with_run(summary: dict, rank: int = 0) -> list[Row]:
    """Each part a run measured from its tensors on process ``rank`` (weights, gradients, optimizer states,
    saved activations) beside the plan for that run (``plan_for_run``). The process baseline and the DDP
    buckets are not tensors the run counts, so they are not compared."""
    p = plan_for_run(summary, rank)
    measured = summary["memory"][rank]["breakdown"]
    return [Row(name, measured[key], getattr(p, attr), getattr(p, attr) / measured[key])
            for name, key, attr in COMPARED]


# ---------------------------------------------------------------------------------------------- command line


def parse_size(text: str) -> float:
    """'24GiB', '16GB', '512MiB', '1.5e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise UserError(f"Cannot read the memory size {text!r}; write it like 24GiB, 16GB or 512MiB.")
    number, unit = float(m.group(1)), (m.group(2) or "B").upper().rstrip("B")
    if number <= 0:
        raise UserError(f"The memory size {text!r} is not positive; give the memory to fit, like 24GiB.")
    if not unit:
        return number
    base = 1024 if unit.endswith("I") else 1000
    return number * base ** ("KMGT".index(unit[0]) + 1)


def device_memory(name: str) -> tuple[str, float]:
    """The name as listed and the usable bytes of a GPU ('T4', 'a100-40gb', ...)."""
    for known, size in DEVICES.items():
        if known.lower() == name.lower():
            return known, size
    raise UserError(f"Unknown device {name!r}; choose one of {', '.join(DEVICES)}, or give --memory 24GiB.")


def render(p: Plan, limit: float | None = None, limit_name: str = "") -> str:
    from my_utils.core.tables import text_table

    rows = [[part, format_bytes(size), how] for part, size, how in p.parts()]
    rows.append(["peak per process", format_bytes(p.peak), (f"x {p.processes} process(es), one per device"
                 + (f", ZeRO-{p.zero}" if p.zero else "")) if p.processes > 1 else "one process"])
    title = (f"{p.preset}, {p.method}" + (f" r={p.rank}" if p.rank else "") + f", {p.dtype}, batch {p.batch} x seq "
             f"{p.seq}, {p.processes} process(es): {p.trainable_params:,} trainable of {p.total_params:,} parameters")
    lines = [title, text_table(["part", "memory", "from"], rows)]
    if limit is not None:
        verdict = "fits" if p.peak <= limit else "does NOT fit"
        lines.append(f"{verdict} {limit_name} ({format_bytes(limit)}): {100 * p.peak / limit:.0f}% used")
    return "\n".join(lines)


def main(argv=None) -> Plan:
    import argparse

    from my_utils.core.adapters import AdapterSpec
    from my_utils.core.presets import PRESETS
    from my_utils.run.config import OneLineParser, add_arguments, build_config

    ap = OneLineParser(prog="python -m my_utils plan", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)}")
    ap.add_argument("--method", default="lora", help="full, lora or qlora (4-bit; qlora-8bit for 8-bit)")
    ap.add_argument("--quantize", choices=("4bit", "8bit"), help="QLoRA's weight format (default 4bit)")
    add_arguments(ap.add_argument_group("the adapter (LoRA, QLoRA)"), AdapterSpec)
    ap.add_argument("--batch-size", type=int, help="batch per process (default: the preset's)")
    ap.add_argument("--max-length", type=int, help="tokens per example after padding (default: the preset's)")
    ap.add_argument("--processes", type=int, default=1, help="data-parallel processes, one per device")
    ap.add_argument("--zero", type=int, default=0, choices=ZERO_STAGES,
                    help="ZeRO stage over the processes: 1 shards the optimizer states, 2 also the gradients and "
                    "stored weights (gathered whole from forward to backward), 3 gathers one block at a time")
    ap.add_argument("--dtype", default="fp32", choices=tuple(DTYPES),
                    help="compute dtype (bf16: mixed precision, autocast over fp32 weights)")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="keep only each layer's input")
    ap.add_argument("--plain-loss", action="store_true",
                    help="the whole logits at once (the workflow's --no-chunked-loss), not its chunked loss")
    ap.add_argument("--device", help=f"the device to fit: {', '.join(DEVICES)}, or cpu (this machine's memory "
                    "shared by the processes; adds the measured process baseline)")
    ap.add_argument("--memory", help="the memory to fit per device instead, e.g. 24GiB")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    on_cpu = (args.device or "").lower() == "cpu"
    limit, limit_name = None, ""
    if args.memory:
        limit, limit_name = parse_size(args.memory), args.memory
    elif on_cpu:
        import psutil

        limit, limit_name = psutil.virtual_memory().total / args.processes, f"this machine's memory / {args.processes}"
    elif args.device:
        limit_name, limit = device_memory(args.device)
    adapter = build_config(AdapterSpec, vars(args))
    if args.method == "full" and adapter != AdapterSpec():
        changed = next(f.name for f in fields(AdapterSpec) if getattr(adapter, f.name) != getattr(AdapterSpec(), f.name))
        raise UserError(f"--{changed.replace('_', '-')} sets the LoRA adapter, which --method full has none of; drop "
                        "it, or plan --method lora.")
    p = plan(args.preset, args.method, adapter=adapter, batch_size=args.batch_size,
             max_length=args.max_length,
             processes=args.processes, dtype=args.dtype, quantize=args.quantize,
             gradient_checkpointing=args.gradient_checkpointing, device="cpu" if on_cpu else "cuda", zero=args.zero,
             chunked_loss=not args.plain_loss)
    quantize = p.method.split("-", 1)[1] if p.method.startswith("qlora") else "none"
    with_runtime(p, "cpu" if on_cpu else "cuda", measure_baseline_rss(quantize) if on_cpu else None)
    if args.json:
        print(json.dumps({**asdict(p), "activations": p.activations, "peak": p.peak, "limit": limit,
                          "fits": None if limit is None else p.peak <= limit}, indent=2))
    else:
        print(render(p, limit, limit_name))
    return p
