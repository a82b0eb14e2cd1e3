"""Rank-prefixed printing for multi-process runs.

Each call writes one whole line with a single ``write`` so that lines from several processes never
interleave mid-line. ``print0`` prints on rank 0 only.

    from my_utils.core.printing import rank_print, print0, install_rank_print
    restore = install_rank_print()   # every print() now carries "[rank r/w]"
    ...
    restore()                        # back to the builtin print
"""

from __future__ import annotations

import builtins
import contextlib
import os
import sys

_builtin_print = builtins.print


def get_rank() -> int:
    """Global rank of this process: torch.distributed if initialized, else RANK from the launcher, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def get_world_size() -> int:
    """World size: torch.distributed if initialized, else WORLD_SIZE from the launcher, else 1."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_prefix() -> str:
    return f"[rank {get_rank()}/{get_world_size()}]"


def rank_print(*args, sep: str = " ", end: str = "\n", file=None, flush: bool = True) -> None:
    """Print with a rank prefix on every line, as one write call."""
    text = sep.join(str(a) for a in args)
    prefix = rank_prefix()
    body = "\n".join(f"{prefix} {line}" for line in text.split("\n"))
    stream = file if file is not None else sys.stdout
    stream.write(body + end)
    if flush:
        stream.flush()


def print0(*args, **kwargs) -> None:
    """Print only on rank 0 (no prefix): for messages that every rank would repeat."""
    if get_rank() == 0:
        kwargs.setdefault("flush", True)
        _builtin_print(*args, **kwargs)


def install_rank_print():
    """Make the builtin ``print`` rank-prefixed; returns a function that restores the original."""

    def prefixed_print(*args, sep=" ", end="\n", file=None, flush=True):
        rank_print(*args, sep=sep, end=end, file=file, flush=flush)

    builtins.print = prefixed_print
    return restore_print


def restore_print() -> None:
    """Undo ``install_rank_print``."""
    builtins.print = _builtin_print


@contextlib.contextmanager
def native_stderr_silenced():
    """Inside it, what C++ code writes to this process's stderr is dropped: torch's profiler (kineto) prints a line
    when it starts and stops, which no logging setting turns off. Python exceptions still propagate, and are printed
    after it."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
