"""The model split over processes: which model tensor parallel splits, and the layouts tensor and pipeline parallel
refuse. The workflows check their settings here and the planner plans the same models and refuses the same layouts,
in the same sentences."""

from __future__ import annotations

from my_utils import UserError
from my_utils.core.paths import ASSETS
from my_utils.core.pipeline import SCHEDULES

TINY_LLAMA = ASSETS / "tiny" / "llama"  # the tiny preset's Llama for tensor parallel: its config only, random weights


def model_config(preset):
    """The transformers config of the model tensor parallel splits (the tiny preset's Llama, else the preset's causal
    LM); refused in one sentence unless a Llama."""
    from transformers import AutoConfig

    folder = TINY_LLAMA if preset.name == "tiny" else preset.offline_config.get("causal")
    config = AutoConfig.from_pretrained(folder) if folder else None
    if config is None or config.model_type != "llama":
        raise UserError(f"The tensor-parallel plan is written for Llama-family layers (q/k/v/o_proj, "
                        f"gate/up/down_proj) and preset {preset.name!r} has "
                        f"{'no causal LM' if config is None else config.model_type!r}; use --preset tiny or "
                        "smollm2-135m.")
    return config


def check_tensor_split(config, processes: int, sequence_parallel: bool, max_length: int) -> None:
    """Every dimension tensor parallel splits (``config``'s heads, MLP width, an untied vocabulary; with sequence
    parallel the sequence) must divide evenly over ``processes``."""
    sizes = {"attention heads": config.num_attention_heads, "key/value heads": config.num_key_value_heads,
             "MLP width (intermediate_size)": config.intermediate_size}
    if not config.tie_word_embeddings:
        sizes["vocabulary"] = config.vocab_size
    for what, size in sizes.items():
        if size % processes:
            raise UserError(f"The model's {what}, {size}, do not split over {processes} processes; use a number of "
                            f"processes that divides {size}.")
    if sequence_parallel and max_length % processes:
        raise UserError(f"--sequence-parallel splits each sequence over the processes and --max-length "
                        f"{max_length} does not split over {processes}; make it a multiple of {processes}.")


def check_pipeline_split(stages: int, layers: int, batch: int, microbatches: int, schedule: str) -> None:
    """A pipeline of ``stages`` over a model of ``layers`` blocks, a batch of ``batch`` sequences in ``microbatches``
    on ``schedule``: one sentence for a layout that leaves a stage idle or a micro-batch uneven."""
    if schedule not in SCHEDULES:
        raise UserError(f"Unknown schedule {schedule!r}; choose {' or '.join(SCHEDULES)}.")
    if stages > layers:
        raise UserError(f"{stages} stages for a model of {layers} layers leave a stage without one; use {layers} "
                        "stages or fewer.")
    if microbatches < 1 or batch % microbatches:
        raise UserError(f"A batch of {batch} sequences does not split into {microbatches} equal micro-batches; make "
                        "it a multiple of --microbatches.")
    if schedule == "1f1b" and microbatches < stages:
        raise UserError(f"1F1B needs at least one micro-batch per stage: --microbatches {microbatches} for "
                        f"{stages} stages; use --microbatches {stages} or more, or --schedule gpipe.")
