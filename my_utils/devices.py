"""Which devices this machine has, and where each process should put its model.

    python -m my_utils env            # prints the inventory as a table

``per_rank_device_map`` is the DDP rule: every process holds a whole copy of the model on the device of
its *local* rank (the rank within its machine, so that it is right on several machines too).
``device_map="auto"`` spreads one model over all devices and must not be used with several processes.
"""

from __future__ import annotations

import os
import platform

from my_utils import UserError


def cuda_available() -> bool:
    """True when CUDA devices exist. Safe before ``notebook_launcher``: it does not create a CUDA context."""
    import torch

    return torch.cuda.is_available()


def device_kind() -> str:
    """'cuda' when GPUs are present, else 'cpu' (used in run-folder names)."""
    return "cuda" if cuda_available() else "cpu"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """CPU cores this process may run on (respects affinity masks and container limits where visible)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def device_inventory() -> list[dict]:
    """One dict per device: kind, index, name, total memory in bytes (CPU: system memory and core count)."""
    import psutil

    devices = [
        {
            "kind": "cpu",
            "index": None,
            "name": cpu_name(),
            "cores": usable_cores(),
            "total_memory": psutil.virtual_memory().total,
        }
    ]
    if cuda_available():
        import torch

        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append(
                {"kind": "cuda", "index": i, "name": props.name, "cores": None, "total_memory": props.total_memory}
            )
    return devices


def local_rank() -> int:
    """This process's rank within its machine (LOCAL_RANK from the launcher; 0 when not launched)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def per_rank_device(rank: int | None = None) -> str:
    """The device string for one process: 'cuda:<local rank>' on GPUs, 'cpu' otherwise."""
    rank = local_rank() if rank is None else rank
    return f"cuda:{rank}" if cuda_available() else "cpu"


def per_rank_device_map(rank: int | None = None) -> dict:
    """A ``device_map`` that puts the whole model on this process's device: ``{"": "cuda:<local rank>"}``.

    Use it with ``from_pretrained(..., device_map=per_rank_device_map())`` under DDP, and for QLoRA, whose
    quantized weights must be placed at load time.
    """
    return {"": per_rank_device(rank)}


def check_device_map(device_map, world_size: int) -> None:
    """Refuse ``device_map="auto"`` (or any map over several devices) when several processes train."""
    if world_size > 1 and (device_map == "auto" or (isinstance(device_map, dict) and len(set(device_map.values())) > 1)):
        raise UserError(
            f'device_map={device_map!r} spreads one model over several devices, which cannot be combined with '
            f"{world_size} data-parallel processes; use my_utils.devices.per_rank_device_map() instead."
        )
