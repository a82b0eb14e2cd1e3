"""A model's layout as the planner reads it: its config built on the meta device, the linear layers, norms and
blocks, and the trainable parameters of each adapter method."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from my_utils import UserError
from my_utils.core.adapters import ALL_LINEAR
from my_utils.core.models import FUSED_ACTIVATIONS, max_positions
from my_utils.core.presets import get_preset

# The model types whose module layout the planner knows, each checked against what autograd saves
# (tests/test_planner.py); any other is refused rather than planned with a guess.
MODELLED = ("gpt2", "opt", "roberta", "llama")
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
    norm: str  # "layer" (LayerNorm: keeps its input, a mean and a 1/std per token) or "rms" (RMSNorm, see norm_bytes)
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
    tied_embeddings: bool = False  # the output layer is the input embedding's matrix


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
    in_blocks = [n for n in linears if in_block(n)]
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
        fused_qkv=any(role_of(n) == "qkv" and out == 3 * inp for n, (inp, out, _) in linears.items()),
        extra_norms=sum(not in_block(n) for n, _ in norms),
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
        tied_embeddings=output is not None and output.weight is model.get_input_embeddings().weight,
    )


def _check_layout(name, linears, in_blocks, norms, layers, activation, gated, q_width, kv_width) -> None:
    """Refuse a module layout the activation model does not describe: each block must be attention (queries,
    keys and values, an output projection) and an MLP (up, or gate and up, then down) between two norms of one
    kind, with an activation whose saved tensors are known."""
    if activation not in ACTIVATIONS:
        raise _refuse(name, f"it does not know what the activation {activation!r} keeps for backward")
    kinds = {type(m).__name__.endswith("RMSNorm") for _, m in norms}
    in_block_norms = sum(in_block(n) for n, _ in norms)
    if len(kinds) > 1 or in_block_norms != 2 * layers:
        raise _refuse(name, f"its {layers} blocks hold {in_block_norms} norms of {len(kinds)} kinds, where it "
                            "knows two of one kind per block")
    unknown = sorted({n.rsplit(".", 1)[-1] for n in in_blocks if role_of(n) == "other"})
    roles = Counter(role_of(n) for n in in_blocks)
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
    targets = tuple(targets)
    if targets == (ALL_LINEAR,):
        return [n for n in arch.linears if in_block(n)]
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


def role_of(name: str) -> str:
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


def in_block(name: str) -> bool:
    """Whether a module is inside one of the repeated transformer blocks ('...h.3.attn.c_attn')."""
    return re.search(r"\.\d+\.", name) is not None


def per_block(arch: Architecture, names) -> dict[str, float]:
    """How many of the linear layers ``names`` each block has, per part ('qkv', 'out', 'up', 'down', 'other')."""
    counts = {}
    for n in names:
        counts[role_of(n)] = counts.get(role_of(n), 0) + 1 / arch.layers
    return counts
