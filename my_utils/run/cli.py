"""Command-line plumbing shared by the workflows and ``python -m my_utils``: bad input becomes one sentence
on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import os
import sys

from my_utils import JobFailed, NothingToDo, UserError
from my_utils.run.faults import RankFailure, first_to_say
from my_utils.run.results import redact_secrets
from my_utils.run.signals import end_process_group


def format_summary(summary: dict) -> str:
    """A two-column text table of a summary's scalar entries."""
    rows = [(k, v) for k, v in summary.items() if not isinstance(v, (list, dict))]
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k:<{width}}  {f'{v:.4g}' if isinstance(v, float) else v}" for k, v in rows)


def run_main(body, prefix: str = "my_utils"):
    """Run ``body()``; print its summary on rank 0; turn UserError into a one-line message and exit 2 (exit 0 for
    NothingToDo), JobFailed or a stopped rank (RankFailure, already recorded in the run) into a one-line message
    and exit 1, and Ctrl-C or SIGTERM into one line and exit 130."""
    from my_utils.core.printing import print0

    try:
        summary = body()
    except UserError as e:  # it may quote a path or a value that holds a secret
        done = isinstance(e, NothingToDo)
        message = f"{prefix}: {'' if done else 'error: '}{redact_secrets(str(e))}"
        if first_to_say(message):  # once per job, not once per rank
            print(message, file=sys.stderr, flush=True)
        raise SystemExit(0 if done else 2) from None
    except JobFailed as e:
        print(f"{prefix}: error: {redact_secrets(str(e))}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (``recorded`` has marked the run interrupted): one line
        print(f"{prefix}: interrupted ({str(e) or 'Ctrl-C'})", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except RankFailure as e:
        # A fault, not a bug: one line, and the stopped rank ends first, so the launcher names it too.
        print(f"{prefix}: error: {e}", file=sys.stderr, flush=True)
        e.end_stopped_ranks()
        raise SystemExit(1) from None
    end_process_group()
    if isinstance(summary, dict):
        print0(format_summary(summary))
    return summary


def run_as_script(main) -> None:
    """What a workflow module, and the course's command line, run as ``python -m`` (alone, or as a worker of
    ``torchrun`` or ``accelerate launch``): ``main()``, then the end of the process without the interpreter's
    teardown (``os._exit`` with main's exit code, after flushing the output).

    Even with its process group destroyed, a process that communicated over gloo (DDP, pipelining, FSDP, an
    accelerate loop) sometimes aborts in C++ teardown at interpreter exit ("terminate called without an active
    exception"), after its results are written; the launcher then reports the whole job as failed. Everything a
    workflow writes is closed when ``main`` returns, so there is nothing left for that teardown to do. Any other
    exception than SystemExit is a bug and ends the process the usual way, with its traceback.
    """
    try:
        main()
        code = 0
    except SystemExit as e:  # run_main's exit codes 1 and 2; argparse's 0 (--help) and 2
        if not (e.code is None or isinstance(e.code, int)):
            raise
        code = e.code or 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
