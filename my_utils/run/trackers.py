"""``--report-to``: experiment trackers (TensorBoard, trackio, W&B, MLflow...) beside a run's metrics.jsonl.

metrics.jsonl stays the source of truth: every line the run writes there (``Run.log_metrics``) also goes, as
numbers at its step, to the trackers named, which are accelerate's tracker classes opened on rank 0. Local
trackers (TensorBoard, aim) write under the results folder's ``trackers/``. A tracker that is not installed is
refused in one sentence before the run starts (accelerate itself would skip it without a word).

    pip install -e ".[tensorboard]"        # or trackio; wandb, mlflow... install as their docs say
    python -m my_utils.workflows.lora --preset tiny --max-steps 20 --report-to tensorboard
    tensorboard --logdir runs/lora/tiny_lora/trackers
"""

from __future__ import annotations

from pathlib import Path

from my_utils import UserError

# what --report-to takes: accelerate's trackers, plus "all" (every installed one) and "none"
TRACKERS = ("tensorboard", "trackio", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab")
# how to install each: the course's extras where it has one, else the tracker's own package
INSTALL = {"tensorboard": 'pip install -e ".[tensorboard]"', "trackio": 'pip install -e ".[trackio]"',
           "comet_ml": "pip install comet-ml"}


def check_report_to(names) -> tuple[str, ...]:
    """The trackers ``names`` asks for, each known and installed (``all``: every installed one; ``none`` or
    nothing: none); anything else is a UserError naming what to install."""
    names = tuple(names or ())
    if names in ((), ("none",)):
        return ()
    for name in names:
        if name not in (*TRACKERS, "all"):
            raise UserError(f"--report-to {name} is not a tracker; choose from none, all, {', '.join(TRACKERS)}.")
    from accelerate.tracking import get_available_trackers

    installed = [str(t) for t in get_available_trackers()]
    if "all" in names:
        return tuple(t for t in TRACKERS if t in installed)
    for name in names:
        if name not in installed:
            raise UserError(f"--report-to {name}: {name} is not installed; {INSTALL.get(name, f'pip install {name}')} "
                            "first, or leave it out (metrics.jsonl is always written).")
    return tuple(dict.fromkeys(names))


def open_trackers(names, folder: Path, run_name: str) -> list:
    """Started accelerate trackers for ``names`` (checked by ``check_report_to``), local ones writing under
    ``folder``/trackers, each with the run's name."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    trackers = []
    for name in check_report_to(names):
        kind = LOGGER_TYPE_TO_CLASS[name]
        tracker = kind(run_name, folder / "trackers") if kind.requires_logging_directory else kind(run_name)
        tracker.start()
        trackers.append(tracker)
    return trackers


def numbers(record: dict) -> dict:
    """The values of a metrics line that trackers plot: numbers other than the step and the wall-clock time."""
    return {k: v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time")}
