"""A PEFT adapter as data: peft's own config file, or LoRA's fields as flags, in one frozen dataclass.

A method is named by peft's own config, a JSON file in peft's ``adapter_config.json`` format (``configs/peft/``
ships one per method the course uses): ``--adapter-config configs/peft/ia3.json``. Without a file the adapter is
LoRA, from the flags ``--rank``, ``--alpha``, ``--targets``, ``--dropout``, ``--rslora`` and ``--dora``, which also
override a LoRA file's fields when set (``--targets`` any method's target modules). The workflows record the
resolved config whole in run.json (``peft``), build the adapter from it, and the planner counts its parameters.
Adding a method is one JSON file; peft itself checks its fields when the model is built (``check_adapter``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from my_utils import UserError

ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer except the output head
LORA = "LORA"
# peft's methods that learn virtual tokens in front of the input instead of changing weights: no target modules,
# nothing to merge into the base model
PROMPT_LEARNING = ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "MULTITASK_PROMPT_TUNING", "ADAPTION_PROMPT", "CPT")
# the flag of each LoRA field, and its key in peft's LoraConfig
LORA_KEYS = {"rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "rslora": "use_rslora",
              "dora": "use_dora"}


def _setting(default, help: str):
    return field(default=default, metadata={"help": help})


def read_adapter_file(path: str) -> dict:
    """The fields of a peft adapter config file, with one sentence for a file that cannot be one: missing, not a
    JSON object, without a ``peft_type``, or with a number no method takes (a count such as ``r`` or
    ``num_virtual_tokens`` that is not a positive whole number; any other number negative or not finite, which peft
    passes on to torch, whose error is a traceback). peft checks the fields themselves (``check_adapter``)."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"The adapter config {path} does not exist; give a peft adapter_config.json, e.g. "
                        "configs/peft/lora.json.")
    try:
        fields_ = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"The adapter config {path} is not valid JSON ({e}); fix it or start from one in "
                        "configs/peft/.") from None
    if not isinstance(fields_, dict) or not isinstance(fields_.get("peft_type"), str):
        raise UserError(f"The adapter config {path} has no peft_type field naming its method (e.g. \"LORA\", "
                        "\"IA3\"); start from one in configs/peft/.")
    for key, value in fields_.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        count = key == "r" or key.startswith("num_")
        if not math.isfinite(value) or value < 0 or (count and (not isinstance(value, int) or value == 0)):
            raise UserError(f"The adapter config {path} sets {key} to {value!r}; it must be "
                            f"{'a positive whole number' if count else 'a finite number, at least 0'}.")
    return fields_


@dataclass(frozen=True)
class AdapterSpec:
    rank: int = _setting(8, "LoRA rank r")
    alpha: float | None = _setting(None, "LoRA alpha (default 2 x rank)")
    targets: tuple[str, ...] | None = _setting(
        None, f"module names to adapt, or {ALL_LINEAR} (default: the preset's for LoRA, peft's for other methods)")
    dropout: float = _setting(0.0, "dropout on the adapter's input")
    rslora: bool = _setting(False, "rank-stabilised LoRA: scale the update by alpha / sqrt(rank), not alpha / rank")
    dora: bool = _setting(False, "DoRA: learn each weight's magnitude apart from its direction (peft's use_dora)")
    adapter_config: str | None = _setting(
        None, "a peft adapter config file naming the method and its fields (configs/peft/*.json); the LoRA flags "
              "above override a LoRA file's fields where set (default: LoRA from those flags)")
    # The resolved peft config (``resolved``): what run.json records and the adapter is built from. Not a flag.
    peft: dict | None = field(default=None, metadata={"help": None, "flag": False})

    @property
    def peft_type(self) -> str:
        """peft's name of the method: LORA, IA3, PROMPT_TUNING..."""
        if self.peft is not None:
            return self.peft["peft_type"]
        return read_adapter_file(self.adapter_config)["peft_type"] if self.adapter_config else LORA

    def _lora_flags_set(self) -> list[str]:
        """The LoRA flags set to something other than their default."""
        defaults = {f.name: f.default for f in fields(AdapterSpec)}
        return [name for name in LORA_KEYS if getattr(self, name) != defaults[name]]

    def check(self) -> None:
        """One sentence for a value that cannot work; the targets and peft's own fields are checked against the
        model elsewhere (``check_adapter``). A resolved spec was checked as it was resolved."""
        if self.peft is not None:
            return
        if self.adapter_config is not None:
            kind = read_adapter_file(self.adapter_config)["peft_type"]
            if kind != LORA and self._lora_flags_set():
                flag = self._lora_flags_set()[0]
                raise UserError(f"--{flag} sets a LoRA field, but {self.adapter_config} is {kind}; set that method's "
                                "fields in its file instead.")
            if kind in PROMPT_LEARNING and self.targets is not None:
                raise UserError(f"--targets names modules to adapt, but {self.adapter_config} is {kind}, which "
                                "learns virtual tokens and adapts no module; drop --targets.")
            if kind != LORA:
                return
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

    def check_lora_only(self, workflow: str) -> None:
        """``check``, and one sentence if the adapter is another method than LoRA, for a workflow that trains LoRA
        alone (its saving, sharding or head handling proven for LoRA only)."""
        self.check()
        if self.peft_type != LORA:
            raise UserError(f"The {workflow} workflow trains LoRA adapters (configs/peft/lora.json, dora.json); "
                            f"{self.adapter_config} is {self.peft_type}: train it with my_utils.workflows.lora.")

    def resolved(self, default_targets) -> AdapterSpec:
        """Every default filled in and the peft config settled (``peft``): a LoRA file's fields under the flags
        that are set, alpha = 2 x rank, the preset's targets where neither names any; another method's file as
        it is, ``--targets`` over its target modules (none: peft picks them for the architecture)."""
        if self.peft is not None:
            return self
        self.check()
        written = read_adapter_file(self.adapter_config) if self.adapter_config else {"peft_type": LORA}
        if written["peft_type"] != LORA:
            peft = dict(written, **({"target_modules": list(self.targets)} if self.targets else {}))
            return replace(self, rank=None, alpha=None, dropout=None, rslora=None, dora=None,
                           targets=_targets_tuple(peft.get("target_modules")), peft=peft)
        lora = {name: written.get(key, getattr(self, name)) for name, key in LORA_KEYS.items()}
        lora.update({name: getattr(self, name) for name in self._lora_flags_set()})
        targets = tuple(self.targets or _targets_tuple(written.get("target_modules")) or default_targets)
        try:  # the file's values, checked as the flags' are
            replace(self, adapter_config=None, **lora, targets=targets).check()
        except UserError as e:
            raise UserError(f"{self.adapter_config}: {e}" if self.adapter_config else str(e)) from None
        if lora["alpha"] is None:
            lora["alpha"] = 2 * lora["rank"]
        peft = {"bias": "none", **written, **{key: lora[name] for name, key in LORA_KEYS.items()},
                "target_modules": ALL_LINEAR if targets == (ALL_LINEAR,) else list(targets)}
        return replace(self, **lora, targets=targets, peft=peft)

    def record(self) -> dict:
        """The adapter as run.json records it: peft's resolved config (``peft``) and the file it was read from
        (``adapter_config``, None for LoRA from the flags), once; the flags that set it are not recorded again. A spec
        not resolved yet is its flags."""
        if self.peft is None:
            return {name: getattr(self, name) for name in (*LORA_KEYS, "targets", "adapter_config")}
        return {"adapter_config": self.adapter_config, "peft": self.peft}

    @property
    def scaling(self) -> float:
        """What a LoRA adapter's update is multiplied by: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
        alpha = self.alpha if self.alpha is not None else 2 * self.rank
        return alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def peft_config(self, task_type: str, modules_to_save=None, fan_in_fan_out: bool = False):
        """peft's config object for this spec (resolve it first); peft's one-line complaint about a field becomes a
        UserError naming the file. ``fan_in_fan_out``: the adapted layers store their weight as (in, out), as
        GPT-2's Conv1D does (for the methods that have the field)."""
        from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

        settings = dict(self.peft, task_type=task_type)
        config_class = PEFT_TYPE_TO_CONFIG_MAPPING.get(settings["peft_type"])
        source = self.adapter_config or "the LoRA flags"
        if config_class is None:
            raise UserError(f"{source} names an unknown peft_type {settings['peft_type']!r}; peft knows "
                            f"{', '.join(sorted(PEFT_TYPE_TO_CONFIG_MAPPING))}.")
        known = {f.name for f in fields(config_class)}
        unknown = sorted(set(settings) - known - {"peft_type"})
        if unknown:
            raise UserError(f"{source} sets {unknown[0]!r}, which {config_class.__name__} does not have; remove it "
                            "or check the field's name in peft's documentation.")
        if modules_to_save is not None and "modules_to_save" in known:
            settings["modules_to_save"] = modules_to_save
        if fan_in_fan_out and "fan_in_fan_out" in known:
            settings["fan_in_fan_out"] = True
        settings.pop("peft_type")
        try:
            config = config_class(**settings)
        except (TypeError, ValueError) as e:
            raise UserError(f"peft rejects {source}: {e}".rstrip(".") + ".") from None
        return config


def method_label(method: str, quantize: str | None, peft: dict | None) -> str:
    """What tables call a run's method, from what it trained: ``full``; ``qlora-4bit``/``qlora-8bit`` for an
    adapter on quantized weights; else the adapter's method (``lora``, ``ia3``...), ``dora`` for DoRA."""
    if method == "full" or peft is None:
        return method
    if quantize not in (None, "none"):
        return f"qlora-{quantize}"
    return "dora" if peft.get("use_dora") else peft["peft_type"].lower()


def _targets_tuple(target_modules) -> tuple[str, ...] | None:
    """peft's target_modules (a list, one name, or None) as the spec's targets."""
    if target_modules is None:
        return None
    return (target_modules,) if isinstance(target_modules, str) else tuple(target_modules)


# summary.json entries a model card shows, as "before -> after" where the run measured both
_CARD_SCORES = (("held-out loss", "eval_loss_before", "eval_loss"),
                ("held-out exact match", "exact_match_before", "exact_match_after"),
                ("training loss", "train_loss_first", "train_loss_final"))


def adapter_card(saved: dict, run_info: dict, summary: dict) -> str:
    """A model card (README.md) for an adapter saved in a results folder: base model, method, rank, targets, data,
    steps, held-out scores and the command that trained it. ``saved`` is the adapter's adapter_config.json (what
    peft will load), ``run_info`` the run's run.json and ``summary`` its summary."""
    config = run_info.get("config", {})
    base = saved.get("base_model_name_or_path")
    # a hub id travels; a local folder (the tiny preset's) is named by its preset, its path only a note
    local = base is not None and Path(str(base)).is_absolute()
    shown_base = (f"the `{config.get('preset')}` preset's model (loaded from `{base}` when trained)" if local
                  else f"`{base}` (preset `{config.get('preset')}`)")
    targets = saved.get("target_modules") or []
    kind = saved.get("peft_type", LORA)
    variant = "".join(name for name, key in ((" (rsLoRA)", "use_rslora"), (" (DoRA)", "use_dora")) if saved.get(key))
    label = method_label(config.get("method", "lora"), config.get("quantize"), saved)
    rows = [("base model", shown_base), ("method", label), ("peft_type", kind)]
    if kind == LORA:
        rows.append(("rank, alpha", f"{saved.get('r')}, {saved.get('lora_alpha')}{variant}"))
    if kind in PROMPT_LEARNING:
        rows.append(("virtual tokens", saved.get("num_virtual_tokens")))
    else:
        rows.append(("targets", targets if isinstance(targets, str) else ", ".join(sorted(targets))))
    rows += [("data", config.get("data_file") or f"the course's instruction data for `{config.get('preset')}`"),
             ("steps", f"{summary.get('steps')} of {summary.get('global_batch_size', '?')} examples each, on "
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
- {kind.lower()}
---

# {kind} adapter for {"the " + str(config.get("preset")) + " preset's model" if local else f"`{base}`"}

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
    adapter_dir = Path(adapter_dir)
    saved = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    tokenizer.save_pretrained(adapter_dir)
    (adapter_dir / "README.md").write_text(adapter_card(saved, run_info, summary), encoding="utf-8")
