"""Plumbing shared by every workflow: opening a results folder from rank 0, the learning-rate scaling rule,
and turning a run's outcome into its status.
"""

from __future__ import annotations

import math
import signal
from contextlib import contextmanager
from pathlib import Path

from my_utils import UserError
from my_utils.runs import Run, check_new_run_dir, unique_dir

LR_SCALING = ("none", "linear", "sqrt")


def scale_learning_rate(base_lr: float, effective_batch: int, base_batch: int, rule: str = "none") -> float:
    """Scale a learning rate tuned for ``base_batch`` to ``effective_batch`` (= batch x accumulation x processes).

    'linear' multiplies by the batch ratio (Goyal et al., for SGD), 'sqrt' by its square root (often better
    for Adam), 'none' keeps it.
    """
    if rule not in LR_SCALING:
        raise UserError(f"Unknown learning-rate scaling {rule!r}; choose one of {', '.join(LR_SCALING)}.")
    ratio = effective_batch / base_batch
    return base_lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def check_positive(name: str, value, kind=int) -> None:
    """One sentence for a count or size that is not a positive number."""
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or value <= 0:
        raise UserError(f"{name} must be a positive {'number' if kind is float else 'integer'}, got {value!r}.")


def open_run(path: str | Path | None, default: str | Path, config: dict, **fields) -> tuple[Run | None, Path]:
    """Create the results folder on rank 0 and agree on it across ranks.

    ``path`` None picks ``default`` (or ``default_2``... if taken); an explicit path that exists is refused on
    every rank with the same sentence, and nothing is written. Returns (the Run on rank 0 or None elsewhere,
    the agreed folder).
    """
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    state = PartialState()
    outcome = [None, None]  # [path, error]
    if state.is_main_process:
        try:
            target = check_new_run_dir(path) if path else unique_dir(default)
            run = Run.create(target, config=config, **fields)
            outcome = [str(target), None]
        except UserError as e:
            outcome = [None, str(e)]
    if state.num_processes > 1:
        broadcast_object_list(outcome)
    if outcome[1]:
        raise UserError(outcome[1])
    return (run if state.is_main_process else None), Path(outcome[0])


@contextmanager
def recorded(run: Run | None):
    """Mark ``run`` failed (exception) or interrupted (Ctrl-C, SIGTERM) if the body does not finish.

    SIGTERM is turned into KeyboardInterrupt so that a preempted job leaves status 'interrupted' and no
    half-written summary, then exits non-zero.
    """
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread (e.g. some notebook launch paths): keep the default
        previous = None
    try:
        yield run
    except KeyboardInterrupt as e:
        if run is not None:
            run.fail(f"interrupted: {e}", status="interrupted")
        raise
    except BaseException as e:
        if run is not None:
            run.fail(f"{type(e).__name__}: {e}")
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
