"""What fits per card: the largest batch per process (or per replica, when the model is split) for the real presets,
as docs/planner.md shows it."""

from __future__ import annotations

from my_utils import UserError
from my_utils.core.presets import get_preset
from my_utils.core.tables import markdown_table
from my_utils.tools.planner.arithmetic import ZERO_STAGES
from my_utils.tools.planner.runtime import DEVICES, with_runtime
from my_utils.tools.planner.settings import plan

FITS_PRESETS = ("gpt2", "smollm2-135m", "opt-350m")
FITS_CARDS = ("T4", "A10G", "A100-40GB", "H100")
# (method, dtype, ZeRO stages planned): full fine-tuning in bf16 autocast, LoRA and QLoRA
FITS_ROWS = (("full", "bf16", ZERO_STAGES), ("lora", "bf16", (0, 3)), ("qlora", "bf16", (0,)))
# Eight GPUs laid out as data parallel x tensor parallel x pipeline stages, for full fine-tuning in bf16 autocast
SPLIT_LIMIT = 4096  # the largest batch per replica searched
SPLIT_LAYOUTS = (
    ("DDP 8", {"processes": 8}),
    ("TP 2 x DP 4", {"tp": 2, "processes": 4}),
    ("TP 2 with SP x DP 4", {"tp": 2, "processes": 4, "sequence_parallel": True}),
    ("PP 4 (1F1B, 8 micro-batches) x DP 2", {"pp": 4, "microbatches": 8, "processes": 2}),
    ("TP 2 x PP 2 (1F1B, 8 micro-batches) x DP 2", {"tp": 2, "pp": 2, "microbatches": 8, "processes": 2}),
)


def largest_batch(preset: str, method: str, memory: float, *, limit: int = 4096, step: int = 1, **settings) -> int:
    """The largest batch per process (per replica with --tp or --pp), a multiple of ``step``, whose planned peak
    (CUDA context included) fits ``memory`` bytes, at most ``limit``; 0 when not even ``step`` examples fit.
    ``settings`` go to ``plan``."""
    def fits(steps: int) -> bool:
        return with_runtime(plan(preset, method, batch_size=steps * step, **settings)).peak <= memory

    low, high = 0, limit // step  # fits(low) holds (or low is 0); the answer is in [low, high]
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low * step


def fits_table(processes: int = 8) -> str:
    """A markdown table of what fits per card: for each real preset and method, with plain DDP and with ZeRO over
    ``processes`` GPUs, the largest batch per GPU that each of ``FITS_CARDS`` holds at the preset's sequence length
    (the planned peak, CUDA context included)."""
    rows = []
    for preset in FITS_PRESETS:
        for method, dtype, stages in FITS_ROWS:
            for zero in stages:
                batches = [largest_batch(preset, method, DEVICES[card], processes=processes, dtype=dtype, zero=zero)
                           for card in FITS_CARDS]
                rows.append([preset, method, f"ZeRO-{zero}" if zero else "DDP", str(get_preset(preset).max_length),
                             *(str(b) if b else "does not fit" for b in batches)])
    return markdown_table(["preset", "method (bf16 autocast)", f"over {processes} GPUs", "seq", *FITS_CARDS], rows)


def split_fits_table() -> str:
    """A markdown table of what fits per card when the model itself is split: for each real preset and each of
    ``SPLIT_LAYOUTS`` (8 GPUs, full fine-tuning in bf16 autocast), the largest batch per data-parallel replica that
    each of ``FITS_CARDS`` holds at the preset's sequence length, with the plain loss over whole logits (as lesson
    09's tensor parallel gathers them) in every layout; a layout the model cannot take says why."""
    rows = []
    for preset in FITS_PRESETS:
        for name, layout in SPLIT_LAYOUTS:
            step = layout.get("microbatches", 1)
            try:
                batches = [largest_batch(preset, "full", DEVICES[card], dtype="bf16", chunked_loss=False, step=step,
                                         limit=SPLIT_LIMIT, **layout) for card in FITS_CARDS]
                cells = [f">= {b}" if b == SPLIT_LIMIT // step * step else str(b) if b else "does not fit"
                         for b in batches]
            except UserError as refused:  # a layout the workflows refuse: said once, in the first column
                cells = [str(refused).split(";")[0].replace(f"{preset}'s ", ""), *["-"] * (len(FITS_CARDS) - 1)]
            rows.append([preset, name, str(get_preset(preset).max_length), *cells])
    return markdown_table(["preset", "8 GPUs (full, bf16 autocast)", "seq", *FITS_CARDS], rows)
