"""A run against its plan: the plan for what a LoRA-workflow run did, beside what it measured from its tensors."""

from __future__ import annotations

from typing import NamedTuple

from my_utils import UserError
from my_utils.core.records import adapter_spec_of, method_of
from my_utils.tools.planner.arithmetic import Plan
from my_utils.tools.planner.settings import plan


class Row(NamedTuple):
    component: str
    measured: float  # bytes, from the run's tensors
    predicted: float  # bytes, from the plan
    ratio: float  # predicted / measured


# (component, key in a run's memory breakdown, attribute of a Plan)
COMPARED = (("weights", "weights", "weights"), ("gradients", "gradients", "gradients"),
            ("optimizer states", "optimizer_states", "optimizer"),
            ("saved activations", "saved_activations", "saved_activations"))


def plan_for_run(run: dict, process: int = 0) -> Plan:
    """The plan for what a run of the LoRA workflow (``run``: its folder as ``load_run`` reads it) did on process
    ``process``: its preset, method, quantization, adapter, mixed precision, processes, device, and the shape of the
    first batch it trained on (the batch its memory callback measured the saved activations of)."""
    summary = run["summary"]
    if summary.get("workflow") != "lora" or not summary.get("first_batches"):
        raise UserError("Only a LoRA-workflow run (my_utils.workflows.lora) records what the plan needs; "
                        "pass the results folder of such a run, as load_run reads it.")
    quantization = summary["quantization"]
    first = summary["first_batches"][process]
    method = "full" if method_of(run["run"], summary) == "full" else "lora" if quantization is None else "qlora"
    return plan(summary["preset"], method, adapter=adapter_spec_of(run["run"]),
                quantize=None if quantization is None else f"{quantization['bits']}bit",
                batch_size=first["batch_size"], max_length=first["seq_len"],
                processes=summary["world_size"], gradient_checkpointing=summary.get("gradient_checkpointing", False),
                chunked_loss=summary.get("chunked_loss", False),  # runs from before it had the plain loss
                dtype="fp32" if summary["mixed_precision"] == "no" else "bf16",  # fp16 autocast: 2 bytes as bf16
                device="cuda" if summary["memory"][process]["end"]["device"].startswith("cuda") else "cpu")


def compare_with_run(run: dict, process: int = 0) -> list[Row]:
    """Each part a run measured from its tensors on process ``process`` (weights, gradients, optimizer states,
    saved activations) beside the plan for that run (``plan_for_run``). The process baseline and the DDP
    buckets are not tensors the run counts, so they are not compared."""
    p = plan_for_run(run, process)
    measured = run["summary"]["memory"][process]["breakdown"]
    return [Row(name, measured[key], getattr(p, attr), getattr(p, attr) / measured[key])
            for name, key, attr in COMPARED]
