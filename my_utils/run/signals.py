"""How a run stops: SIGTERM and Ctrl-C (at once, or after the current step while a Trainer can stop cleanly), and
the process group's teardown after a run that ended well.

``my_utils.run.lifecycle.recorded`` installs ``on_sigterm``; ``my_utils.run.faults.StopOnSigterm`` lets a Trainer
defer it to the end of a step; ``my_utils.run.cli.run_main`` calls ``end_process_group`` after a successful run.
"""

from __future__ import annotations

import signal
import sys


class Sigterm:
    """What the handler ``recorded`` installs for SIGTERM and Ctrl-C (SIGINT) does: interrupt at once, or, while a
    Trainer can stop cleanly (``StopOnSigterm`` is active), ask it to stop after the current step. ``name`` says
    which asked first."""

    deferrable = False
    requested = False
    name = "SIGTERM"


def on_sigterm(signum, frame):
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    if Sigterm.deferrable and not Sigterm.requested:
        Sigterm.requested, Sigterm.name = True, name
        print(f"{name}: stopping after this step and saving a checkpoint ({'press it' if name == 'Ctrl-C' else 'send it'}"
              " again to stop at once)", file=sys.stderr, flush=True)
        return
    if Sigterm.deferrable and name != Sigterm.name:  # a launcher passing Ctrl-C on as SIGTERM: not a second ask
        return
    raise KeyboardInterrupt(name)


def end_process_group() -> None:
    """Destroy this process's process group, if it has one, after a successful run.

    torch asks every process to do this before it exits, so that pending communication finishes and the group's
    resources are released in order. (A worker also skips C++ teardown: ``run_as_script``.) Not called after an
    error: the other ranks may still be inside a collective.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
