"""Learning-rate rules."""

from __future__ import annotations

import math

from my_utils import UserError

LR_SCALING = ("none", "linear", "sqrt")


def scale_learning_rate(base_lr: float, effective_batch: int, base_batch: int, rule: str = "none") -> float:
    """Scale a learning rate tuned for ``base_batch`` to ``effective_batch`` (= batch x accumulation x processes).

    'linear' multiplies by the batch ratio (Goyal et al., for SGD), 'sqrt' by its square root (often better
    for Adam), 'none' keeps it.
    """
    if rule not in LR_SCALING:
        raise UserError(f"Unknown learning-rate scaling {rule!r}; choose one of {', '.join(LR_SCALING)}.")
    ratio = effective_batch / base_batch
    return base_lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]




FULL_FINE_TUNING_SHARE = 0.1  # full fine-tuning moves every pretrained weight: a tenth of LoRA's rate


def default_learning_rate(preset, method: str, role: str = "causal") -> float:
    """The rate a run uses when none is given, for the preset's model of ``role`` ('causal' or 'classifier'): the
    preset's LoRA rate, or for full fine-tuning the preset's full fine-tuning rate where it was measured, else a tenth
    of LoRA's (the published rule of thumb). The classifier's own rates, where the preset has them, come first."""
    classifier = role == "classifier"
    lora = (classifier and preset.classifier_learning_rate) or preset.learning_rate
    if method == "full":
        measured = (classifier and preset.classifier_full_learning_rate) or preset.full_learning_rate
        return measured or lora * FULL_FINE_TUNING_SHARE
    return lora
