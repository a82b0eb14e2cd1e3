"""Memory measurement that keeps its kinds apart: allocated, reserved, peak and process RSS.

On CUDA the numbers come from the caching allocator; on a CPU from the kernel: resident set size (RSS)
now and its high-water mark, which ``reset_peak`` resets through ``/proc/self/clear_refs`` so that a
peak belongs to one phase only. Touches CUDA only when CUDA was asked for.

    from my_utils.core.memory import reset_peak, snapshot
    reset_peak("cpu"); ...; print(snapshot("cpu"))
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

MiB = 1024**2
GiB = 1024**3


def _read_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def process_rss() -> int:
    """Resident set size of this process, in bytes."""
    return psutil.Process(os.getpid()).memory_info().rss


def process_peak_rss() -> int:
    """High-water mark of this process's RSS (since start, or since the last reset_peak), in bytes."""
    peak = _read_status_kib("VmHWM")
    if peak is not None:
        return peak
    import resource  # non-Linux fallback: ru_maxrss is kilobytes on Linux, bytes on macOS

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if os.uname().sysname == "Darwin" else 1024)


def _is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def reset_peak(device="cpu") -> bool:
    """Reset the peak counters for ``device``. Returns False where the CPU peak cannot be reset."""
    if _is_cuda(device):
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        # "5" resets the RSS high-water mark (VmHWM) of this process: Documentation/filesystems/proc.rst
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def snapshot(device="cpu") -> dict:
    """Memory figures for ``device`` in bytes: allocated, reserved, peak_allocated, peak_reserved, rss, peak_rss.

    On a CPU there is no allocator, so allocated/reserved are None and the process RSS carries the figure.
    """
    figures = {
        "device": str(device),
        "allocated": None,
        "reserved": None,
        "peak_allocated": None,
        "peak_reserved": None,
        "rss": process_rss(),
        "peak_rss": process_peak_rss(),
    }
    if _is_cuda(device):
        import torch

        figures.update(
            allocated=torch.cuda.memory_allocated(device),
            reserved=torch.cuda.memory_reserved(device),
            peak_allocated=torch.cuda.max_memory_allocated(device),
            peak_reserved=torch.cuda.max_memory_reserved(device),
        )
    return figures


def peak_bytes(figures: dict) -> int:
    """The one peak figure that matters for fitting: peak allocated on CUDA, peak RSS on a CPU."""
    return figures["peak_allocated"] if figures.get("peak_allocated") is not None else figures["peak_rss"]


def format_bytes(n: int | float | None) -> str:
    """Human-readable bytes: 1.5 GiB, 230.0 MiB, 12.0 KiB."""
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
