"""How a run stops: SIGTERM and Ctrl-C (at once, or after the current step while a Trainer can stop cleanly),
SIGUSR1 (a scheduler's warning before it preempts the job: the same stop, ending ``Preempted``), and the process
group's teardown after a run that ended well.

``my_utils.run.lifecycle.recorded`` installs ``on_sigterm``; ``my_utils.run.faults.StopOnSigterm`` lets a Trainer
defer it to the end of a step; ``my_utils.run.cli.run_main`` calls ``end_process_group`` after a successful run.
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager


# The exit code of a run preempted with a checkpoint: sysexits' EX_TEMPFAIL, "try again later". A job script
# requeues on it (configs/slurm/preemptible.sbatch), and on nothing else: a failure (1, 2) or a stop by hand (130)
# requeued would only fail or stop again.
PREEMPTED_EXIT = 75


class Preempted(KeyboardInterrupt):
    """SIGUSR1 stopped the run at the end of a step with a checkpoint there; ``--resume`` continues it."""


class Sigterm:
    """What the handler ``recorded`` installs for SIGTERM, Ctrl-C (SIGINT) and SIGUSR1 does: interrupt at once, or,
    while a Trainer can stop cleanly (``StopOnSigterm`` is active), ask it to stop after the current step. ``name``
    says which asked first (once the ranks agree on the stop, the strongest any rank had: ``faults.STOP_SIGNALS``)."""

    deferrable = False
    requested = False
    name = "SIGTERM"
    held = False  # inside ``signals_held``: a stop waits for the block's end
    pending = None  # the stop that arrived while held, by name


def on_sigterm(signum, frame):
    name = {signal.SIGINT: "Ctrl-C", signal.SIGUSR1: "SIGUSR1"}.get(signum, "SIGTERM")
    if Sigterm.held:
        Sigterm.pending = Sigterm.pending or name
        return
    if Sigterm.deferrable and not Sigterm.requested:
        Sigterm.requested, Sigterm.name = True, name
        again = {"Ctrl-C": " (press it again to stop at once)", "SIGTERM": " (send it again to stop at once)"}
        print(f"{name}: stopping after this step and saving a checkpoint{again.get(name, '')}", file=sys.stderr,
              flush=True)
        return
    # A launcher passing Ctrl-C on as SIGTERM is not a second ask, nor is SIGUSR1 again (``scancel --full`` sends it
    # to the batch shell, which forwards it, and to the job step): a warning never stops a run at once.
    if Sigterm.deferrable and (name != Sigterm.name or name == "SIGUSR1"):
        return
    raise KeyboardInterrupt(name)


@contextmanager
def signals_held(then_stop: bool = True):
    """Run the block to its end whatever stop (SIGTERM, Ctrl-C, SIGUSR1) arrives meanwhile: one that does interrupts
    the run once the block is over, as it would have before it (or, with ``then_stop`` False, is dropped: the block
    ends the run anyway, e.g. recording its failure while the launcher stops the ranks)."""
    Sigterm.held, Sigterm.pending = True, None
    try:
        yield
    finally:
        Sigterm.held = False
    if Sigterm.pending and then_stop:
        raise KeyboardInterrupt(Sigterm.pending)


def end_process_group() -> None:
    """Destroy this process's process group, if it has one, after a successful run.

    torch asks every process to do this before it exits, so that pending communication finishes and the group's
    resources are released in order. (A worker also skips C++ teardown: ``run_as_script``.) Not called after an
    error: the other ranks may still be inside a collective.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
