"""A PEFT adapter as data: the fields of peft's ``LoraConfig`` that the course varies, in one frozen dataclass.

The LoRA and classification workflows take it (each field is a command-line flag: ``--rank``, ``--alpha``,
``--targets``, ``--dropout``, ``--rslora``, ``--dora``), record it whole in run.json, and build the adapter from it;
the planner, the sweep and the benchmarks read the same fields. A new peft option is a field here plus its line in
``lora_config``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from my_utils import UserError

ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer except the output head


def _setting(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class AdapterSpec:
    rank: int = _setting(8, "LoRA rank r")
    alpha: float | None = _setting(None, "LoRA alpha (default 2 x rank)")
    targets: tuple[str, ...] | None = _setting(
        None, f"module names to adapt, or {ALL_LINEAR} (default: the preset's)")
    dropout: float = _setting(0.0, "dropout on the adapter's input")
    rslora: bool = _setting(False, "rank-stabilised LoRA: scale the update by alpha / sqrt(rank), not alpha / rank")
    dora: bool = _setting(False, "DoRA: learn each weight's magnitude apart from its direction (peft's use_dora)")

    def check(self) -> None:
        """One sentence for a value that cannot work; the targets are checked against the model elsewhere."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise UserError(f"LoRA rank must be a positive integer, got {self.rank!r}; try --rank 8.")
        if self.alpha is not None and (isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float))
                                       or not math.isfinite(self.alpha) or self.alpha <= 0):
            raise UserError(f"LoRA alpha must be a positive number, got {self.alpha!r}; a common choice is twice "
                            "the rank.")
        if self.targets is not None and not self.targets:
            raise UserError("--targets names no module; give at least one, e.g. --targets c_attn.")
        if not 0 <= self.dropout < 1:
            raise UserError(f"--dropout must be at least 0 and below 1, got {self.dropout!r}.")

    def resolved(self, default_targets) -> AdapterSpec:
        """Every default filled in: alpha = 2 x rank, the preset's targets."""
        return replace(self, alpha=self.alpha if self.alpha is not None else 2 * self.rank,
                       targets=tuple(self.targets or default_targets))

    @property
    def scaling(self) -> float:
        """What the adapter's update is multiplied by: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
        alpha = self.alpha if self.alpha is not None else 2 * self.rank
        return alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def lora_config(self, task_type: str, modules_to_save=None, fan_in_fan_out: bool = False):
        """peft's ``LoraConfig`` for this spec (resolve it first). ``fan_in_fan_out``: the adapted layers store
        their weight as (in, out), as GPT-2's Conv1D does."""
        from peft import LoraConfig

        targets = ALL_LINEAR if self.targets == (ALL_LINEAR,) else list(self.targets)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets, lora_dropout=self.dropout,
                          bias="none", task_type=task_type, modules_to_save=modules_to_save,
                          use_rslora=self.rslora, use_dora=self.dora, fan_in_fan_out=fan_in_fan_out)



# summary.json entries a model card shows, as "before -> after" where the run measured both
_CARD_SCORES = (("held-out loss", "eval_loss_before", "eval_loss"),
                ("held-out exact match", "exact_match_before", "exact_match_after"),
                ("training loss", "train_loss_first", "train_loss_final"))


def adapter_card(saved: dict, run_info: dict, summary: dict) -> str:
    """A model card (README.md) for an adapter saved in a results folder: base model, method, rank, targets, data,
    steps, held-out scores and the command that trained it. ``saved`` is the adapter's adapter_config.json (what
    peft will load), ``run_info`` the run's run.json and ``summary`` its summary."""
    from pathlib import Path

    config = run_info.get("config", {})
    base = saved.get("base_model_name_or_path")
    # a hub id travels; a local folder (the tiny preset's) is named by its preset, its path only a note
    local = base is not None and Path(str(base)).is_absolute()
    shown_base = (f"the `{config.get('preset')}` preset's model (loaded from `{base}` when trained)" if local
                  else f"`{base}` (preset `{config.get('preset')}`)")
    targets = saved.get("target_modules") or []
    variant = "".join(name for name, key in ((" (rsLoRA)", "use_rslora"), (" (DoRA)", "use_dora")) if saved.get(key))
    rows = [("base model", shown_base),
            ("method", summary.get("method", "lora")),
            ("rank, alpha", f"{saved.get('r')}, {saved.get('lora_alpha')}{variant}"),
            ("targets", targets if isinstance(targets, str) else ", ".join(sorted(targets))),
            ("data", config.get("data_file") or f"the course's instruction data for `{config.get('preset')}`"),
            ("steps", f"{summary.get('steps')} of {summary.get('effective_batch', '?')} examples each, on "
                      f"{summary.get('world_size', 1)} process(es)")]
    for label, before, after in _CARD_SCORES:
        if summary.get(after) is not None:
            start = f"{summary[before]:.4g} -> " if summary.get(before) is not None else ""
            rows.append((label, f"{start}{summary[after]:.4g}"))
    command = (run_info.get("launch") or {}).get("launcher") or " ".join(str(p) for p in run_info.get("command") or [])
    commit = f" at commit `{run_info['commit'][:12]}`" if run_info.get("commit") else ""
    table = "\n".join(f"| {label} | {value} |" for label, value in rows)
    front = "" if local else f"base_model: {base}\n"
    return f"""---
{front}library_name: peft
tags:
- lora
---

# LoRA adapter for {"the " + str(config.get("preset")) + " preset's model" if local else f"`{base}`"}

| | |
|---|---|
{table}

Trained with `{command}`{commit}. The results folder that holds this one has the run's settings (run.json),
metrics and summary.

```python
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer

model = AutoPeftModelForCausalLM.from_pretrained("path/to/adapter")  # loads the base model, then the adapter
tokenizer = AutoTokenizer.from_pretrained("path/to/adapter")          # saved beside the adapter
```
"""


def complete_adapter_folder(adapter_dir, tokenizer, run_info: dict, summary: dict) -> None:
    """Beside an adapter peft has saved: its tokenizer, and a model card (``adapter_card``) in place of peft's
    template, so ``AutoPeftModelForCausalLM`` and ``AutoTokenizer`` load the folder with nothing else."""
    import json
    from pathlib import Path

    adapter_dir = Path(adapter_dir)
    saved = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    tokenizer.save_pretrained(adapter_dir)
    (adapter_dir / "README.md").write_text(adapter_card(saved, run_info, summary), encoding="utf-8")
