"""What every lesson notebook uses: its folder for experiments, and the file of its checked claims."""

from __future__ import annotations

import os
from pathlib import Path

from my_utils.core.paths import RUNS_ROOT
from my_utils.run.results import atomic_write_json, unique_dir


def lesson_dir(lesson: str) -> Path:
    """Where a notebook writes its experiments: ``$COURSE_RUN_ROOT/<lesson>`` when the demo runs it, else
    ``runs/notebooks/<lesson>`` (``_2``, ``_3``... when run again by hand, so nothing is overwritten)."""
    root = Path(os.environ.get("COURSE_RUN_ROOT") or RUNS_ROOT / "notebooks")
    return unique_dir(root / lesson)


CLAIMS_FILE = "claims.json"


def record_claims(lesson: str | Path, claims: list[tuple[str, str]]) -> Path:
    """Write a lesson's checked claims to ``<lesson>/claims.json``: one (claim, measured figure) pair each.

    A notebook calls this in its closing cell, after the assertions that would fail if a claim were false, so
    the file exists only for claims that held; the README's series table is generated from the reference run's
    files (``scripts/update_readme.py``)."""
    path = Path(lesson) / CLAIMS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, [{"claim": claim, "figure": figure} for claim, figure in claims])
    return path
