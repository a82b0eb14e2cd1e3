"""Named model + data presets. Change one name to move a lesson from a laptop CPU to GPUs.

| preset          | causal LM              | classifier     | data                       |
| --------------- | ---------------------- | -------------- | -------------------------- |
| `tiny`          | assets/tiny/causal_lm  | assets/tiny/encoder | shipped synthetic data (offline) |
| `gpt2`          | gpt2                   | -              | alpaca-style instructions  |
| `opt-350m`      | facebook/opt-350m      | -              | CodeAlpaca-20k, max_length 128 |
| `roberta-large` | -                      | roberta-large  | a sentence classification set |
| `smollm2-135m`  | HuggingFaceTB/SmolLM2-135M | -          | alpaca-style instructions  |

Real presets load from the hub when online; each ships its ``config.json`` under ``assets/configs/`` so its
architecture can be built offline with random weights (parameter counts, memory, speed). A new model is a preset
here plus its published config.json there (``smollm2-135m``: a Llama, with RMSNorm, a gated SwiGLU MLP and
grouped-query attention, added that way).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from my_utils import UserError
from my_utils.core.paths import ASSETS


@dataclass(frozen=True)
class Preset:
    name: str
    causal_model: str | None  # hub id or local folder of the causal LM
    classifier_model: str | None  # hub id or local folder of the encoder for classification
    offline_config: dict = field(default_factory=dict)  # role -> folder with config.json, for random-weight builds
    instruction_data: str | None = None  # "tiny", "alpaca" or "codealpaca"
    classification_data: str | None = None  # "tiny" or "sst2"
    max_length: int = 128
    lora_targets: tuple[str, ...] = ()
    classifier_lora_targets: tuple[str, ...] = ()
    # Training defaults that fit the preset's hardware; every one can be overridden on the command line.
    batch_size: int = 8
    learning_rate: float = 2e-4  # LoRA's
    full_learning_rate: float | None = None  # full fine-tuning's, where measured; else a tenth of LoRA's
    # The classifier's own rates (LoRA's, full fine-tuning's), where they were measured apart from the causal LM's;
    # else the two above.
    classifier_learning_rate: float | None = None
    classifier_full_learning_rate: float | None = None
    max_steps: int = 100
    lr_scheduler: str = "cosine"
    offline: bool = False  # everything ships in assets/

    def require(self, role: str) -> str:
        """The model id for ``role`` ('causal' or 'classifier'), or a clear error if this preset has none."""
        model = self.causal_model if role == "causal" else self.classifier_model
        if model is None:
            have = [n for n, p in PRESETS.items() if (p.causal_model if role == "causal" else p.classifier_model)]
            raise UserError(f"Preset {self.name!r} has no {role} model; use one of {', '.join(have)}.")
        return model


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        causal_model=str(ASSETS / "tiny" / "causal_lm"),
        classifier_model=str(ASSETS / "tiny" / "encoder"),
        offline_config={"causal": str(ASSETS / "tiny" / "causal_lm"), "classifier": str(ASSETS / "tiny" / "encoder")},
        instruction_data="tiny",
        classification_data="tiny",
        max_length=128,
        lora_targets=("c_attn",),
        classifier_lora_targets=("query", "value"),
        batch_size=16,
        # LoRA's rate, and full fine-tuning's: lesson 07's grid puts full fine-tuning's best near 1e-3 (a tenth of
        # LoRA's rate, the published rule, would be 0.4 of it) and LoRA's near 7e-3, whose gain over 4e-3 is small
        # beside the seeds' spread (lesson 13's search brackets 5e-3).
        learning_rate=4e-3,
        full_learning_rate=1e-3,
        # The classifier's rates, which decay linearly to zero: LoRA's chosen at rank 8 over lesson 11's 150 steps
        # (6e-3 ended nearer full fine-tuning than 5e-3, seeds 0 to 2, and 3e-3, seed 0; 1.2e-2 did no better at 100
        # steps); full fine-tuning, which moves every pretrained weight, takes a smaller step.
        classifier_learning_rate=6e-3,
        classifier_full_learning_rate=5e-4,
        max_steps=250,
        # A constant rate learns the unseen tasks in a few hundred steps; cosine decay spends half of them slow.
        lr_scheduler="constant_with_warmup",
        offline=True,
    ),
    "gpt2": Preset(
        name="gpt2",
        causal_model="gpt2",
        classifier_model=None,
        offline_config={"causal": str(ASSETS / "configs" / "gpt2")},
        instruction_data="alpaca",
        max_length=256,
        lora_targets=("c_attn",),
        batch_size=8,
        learning_rate=2e-4,
        max_steps=500,
    ),
    "opt-350m": Preset(
        name="opt-350m",
        causal_model="facebook/opt-350m",
        classifier_model=None,
        offline_config={"causal": str(ASSETS / "configs" / "opt-350m")},
        instruction_data="codealpaca",
        max_length=128,
        lora_targets=("q_proj", "v_proj"),
        batch_size=16,
        learning_rate=2e-4,
        max_steps=500,
    ),
    "smollm2-135m": Preset(
        name="smollm2-135m",
        causal_model="HuggingFaceTB/SmolLM2-135M",
        classifier_model=None,
        offline_config={"causal": str(ASSETS / "configs" / "smollm2-135m")},
        instruction_data="alpaca",
        max_length=256,
        # The attention's query and value projections, as for opt-350m: the LoRA paper's choice (Hu et al. 2021
        # adapt W_q and W_v) and peft's default for Llama models. With grouped-query attention v_proj is narrow
        # (576 -> 192), so rank 8 adds 30 x 8 x (576 + 576 + 576 + 192) = 460,800 parameters, 0.34% of the model;
        # lesson 07 compares these with every linear layer (gate_proj, up_proj, down_proj, k_proj, o_proj too).
        lora_targets=("q_proj", "v_proj"),
        batch_size=8,
        learning_rate=2e-4,
        max_steps=500,
    ),
    "roberta-large": Preset(
        name="roberta-large",
        causal_model=None,
        classifier_model="roberta-large",
        offline_config={"classifier": str(ASSETS / "configs" / "roberta-large")},
        classification_data="sst2",
        max_length=128,
        classifier_lora_targets=("query", "value"),
        batch_size=16,
        # LoRA's rate is ten times full fine-tuning's, which moves every pretrained weight.
        learning_rate=2e-4,
        full_learning_rate=2e-5,
        max_steps=500,
    ),
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; an unknown name raises UserError naming the closest one."""
    if name in PRESETS:
        return PRESETS[name]
    close = difflib.get_close_matches(name, PRESETS, n=1, cutoff=0.3)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UserError(f"Unknown preset {name!r}; {hint}choose one of {', '.join(PRESETS)}.")
