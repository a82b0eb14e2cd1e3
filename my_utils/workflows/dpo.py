"""DPO (direct preference optimization) of a causal LM with a LoRA adapter, on one or several processes: trl's
``DPOTrainer`` on preference pairs (a prompt, the answer chosen, the answer rejected).

    python -m my_utils.workflows.dpo --preset tiny
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.dpo --preset tiny
    # the reference model as a separate copy of the base, instead of the base under the adapter switched off
    python -m my_utils.workflows.dpo --preset tiny --reference copy
    # a notebook
    from my_utils.run.launch import launch
    launch(train, Config(preset="tiny", local_batch_size=4), num_processes=2)

The loss compares the policy (the base with the adapter) with a reference (by default the same base with the
adapter switched off, so no second copy of the weights is held). The tiny preset ships its pairs
(``assets/tiny/data/preferences_*.jsonl``: its instruction rows' answers chosen, corruptions of them rejected); any
other data is a JSON-lines file of ``prompt``, ``chosen`` and ``rejected`` given by ``--data-file``.

Writes a results folder (run.json, metrics.jsonl with trl's rewards/accuracies and rewards/margins per logged step,
summary.json, the adapter) and returns its summary: the losses, the held-out pairs' reward accuracy and margin
after training, exact match and similarity of greedy answers (the chosen answer as the reference) before and after,
speed, memory on every process, and the bytes of the reference model's own tensors. ``--save-steps`` and
``--resume`` work as in ``my_utils.workflows.lora``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from my_utils.core.adapters import complete_adapter_folder
from my_utils.core.data import PREFERENCE_COLUMNS, check_enough_rows, load_preferences
from my_utils.core.devices import per_rank_device
from my_utils.core.models import add_adapter, build_causal_lm, count_parameters, load_tokenizer
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.printing import print0
from my_utils.run.callbacks import make_callbacks
from my_utils.run.cli import command_line
from my_utils.run.config import check_choice, check_positive, setting
from my_utils.run.faults import reliability_callbacks
from my_utils.run.lifecycle import join_world, resume_after_restart, run_lifecycle
from my_utils.workflows import post_training
from my_utils.workflows.ddp_common import worker_report, write_worker_report
from my_utils.workflows.lora import fit, generation_eval, save_adapter, stop_if_already_trained

REFERENCES = ("adapter", "copy")

DESCRIPTION = ("DPO of a causal LM with a LoRA adapter on preference pairs (trl's DPOTrainer). Writes a results "
               "folder and prints its summary. Launch with `ACCELERATE_USE_CPU=1 accelerate launch --config_file "
               "configs/cpu_x2.yaml -m my_utils.workflows.dpo ...` for several processes.")


@dataclass
class Config(post_training.PostTrainingSettings):
    TRAINING_DEFAULTS: ClassVar[dict] = {"local_batch_size": 8, "max_steps": 60}
    METHOD: ClassVar[str] = "lora"
    SETTING_HELP: ClassVar[dict] = {"local_batch_size": "preference pairs per process per micro-batch",
                                    "max_length": "tokens per prompt and answer (default: the preset's)",
                                    "eval_rows": "held-out pairs for reward accuracy, exact match and similarity"}
    beta: float = setting(0.1, "DPO's beta: how far the policy may move from the reference (larger: less far)")
    reference: str = setting("adapter", "adapter: the reference is the base with the adapter switched off (no "
                             "second copy); copy: a separate copy of the base", choices=REFERENCES)
    data_file: str | None = setting(None, "JSON-lines file of prompt, chosen, rejected (default: the preset's pairs)")


def validate(cfg: Config):
    """Check the settings before anything starts (nothing heavy imported, nothing written); returns the preset."""
    preset = post_training.check_settings(cfg, "dpo")
    check_positive("--beta", cfg.beta, float)
    check_choice("reference", cfg.reference, REFERENCES)
    return preset


resolve = post_training.resolve


def train(cfg: Config) -> dict:
    """Train the adapter by DPO and evaluate; returns the summary (on every process; process 0 also writes it)."""
    cfg = resume_after_restart(cfg)
    preset = validate(cfg)
    world_size = join_world(cfg.num_processes, cfg.timeout_s)
    cfg = resolve(cfg, preset, world_size)
    pairs, held_out = load_preferences(preset.instruction_data, eval_rows=cfg.eval_rows, path=cfg.data_file)
    check_enough_rows(len(pairs), cfg.global_batch(world_size))
    tokenizer = load_tokenizer(preset)

    from datasets import Dataset
    from transformers import set_seed
    from trl import DPOConfig, DPOTrainer

    set_seed(cfg.seed)
    device = per_rank_device()
    with run_lifecycle(cfg, world_size, default_dir=RUNS_ROOT / "dpo" / f"{cfg.preset}_{cfg.reference}",
                       checkpoints=post_training.CHECKPOINTS, workflow="dpo") as life:
        write_worker_report(life.folder, worker_report())
        # region: the policy and its reference
        model = build_causal_lm(preset, random_init=cfg.random_init)
        # "adapter": trl computes the reference's log-probabilities with the adapter switched off, on the same
        # weights; "copy": a second model, frozen, as DPO was first written
        ref_model = build_causal_lm(preset, random_init=cfg.random_init) if cfg.reference == "copy" else None
        model = add_adapter(model, cfg.adapter)
        # endregion
        params = count_parameters(model)
        print0(f"trainable parameters: {params['trainable']:,} of {params['total']:,}; beta {cfg.beta:g}; "
               f"reference: {cfg.reference}")
        held_out_rows = [{"prompt": p["prompt"], "output": p["chosen"]} for p in held_out]
        before = generation_eval(cfg, model.to(device), tokenizer, held_out_rows)
        memory_cb, metrics_cb = make_callbacks(life.run, device)
        reliability = reliability_callbacks(world_size)
        args = DPOConfig(**post_training.trl_arguments(cfg, life.folder), per_device_eval_batch_size=cfg.local_batch_size,
                         max_length=cfg.max_length, beta=cfg.beta,
                         dataloader_drop_last=True)  # the same pairs per step on every layout of one global batch
        trainer = DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=_as_dataset(Dataset, pairs),
                             eval_dataset=_as_dataset(Dataset, held_out), processing_class=tokenizer,
                             callbacks=[c for c in (stop_if_already_trained(), memory_cb, metrics_cb,
                                                    *reliability.values()) if c])
        result, runtime = fit(trainer, life.checkpoint, reliability["stop"])
        held_out_scores = trainer.evaluate()  # every process takes part: after training, never before (lora.py)
        quality = {"before": before, "after": generation_eval(cfg, trainer.model, tokenizer, held_out_rows)}
        summary = None
        if life.is_main:
            adapter_bytes = save_adapter(trainer.model, life.folder)
            summary = {"workflow": "dpo", "preset": cfg.preset,
                       **post_training.summary_fields(cfg, world_size, result, life.checkpoint, runtime,
                                                      memory_cb.report, quality, params, adapter_bytes, unit="pairs"),
                       **dpo_fields(cfg, trainer, held_out_scores)}
            complete_adapter_folder(life.folder / "adapter", tokenizer, life.run.info, summary)
        life.finish(summary)
    return life.summary


def _as_dataset(Dataset, pairs: list[dict]):
    """trl's preference columns only (a pair's ``corruption`` and ``family`` describe it; they do not train)."""
    return Dataset.from_list([{c: p[c] for c in PREFERENCE_COLUMNS} for p in pairs])


def reference_bytes(trainer) -> int:
    """Bytes of the tensors the reference model holds of its own: none when it is the policy's base with the
    adapter switched off."""
    ref = trainer.ref_model
    if ref is None:
        return 0
    return sum(t.numel() * t.element_size() for t in [*ref.parameters(), *ref.buffers()])


def dpo_fields(cfg: Config, trainer, held_out: dict) -> dict:
    """DPO's own summary fields: its settings, the losses and rewards logged, the held-out pairs' scores after
    training (trl's evaluation; before it, policy and reference are one model and every reward is 0) and the
    reference's bytes."""
    logged = [r for r in trainer.state.log_history if "loss" in r]
    return {
        "beta": cfg.beta,
        "reference": cfg.reference,
        "train_loss_first": logged[0]["loss"] if logged else None,
        "train_loss_final": logged[-1]["loss"] if logged else None,
        "reward_accuracy_first": logged[0].get("rewards/accuracies") if logged else None,
        "reward_accuracy_final": logged[-1].get("rewards/accuracies") if logged else None,
        "eval_loss": held_out.get("eval_loss"),
        "eval_reward_accuracy": held_out.get("eval_rewards/accuracies"),
        "eval_reward_margin": held_out.get("eval_rewards/margins"),
        "reference_bytes": reference_bytes(trainer),
    }


parse_args, main = command_line(Config, train, __name__, DESCRIPTION)
