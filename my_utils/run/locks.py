"""The writer's lock of a results folder: one process writes a folder at a time, and a reader tells a live writer
from a dead one (a run left ``running`` by a killed process is ``crashed``)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from my_utils import UserError

# Results folders this process writes, each with its locked descriptor (see ``hold_folder``).
_HELD: dict[str, int] = {}


def hold_folder(folder: str | Path, what: str = "The results folder") -> None:
    """Take the writer's lock on ``folder`` for as long as this process writes it: an OS lock on the folder itself
    (``flock``), which ends with the process however it ends (SIGKILL, a reboot), so that no second writer can take
    the folder over and a dead writer is never taken for a live one (a reused process id is). One sentence if
    another process holds it."""
    import fcntl

    key = os.path.realpath(folder)
    if key in _HELD:
        return
    fd = os.open(folder, os.O_RDONLY)  # not inherited by the processes this one starts
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"{what} {folder} is being written by another process right now; let it finish, or stop "
                        "it, before running this command again.") from None
    _HELD[key] = fd


def release_folder(folder: str | Path) -> None:
    """Give back the writer's lock on ``folder`` (the run it holds is finished)."""
    fd = _HELD.pop(os.path.realpath(folder), None)
    if fd is not None:
        os.close(fd)


def writer_alive(folder: str | Path) -> bool | None:
    """Whether a process holds the writer's lock on ``folder`` (this one included); None where it cannot be told."""
    import fcntl

    if os.path.realpath(folder) in _HELD:
        return True
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock taken above, if any


def owner_alive(info: dict, folder: str | Path | None = None) -> bool | None:
    """Whether the process that writes a run is alive: from the folder's writer lock where the run took one (run.json
    says ``writer_lock``), else from its pid; None when it cannot be known here (another machine, no pid)."""
    if info.get("host") != socket.gethostname():
        return None
    if folder is not None and info.get("writer_lock"):
        return writer_alive(folder)
    if not isinstance(info.get("pid"), int):
        return None
    try:
        os.kill(info["pid"], 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def current_status(info: dict, folder: str | Path | None = None) -> str:
    """A run's status as every reader should see it: a run whose summary.json holds its summary is ``complete``
    (whatever stopped it between that write and run.json's), and ``running`` whose writer is gone (SIGKILL, a full
    disk, a lost machine's process on this one) is ``crashed``. Give the run's ``folder`` for both."""
    if folder is not None and has_summary(folder):
        return "complete"
    status = info.get("status")
    return "crashed" if status == "running" and owner_alive(info, folder) is False else status


def has_summary(folder: str | Path) -> bool:
    """Whether ``folder/summary.json`` holds a JSON object: the last thing a run writes, so a run that has it is
    complete."""
    try:
        return isinstance(json.loads((Path(folder) / "summary.json").read_text(encoding="utf-8")), dict)
    except (OSError, ValueError):
        return False
