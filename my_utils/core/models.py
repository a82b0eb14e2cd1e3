"""Model building: full fine-tuning, LoRA and QLoRA from one function, with peft and bitsandbytes imported
inside the functions that need them (so ``import my_utils`` stays light and launch-safe).

LoRA to QLoRA is one argument: ``build_causal_lm(preset, quantize="4bit")``.

    from my_utils.core.models import build_causal_lm, add_adapter, count_parameters
    preset = get_preset("tiny")
    model = add_adapter(build_causal_lm(preset), AdapterSpec(rank=8).resolved(preset.lora_targets))
"""

from __future__ import annotations

import os
from pathlib import Path

from my_utils import UserError
from my_utils.core.adapters import ALL_LINEAR, LORA, AdapterSpec
from my_utils.core.devices import usable_cores
from my_utils.core.presets import Preset

QUANTIZE_CHOICES = ("none", "8bit", "4bit")


def check_available(model_id: str) -> None:
    """One sentence, within seconds, when ``model_id`` is neither a local folder nor in the Hugging Face cache and
    cannot be downloaded (offline mode, or the hub unreachable): transformers would retry for about a minute and
    end in a long traceback that never says so."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if Path(model_id).is_dir() or isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        return
    how = f"download it where there is internet (hf download {model_id}) into {constants.HF_HUB_CACHE}"
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"{model_id} is not in the Hugging Face cache and HF_HUB_OFFLINE=1 forbids downloading it; "
                        f"{how}, or unset HF_HUB_OFFLINE.")
    hub = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((hub.hostname, hub.port or 443), timeout=3).close()
    except OSError:
        raise UserError(f"{model_id} is not in the Hugging Face cache and {hub.hostname} cannot be reached; "
                        f"{how}.") from None


def load_tokenizer(preset: Preset, role: str = "causal", *, trust_remote_code: bool = False):
    """The preset's tokenizer, with a pad token (GPT-2-style tokenizers have none: eos is reused).
    ``trust_remote_code`` (off unless the user asks) lets a hub repository run its own Python code."""
    from transformers import AutoTokenizer

    check_available(preset.require(role))
    tokenizer = AutoTokenizer.from_pretrained(preset.require(role), trust_remote_code=trust_remote_code)
    if role == "causal" and tokenizer.eos_token is None:  # training teaches the model to end its answer with it
        raise UserError(f"The tokenizer of {preset.require(role)} has no end-of-sequence token, which the "
                        "instruction data ends every answer with; use a tokenizer that defines eos_token.")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def quantization_config(quantize: str, compute_dtype=None):
    """A BitsAndBytesConfig for '8bit' or '4bit' (NF4, double quantization), or None for 'none'."""
    if quantize not in QUANTIZE_CHOICES:
        raise UserError(f"Unknown quantization {quantize!r}; choose one of {', '.join(QUANTIZE_CHOICES)}.")
    if quantize == "none":
        return None
    import torch
    from transformers import BitsAndBytesConfig

    if quantize == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",  # NormalFloat4: quantiles of a normal distribution, suited to weights
        bnb_4bit_use_double_quant=True,  # quantize the quantization constants too (~0.4 bit/param saved)
        bnb_4bit_compute_dtype=compute_dtype or torch.float32,
    )


def build_causal_lm(preset: Preset, *, random_init: bool = False, quantize: str = "none", device_map=None, dtype=None,
                    compute_dtype=None, trust_remote_code: bool = False):
    """The preset's causal LM: pretrained weights, or random weights from the shipped config (offline).

    ``quantize`` loads weights in 8-bit or 4-bit NF4 through bitsandbytes (QLoRA); quantized weights must be
    placed at load time, so pass ``device_map=per_rank_device_map()`` under several processes.
    ``trust_remote_code`` (off unless the user asks) lets a hub repository run its own Python code.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    qconfig = quantization_config(quantize, compute_dtype)
    model_id = preset.require("causal")
    if random_init:
        config = AutoConfig.from_pretrained(preset.offline_config["causal"], trust_remote_code=trust_remote_code)
        if qconfig is not None:
            raise UserError("Quantization needs pretrained weights; drop --random-init or use --quantize none.")
        return fused_activation(name_causal_lm_loss(AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code)))
    check_available(model_id)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    if qconfig is not None:
        kwargs["quantization_config"] = qconfig
        kwargs["device_map"] = device_map or {"": "cpu"}
    elif device_map is not None:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(model_id, trust_remote_code=trust_remote_code, **kwargs)
    if quantize == "4bit":
        keep_4bit_weights_trainable(model)
    return fused_activation(name_causal_lm_loss(model))


# Activations transformers computes as a Python formula, and the one kernel of the same function the course uses.
FUSED_ACTIVATIONS = {"gelu_new": "gelu_pytorch_tanh"}


def fused_activation(model):
    """``model`` with GPT-2's activation, ``gelu_new``, computed by torch's one kernel (``gelu_pytorch_tanh``): the
    same function to float rounding. transformers computes ``gelu_new`` as a Python formula whose every step keeps a
    tensor for backward, four of batch x tokens x 4 x width per layer: 576 MiB for gpt2 at batch 4 x 256, as
    much as the float32 logits. The kernel keeps only its input."""
    from transformers.activations import ACT2CLS

    for module in model.modules():
        for name, child in module.named_children():
            for formula, kernel in FUSED_ACTIVATIONS.items():
                if type(child) is ACT2CLS[formula]:
                    setattr(module, name, ACT2CLS[kernel]())
    return model


def name_causal_lm_loss(model):
    """``model`` with its loss named: transformers reads the loss from the class name, and GPT-2's
    (``GPT2LMHeadModel``) names none, so every forward with labels warned "`loss_type=None` ... Using the default
    loss: `ForCausalLMLoss`". That default is GPT-2's loss; naming it changes nothing else."""
    if getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"
    return model


def keep_4bit_weights_trainable(model) -> None:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference (AVX512-BF16 machines): it repacks
    them in the first forward without gradients (an evaluation before training), and training on repacked
    weights then fails. Forwards use the plain 4-bit kernel instead."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def build_classifier(preset: Preset, num_labels: int, *, random_init: bool = False, dtype=None,
                     trust_remote_code: bool = False):
    """The preset's encoder with a fresh classification head of ``num_labels`` classes.
    ``trust_remote_code`` (off unless the user asks) lets a hub repository run its own Python code."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if random_init:
        config = AutoConfig.from_pretrained(preset.offline_config["classifier"], num_labels=num_labels,
                                            trust_remote_code=trust_remote_code)
        return AutoModelForSequenceClassification.from_config(config, dtype=dtype,
                                                              trust_remote_code=trust_remote_code)
    check_available(preset.require("classifier"))
    kwargs = {"dtype": dtype} if dtype is not None else {}
    return AutoModelForSequenceClassification.from_pretrained(
        preset.require("classifier"), num_labels=num_labels, trust_remote_code=trust_remote_code, **kwargs
    )


# Module classes peft's LoRA can adapt (by class name: bitsandbytes and transformers need not be imported here).
LORA_ADAPTABLE = {"Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d", "Conv1D", "Linear8bitLt", "Linear4bit"}


def check_lora_targets(model, targets, rank: int | None = None) -> None:
    """Refuse LoRA target names that match no module of ``model`` (a real model or a ``meta_model``), or that
    match a module peft cannot adapt (a layer norm, an activation, a whole block); and, given ``rank``, a rank
    above the narrowest adapted layer's width (give the unquantized model: a 4-bit layer's weight is packed)."""
    modules = {}
    for name, module in model.named_modules():
        modules.setdefault(name.rsplit(".", 1)[-1], set()).add(type(module).__name__)
    adaptable = sorted(n for n, kinds in modules.items() if n and not n.isdigit() and kinds <= LORA_ADAPTABLE)
    for target in targets:
        if target == ALL_LINEAR:  # peft finds the linear layers itself
            continue
        if target not in modules:
            raise UserError(f"LoRA target module {target!r} matches nothing in {type(model).__name__}; "
                            f"pick from its adaptable layers: {', '.join(adaptable[:12])}.")
        other = sorted(modules[target] - LORA_ADAPTABLE)
        if other:
            raise UserError(f"LoRA target module {target!r} is a {other[0]}, which LoRA cannot adapt; "
                            f"pick from the adaptable layers of {type(model).__name__}: {', '.join(adaptable[:12])}.")
    widths = {name.rsplit(".", 1)[-1]: min(module.weight.shape) for name, module in model.named_modules()
              if name.rsplit(".", 1)[-1] in targets and getattr(module, "weight", None) is not None}
    if rank is not None and widths and rank > min(widths.values()):
        name, width = min(widths.items(), key=lambda item: item[1])
        raise UserError(f"LoRA rank {rank} is above the width of {name!r} ({width}), where a rank-{width} update is "
                        f"already a full one; use --rank {width} or less.")


def max_positions(config) -> int | None:
    """The longest sequence a model's config allows (n_positions, max_position_embeddings...), or None."""
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def add_adapter(model, spec: AdapterSpec, task_type: str = "CAUSAL_LM", modules_to_save=None):
    """Wrap ``model`` with the adapter ``spec`` describes (peft; give it resolved: every default filled in). peft's
    complaint that a method cannot adapt this model (a layer type it does not support, a target it does not find)
    becomes one sentence.

    A quantized model is first prepared for k-bit training (frozen base, fp32 norms, input gradients).
    """
    spec.check()
    if spec.peft_type == LORA:
        check_lora_targets(model, spec.targets)
    from peft import get_peft_model, prepare_model_for_kbit_training

    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    # GPT-2's Conv1D layers store weights as (in, out); saying so spares peft's warning that it corrected this
    targets = spec.targets or ()
    conv1d = any(type(module).__name__ == "Conv1D" and (not targets or ALL_LINEAR in targets
                                                        or name.rsplit(".", 1)[-1] in targets)
                 for name, module in model.named_modules())
    config = spec.peft_config(task_type, modules_to_save, fan_in_fan_out=conv1d)
    try:
        return get_peft_model(model, config)
    except (TypeError, ValueError) as e:  # raised by peft as it matches the config to the model's layers
        reason = str(e).strip().splitlines()[0].rstrip(".")
        hint = "; name them with --targets or in the file's target_modules" if "target_modules" in reason else ""
        raise UserError(f"peft cannot add {spec.adapter_config or 'this LoRA adapter'} to {type(model).__name__}: "
                        f"{reason}{hint}.") from None


def count_parameters(model) -> dict:
    """Trainable and total parameter counts (a 4-bit parameter is counted once, as one parameter)."""
    trainable = total = 0
    for p in model.parameters():
        n = p.numel()
        # bitsandbytes packs two 4-bit values per uint8 element
        if p.__class__.__name__ == "Params4bit":
            n *= 2
        total += n
        if p.requires_grad:
            trainable += n
    return {"trainable": trainable, "total": total, "trainable_fraction": trainable / total if total else 0.0}


def folder_size(path: str | Path) -> int:
    """Bytes on disk of every file under ``path`` (e.g. a saved adapter)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def weights_bytes(model) -> int:
    """Bytes held by the model's parameters and buffers, as stored (quantized weights count as stored)."""
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def set_threads(n: int | None = None) -> int:
    """Use ``n`` intra-op threads (default: OMP_NUM_THREADS, else all usable cores divided by local world size)."""
    import torch

    if n is None:
        env = os.environ.get("OMP_NUM_THREADS")
        n = int(env) if env else max(1, usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(n)
    return n
