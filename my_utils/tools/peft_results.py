"""A results folder of the LoRA workflow in the layout of peft's ``method_comparison`` results, so that a tiny run
can sit beside the published ones (``python -m my_utils compare`` writes one per run), and the label that names a
run's PEFT method."""

from __future__ import annotations

import platform
from pathlib import Path

from my_utils.core.adapters import ALL_LINEAR
from my_utils.core.records import local_batch_of, settings_of
from my_utils.run.results import load_run, read_json


def adapter_file_label(row: dict) -> str:
    """A run's name in lesson 13, from its settings (``settings_of``): ``full``, or its adapter file's name (``lora``,
    ``ia3``...), with ``+all-linear`` where the targets say so and the name does not."""
    if row["method"] == "full":
        return "full"
    name = Path(row["adapter_config"]).stem if row.get("adapter_config") else "lora"
    named = ALL_LINEAR.replace("-", "_") in name  # a file of its own for all-linear (lora_all_linear.json)
    return f"{name}+{ALL_LINEAR}" if row.get("targets") in ([ALL_LINEAR], (ALL_LINEAR,)) and not named else name


def peft_results(folder: str | Path) -> dict:
    """The LoRA-workflow run in ``folder`` in the layout of peft's ``method_comparison`` results JSON (run_info,
    train_info, meta_info), with the tiny task's figures where peft's have theirs: held-out exact match as the test
    accuracy, the run's largest tensor memory (weights, gradients, optimizer states, saved activations: its own
    also when it shared a worker process) where peft reports the accelerator's peak."""
    folder = Path(folder)
    loaded = load_run(folder)
    run, summary = loaded["run"], loaded["summary"]
    config = run["config"]
    adapter_file = folder / "adapter" / "adapter_config.json"
    parts = summary["memory"][0]["breakdown"]
    label = adapter_file_label(settings_of(run))
    losses = [(m["step"], m["loss"]) for m in loaded["metrics"] if "loss" in m and "step" in m]
    return {
        "run_info": {
            "created_at": run.get("started"),
            "total_time": summary["runtime_s"],
            "experiment_name": f"{label}/{config['preset']}-lr_{summary['learning_rate']:g}",
            "train_config": {"model_id": config["preset"], "dtype": "float32" if summary["mixed_precision"] == "no"
                             else summary["mixed_precision"], "max_seq_length": summary["max_length"],
                             "batch_size": local_batch_of(summary), "max_steps": summary["steps"],
                             "seed": config["seed"], "optimizer_type": "AdamW",
                             "optimizer_kwargs": {"lr": summary["learning_rate"]},
                             "lr_scheduler": config["lr_scheduler"]},
            "peft_config": read_json(adapter_file) if adapter_file.is_file() else None,
            "error_msg": "",
        },
        "train_info": {
            "accelerator_memory_max": sum(parts[key] for key in ("weights", "gradients", "optimizer_states",
                                                                 "saved_activations")),
            "train_time": summary["runtime_s"],
            "file_size": summary["adapter_bytes"],
            "num_trainable_params": summary["trainable_params"],
            "num_total_params": summary["total_params"],
            "status": "success",
            "metrics": [{"step": step, "train loss": loss} for step, loss in losses] + [
                {"step": summary["steps"], "test accuracy": summary["exact_match_after"],
                 "test loss": summary["eval_loss"], "forgetting loss": summary.get("forgetting_loss_after")}],
        },
        "meta_info": {
            "package_info": {f"{name}-version": version for name, version in (run.get("versions") or {}).items()},
            "system_info": {"system": platform.system(), "machine": platform.machine(),
                            "accelerator": summary["memory"][0]["end"].get("device", "cpu")},
        },
    }
