"""Command-line plumbing shared by the workflows and ``python -m my_utils``: bad input becomes one sentence
on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import errno
import os
import signal
import sys

from my_utils import JobFailed, NothingToDo, UserError
from my_utils.core.printing import print0
from my_utils.run.config import parse_config
from my_utils.run.faults import RankFailure, first_to_say, name_lost_ranks, name_stopped_ranks
from my_utils.run.redaction import redact_secrets
from my_utils.run.signals import PREEMPTED_EXIT, Preempted, end_process_group


def format_summary(summary: dict) -> str:
    """A two-column text table of a summary's scalar entries."""
    rows = [(k, v) for k, v in summary.items() if not isinstance(v, (list, dict))]
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k:<{width}}  {f'{v:.4g}' if isinstance(v, float) else v}" for k, v in rows)


# The file system's refusals: a full disk or quota, a read-only or forbidden folder. Not bugs: one sentence each.
FILE_SYSTEM_REFUSALS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def file_system_refusal(e: OSError) -> str | None:
    """The one sentence for ``e`` if the file system refused a write (``FILE_SYSTEM_REFUSALS``); None otherwise."""
    if e.errno not in FILE_SYSTEM_REFUSALS:
        return None
    where = f" writing {e.filename}" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"The disk is full{where} ({e.strerror}); free space there, or choose a results folder on another "
                "disk, and run again.")
    return (f"The file system refused{where} ({e.strerror}); choose a results folder where you can write (or run "
            "from one, for a command that writes where it runs).")


def record_failure(error: BaseException) -> None:
    """Write ``error`` (its message and traceback) to torchelastic's error file where the launcher (torchrun,
    accelerate launch) asked for one, as torch's ``@record`` does: the launcher's failure summary then shows it as
    the root cause, with the file's path, in place of "To enable traceback see ..."."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        handler = get_error_handler()
        handler.initialize()
        handler.record_exception(error)


def end_with(failure: RankFailure, prefix: str):
    """A stopped rank is a fault, not a bug: one line, its error file for the launcher, and the stopped rank ended
    first, so that the launcher names it too; exit 1."""
    print(f"{prefix}: error: {failure}", file=sys.stderr, flush=True)
    record_failure(failure)
    try:  # all is said; the launcher's SIGTERM, which the stopped rank's end brings, waits for this rank's own exit
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # code (1, with its error file): the launcher reports that
    except ValueError:  # not the main thread
        pass
    failure.end_stopped_ranks()
    raise SystemExit(1) from None


def run_main(body, prefix: str = "my_utils"):
    """Run ``body()``; print its summary on rank 0; turn UserError, and a write the file system refused (a full
    disk, a read-only folder: the run, if any, already marked failed), into a one-line message and exit 2 (exit 0 for
    NothingToDo), JobFailed or a stopped rank (RankFailure, already recorded in the run) into a one-line message
    and exit 1, Ctrl-C or SIGTERM into one line and exit 130, and a preemption with a checkpoint (SIGUSR1) into one
    line saying how to resume and exit ``PREEMPTED_EXIT`` (75)."""
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
    except OSError as e:
        sentence = file_system_refusal(e)
        if sentence is None:
            raise
        print(f"{prefix}: error: {redact_secrets(sentence)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except Preempted as e:  # SIGUSR1, stopped at a step with a checkpoint there (the run is marked interrupted)
        print(f"{prefix}: preempted ({e})", file=sys.stderr, flush=True)
        raise SystemExit(PREEMPTED_EXIT) from None
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (``recorded`` has marked the run interrupted): one line
        failure = name_lost_ranks(e)  # or the launcher stopped this rank because another died (during set-up)
        if failure is None:
            message = f"{prefix}: interrupted ({str(e) or 'Ctrl-C'})"
            if first_to_say(message):  # once per job, not once per rank
                print(message, file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        end_with(failure, prefix)
    except Exception as e:
        failure = name_stopped_ranks(e)  # a stopped rank, named during the run or (here) during set-up
        if failure is None:
            raise
        end_with(failure, prefix)
    end_process_group()
    if isinstance(summary, dict):
        print0(format_summary(summary))
    return summary


def command_line(config_class, train, module: str, description: str):
    """A workflow's command line: ``(parse_args, main)`` for the module called ``module`` (its ``__name__``).

    ``parse_args(argv)`` is its ``Config`` from flags (``--help`` shows ``description``); ``main(argv)`` trains with
    it through ``run_main`` (one-line errors prefixed with the module's last name) and returns the summary. Run as
    ``python -m`` (``module == "__main__"``), the module's last statement, this call, runs ``main`` as a script
    (``run_as_script``) and does not return.
    """
    name = sys.modules[module].__spec__.name if module == "__main__" else module

    def parse_args(argv=None):
        return parse_config(config_class, argv, prog=f"python -m {name}", description=description)

    def main(argv=None) -> dict:
        return run_main(lambda: train(parse_args(argv)), prefix=name.rsplit(".", 1)[-1])

    if module == "__main__":
        run_as_script(main)
    return parse_args, main


def run_as_script(main) -> None:
    """What a workflow module, and the course's command line, run as ``python -m`` (alone, or as a worker of
    ``torchrun`` or ``accelerate launch``): ``main()``, then the end of the process without the interpreter's
    teardown (``os._exit`` with main's exit code, after flushing the output).

    Even with its process group destroyed, a process that communicated over gloo (DDP, pipelining, FSDP, an
    accelerate loop) sometimes aborts in C++ teardown at interpreter exit ("terminate called without an active
    exception"), after its results are written; the launcher then reports the whole job as failed. Everything a
    workflow writes is closed when ``main`` returns, so there is nothing left for that teardown to do. Any other
    exception than SystemExit is a bug and ends the process the usual way, with its traceback (also written to
    the launcher's error file, ``record_failure``).
    """
    try:
        main()
        code = 0
    except SystemExit as e:  # run_main's exit codes 1 and 2; argparse's 0 (--help) and 2
        if not (e.code is None or isinstance(e.code, int)):
            raise
        code = e.code or 0
    except BaseException as e:  # a bug: its traceback on stderr as usual, and in the launcher's error file
        record_failure(e)
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
