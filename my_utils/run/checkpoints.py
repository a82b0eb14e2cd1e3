"""Checkpoints known to be whole: a manifest written after every save (each file's size and SHA-256), and the
newest whole one to resume from, verified against it."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from my_utils import UserError
from my_utils.run.results import atomic_write_json, now, read_json, unique_dir

CHECKPOINT_PREFIX = "checkpoint-"  # the Trainer's folder names: checkpoint-<step>
CHECKPOINT_MANIFEST = "checkpoint_complete.json"  # written last: a checkpoint without it was cut short
INCOMPLETE_PREFIX = "incomplete-"  # a cut-short checkpoint is renamed, never deleted, and never resumed from


def checkpoint_step(folder: str | Path) -> int | None:
    """The step of a ``checkpoint-<step>`` folder, else None."""
    m = re.fullmatch(re.escape(CHECKPOINT_PREFIX) + r"(\d+)", Path(folder).name)
    return int(m.group(1)) if m else None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run_id_of(checkpoint: str | Path) -> str | None:
    """The identity of the run a checkpoint folder lies in (``<run>/<checkpoints>/checkpoint-<step>``): its run.json's
    ``run_id``, or None for a checkpoint outside a results folder or a run from before run ids."""
    try:
        return read_json(Path(checkpoint).parent.parent / "run.json").get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def write_checkpoint_manifest(folder: str | Path) -> None:
    """Record every file of a finished checkpoint with its size and SHA-256, its step and the run it belongs to,
    sealed together (``manifest_seal``); written last, atomically."""
    folder = Path(folder)
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != CHECKPOINT_MANIFEST}
    manifest = {"step": checkpoint_step(folder), "run_id": run_id_of(folder), "written": now(), "files": files}
    atomic_write_json(folder / CHECKPOINT_MANIFEST, {**manifest, "seal": manifest_seal(manifest)})


def manifest_seal(manifest: dict) -> str:
    """The SHA-256 of a manifest's step, run and files together: a manifest edited after its save (a step changed
    to match a renamed folder, say) no longer matches its seal."""
    sealed = {key: manifest.get(key) for key in ("step", "run_id", "files")}
    return hashlib.sha256(json.dumps(sealed, sort_keys=True).encode("utf-8")).hexdigest()


def saved_step(checkpoint: str | Path) -> int:
    """The step a whole checkpoint (``checkpoint_problem`` None) was saved at, as its manifest says."""
    return int(read_json(Path(checkpoint) / CHECKPOINT_MANIFEST)["step"])


def rng_file(folder: str | Path, rank: int) -> Path:
    """Where a checkpoint keeps process ``rank``'s random-number state."""
    return Path(folder) / f"rng_state_{rank}.pt"


def save_rng_state(folder: str | Path, rank: int) -> None:
    """This process's random-number generators (Python, NumPy, torch on the CPU and on CUDA), so that a resumed
    run draws what the uninterrupted one would have (dropout masks, shuffles); tensors and lists only, loadable
    with ``weights_only``."""
    import random

    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": list(random.getstate()[1]), "python_version": random.getstate()[0],
             "python_gauss": random.getstate()[2], "numpy": torch.from_numpy(keys.astype(np.int64)),
             "numpy_rest": [pos, has_gauss, gauss], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    Path(folder).mkdir(parents=True, exist_ok=True)
    torch.save(state, rng_file(folder, rank))


def load_rng_state(folder: str | Path, rank: int) -> None:
    """Put back what ``save_rng_state`` saved for ``rank``."""
    import random

    import numpy as np
    import torch

    state = torch.load(rng_file(folder, rank), weights_only=True)
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    pos, has_gauss, gauss = state["numpy_rest"]
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_problem(folder: str | Path) -> str | None:
    """Why the checkpoint in ``folder`` cannot be resumed from (a few words), or None if every file it recorded
    is there with the same size and content. Nothing is loaded: a damaged file is found by its hash, before torch
    or safetensors ever reads it."""
    folder = Path(folder)
    try:
        manifest = read_json(folder / CHECKPOINT_MANIFEST)
        recorded = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in manifest["files"].items()}
    except FileNotFoundError:
        return "it was not finished (no manifest)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "its manifest is unreadable or has no content hashes"
    if manifest.get("seal") != manifest_seal(manifest):
        return "its manifest was changed after the save (its seal differs)"
    if manifest.get("step") != checkpoint_step(folder):  # a renamed folder would resume at a step it never reached
        return f"it was saved at step {manifest.get('step')}, not {checkpoint_step(folder)} as its name says"
    if "trainer_state.json" not in recorded:
        return "trainer_state.json is missing"
    for name, (size, sha256) in recorded.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes instead of {size}"
        if file_sha256(path) != sha256:
            return f"{name} changed since it was saved (its SHA-256 differs)"
    return None


def find_resume_checkpoint(checkpoints: str | Path) -> tuple[Path, list[tuple[str, str]]]:
    """The newest whole checkpoint under ``checkpoints`` and the newer ones passed over, as (name, why).

    Never falls back to a fresh start: no whole checkpoint raises UserError with one sentence.
    """
    checkpoints = Path(checkpoints)
    found = sorted((p for p in checkpoints.glob(CHECKPOINT_PREFIX + "*") if checkpoint_step(p) is not None),
                   key=checkpoint_step, reverse=True) if checkpoints.is_dir() else []
    skipped = []
    for folder in found:
        check_belongs(folder)
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder, skipped
        skipped.append((folder.name, problem))
    if not skipped:
        raise UserError(f"There is no checkpoint in {checkpoints} to resume from; rerun without --resume "
                        "and another --output-dir (add --save-steps N to checkpoint every N steps).")
    name, problem = skipped[0]
    raise UserError(f"No checkpoint in {checkpoints} can be resumed from ({name}: {problem}); rerun without "
                    "--resume and another --output-dir.")


def check_belongs(checkpoint: Path) -> None:
    """One sentence if ``checkpoint``'s manifest names another run than the results folder it lies in (a checkpoint
    copied from another run would resume silently with another run's weights, seed and data order)."""
    try:
        recorded = read_json(checkpoint / CHECKPOINT_MANIFEST).get("run_id")
    except (OSError, ValueError, AttributeError):
        return  # no manifest: checkpoint_problem says so
    mine = run_id_of(checkpoint)
    if recorded and mine and recorded != mine:
        raise UserError(f"{checkpoint} was saved by another run (run id {recorded}, this folder's is {mine}); move it "
                        "out of the folder, or resume the run it came from.")


def set_aside_incomplete(checkpoints: str | Path, names) -> list[str]:
    """Rename cut-short checkpoints to ``incomplete-checkpoint-<step>`` (kept for inspection, never resumed
    from, and out of the way of the Trainer, which will save that step again)."""
    moved = []
    for name in names:
        target = unique_dir(Path(checkpoints) / (INCOMPLETE_PREFIX + name))
        os.replace(Path(checkpoints) / name, target)
        moved.append(target.name)
    return moved


