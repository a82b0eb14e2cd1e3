"""What a process holds beside its tensors (the CUDA context, or a CPU process's baseline), and the memory of
the devices to fit."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import TYPE_CHECKING

from my_utils import UserError
from my_utils.core.memory import GiB, MiB
from my_utils.run.launch import clean_env

if TYPE_CHECKING:
    from my_utils.tools.planner.arithmetic import Plan

CUDA_CONTEXT = 600 * MiB  # CUDA context, cuBLAS workspace: on the device but outside torch's allocated bytes
# Usable memory of common GPUs, as torch reports it (a few percent under the marketing figure).
DEVICES = {
    "RTX-3070": 7.8 * GiB,
    "T4": 14.6 * GiB,
    "V100-16GB": 15.8 * GiB,
    "V100-32GB": 31.7 * GiB,
    "L4": 22.0 * GiB,
    "A10G": 22.0 * GiB,
    "RTX-3090": 23.6 * GiB,
    "RTX-4090": 23.6 * GiB,
    "A100-40GB": 39.4 * GiB,
    "A100-80GB": 79.2 * GiB,
    "H100": 79.1 * GiB,
    "H200": 139.8 * GiB,
}


BASELINE_IMPORTS = "import torch, transformers, accelerate, peft; from transformers import Trainer"


def measure_baseline_rss(quantize: str = "none") -> int:
    """Resident memory of a fresh Python process that has imported the training stack (torch, transformers,
    the Trainer, accelerate, peft; bitsandbytes for a quantized run) and run one small backward pass (which
    loads the compute kernels): what a CPU training process holds before its model and data."""
    code = (
        f"{BASELINE_IMPORTS}\n"
        + ("import bitsandbytes\n" if quantize != "none" else "")
        + "layer = torch.nn.Linear(64, 64)\n"
        + "torch.optim.AdamW(layer.parameters(), fused=True).zero_grad()\n"
        + "layer(torch.randn(8, 64)).sum().backward()\n"
        + "from my_utils.core.memory import process_rss\n"
        + "print(process_rss())\n"
    )

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), check=True)
    return int(out.stdout.strip().splitlines()[-1])


def with_runtime(p: Plan, device: str = "cuda", baseline: int | None = None) -> Plan:
    """Add what a process holds beside its tensors: on a GPU the CUDA context, on a CPU ``baseline`` (measure it
    with ``measure_baseline_rss``)."""
    if device == "cpu":
        if baseline is not None:
            p.overhead, p.overhead_what = baseline, "process baseline: Python, torch, libraries (measured)"
    else:
        p.overhead, p.overhead_what = CUDA_CONTEXT, "CUDA context and workspaces (typical)"
    return p


def parse_size(text: str) -> float:
    """'24GiB', '16GB', '512MiB', '1.5e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise UserError(f"Cannot read the memory size {text!r}; write it like 24GiB, 16GB or 512MiB.")
    number, unit = float(m.group(1)), (m.group(2) or "B").upper().rstrip("B")
    if number <= 0:
        raise UserError(f"The memory size {text!r} is not positive; give the memory to fit, like 24GiB.")
    if not unit:
        return number
    base = 1024 if unit.endswith("I") else 1000
    return number * base ** ("KMGT".index(unit[0]) + 1)


def device_memory(name: str) -> tuple[str, float]:
    """The name as listed and the usable bytes of a GPU ('T4', 'a100-40gb', ...)."""
    for known, size in DEVICES.items():
        if known.lower() == name.lower():
            return known, size
    raise UserError(f"Unknown device {name!r}; choose one of {', '.join(DEVICES)}, or give --memory 24GiB.")
