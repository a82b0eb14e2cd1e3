"""``plan``: a preset and the settings asked, checked in one sentence each, planned."""

from __future__ import annotations

from dataclasses import fields

from my_utils import UserError
from my_utils.core.adapters import LORA, AdapterSpec, read_adapter_file
from my_utils.core.presets import get_preset
from my_utils.core.splits import check_pipeline_split, check_tensor_split, model_config
from my_utils.run.config import check_positive
from my_utils.tools.planner.arithmetic import DTYPES, METHODS, ZERO_STAGES, Plan
from my_utils.tools.planner.layout import architecture, architecture_from_config
from my_utils.tools.planner.model_parallel import check_split, split_estimate

# The adapter settings the arithmetic models; any other set away from its default is refused, so a new peft
# option in AdapterSpec is never planned silently as plain LoRA.
MODELLED_ADAPTER_FIELDS = ("rank", "alpha", "targets", "rslora", "adapter_config", "peft")


def check_adapter_modelled(adapter) -> None:
    """One sentence if ``adapter`` (an AdapterSpec) uses a setting or a method whose memory the planner does not
    model (it models LoRA's; ``adapter_parameters`` counts the other methods' parameters)."""
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
         gradient_checkpointing: bool = False, device: str = "cuda", zero: int = 0, chunked_loss: bool = True,
         tp: int = 1, pp: int = 1, microbatches: int | None = None, schedule: str = "1f1b",
         sequence_parallel: bool = False) -> Plan:
    """Predict one process's peak tensor memory for fine-tuning ``preset`` with ``method`` (full, lora, qlora).

    ``adapter`` is an AdapterSpec (default: rank 8 on the preset's targets); ``quantize`` is '4bit' (NF4, the
    default for qlora) or '8bit'; ``batch_size`` is per process; ``max_length`` is the padded sequence length
    (default: the preset's); ``device`` is 'cuda' or 'cpu' (see ``layer_activations``); ``zero`` the ZeRO stage
    over ``processes`` (0: plain DDP); ``chunked_loss`` the LoRA workflow's loss (its default), else the plain one.
    ``tp`` and ``pp`` split each of the ``processes`` replicas over more processes, ``microbatches`` (default: the
    stages) at a time through the pipeline on ``schedule`` (``model_parallel``): ``batch_size`` is then per replica.
    """
    p = get_preset(preset)
    method, quantize = _method(method, quantize)
    if dtype not in DTYPES:
        raise UserError(f"Unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}.")
    if device not in ("cuda", "cpu"):
        raise UserError(f"Unknown device kind {device!r}; choose cuda or cpu.")
    batch = p.batch_size if batch_size is None else batch_size
    seq = p.max_length if max_length is None else max_length
    microbatches = pp if microbatches is None else microbatches
    for name, value in (("--local-batch-size", batch), ("--max-length", seq), ("--processes", processes), ("--tp", tp),
                        ("--pp", pp), ("--microbatches", microbatches)):
        check_positive(name, value)
    check_zero(zero, processes, quantize)
    adapter = adapter or AdapterSpec()
    if method != "full":
        adapter.check()
        check_adapter_modelled(adapter)
    check_split(method, tp=tp, pp=pp, quantize=quantize, zero=zero, gradient_checkpointing=gradient_checkpointing)
    if tp > 1:  # the model lesson 09's tensor parallel splits, and what it refuses
        config = model_config(p)
        check_tensor_split(config, tp, sequence_parallel, seq)
        arch = architecture_from_config(config, preset)
    else:
        arch = architecture(preset)
    if pp > 1:  # what lesson 08's pipeline refuses
        check_pipeline_split(pp, arch.layers, batch, microbatches, schedule)
    if arch.positions and seq > arch.positions:
        raise UserError(f"--max-length {seq} is longer than {preset} allows ({arch.positions} positions); use "
                        f"--max-length {arch.positions} or less.")
    adapter = adapter.resolved(p.lora_targets if arch.role == "causal" else p.classifier_lora_targets)
    widths = {name.rsplit(".", 1)[-1]: min(inp, out) for name, (inp, out, _) in arch.linears.items()}
    width = min((w for name, w in widths.items() if name in adapter.targets), default=None)
    if method != "full" and width is not None and adapter.rank > width:
        raise UserError(f"LoRA rank {adapter.rank} is above the width of the layers it adapts ({width}), where a "
                        f"rank-{width} update is already a full one; use --rank {width} or less.")
    return split_estimate(arch, method, tp=tp, pp=pp, microbatches=microbatches, schedule=schedule,
                          sequence_parallel=sequence_parallel, quantize=quantize, rank=adapter.rank,
                          targets=adapter.targets, batch=batch, seq=seq, processes=processes, dtype=dtype,
                          gradient_checkpointing=gradient_checkpointing, device=device, zero=zero,
                          chunked_loss=chunked_loss)


def check_zero(zero: int, processes: int, quantize: str) -> None:
    """One sentence for a ZeRO stage that does not exist, has nothing to shard over, or is not modelled."""
    if zero not in ZERO_STAGES:
        raise UserError(f"--zero {zero} is not a ZeRO stage; choose one of {', '.join(map(str, ZERO_STAGES))}.")
    if zero and processes < 2:
        raise UserError(f"ZeRO shards over processes: --zero {zero} needs --processes 2 or more.")
    if zero and quantize == "8bit":
        raise UserError("The planner models ZeRO over 4-bit weights only (lesson 15 measures FSDP2 over them); plan "
                        "--zero with full, lora or qlora.")
    if zero == 1 and quantize != "none":
        raise UserError("ZeRO-1 shards the optimizer states, which QLoRA's adapters hardly have; plan qlora with "
                        "--zero 2 or 3 (FSDP2).")


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
