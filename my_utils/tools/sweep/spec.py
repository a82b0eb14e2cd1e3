"""A sweep's declaration: a preset, the options every cell shares, grids of options; its cells, their folder
names and command lines."""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import re
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path, PurePath

from my_utils import UserError
from my_utils.core.devices import meta_model
from my_utils.core.models import check_lora_targets
from my_utils.core.presets import get_preset
from my_utils.run.config import RunSettings, TrainingSettings, config_parser
from my_utils.run.launch import accelerate_command
from my_utils.run.redaction import hash_secrets
from my_utils.workflows.lora import DESCRIPTION, Config, parse_args, validate


WORKFLOW = "my_utils.workflows.lora"
# Options the sweep gives every cell itself.
SET_BY_SWEEP = ("preset", "output_dir", "num_processes", "resume")
# Grids to run when none are given: ranks at a fixed alpha (the update's scale then falls as 1/rank, so that a
# rank's quality is not its step size), a dense range on the tiny model, the classic assignment's on real models.
DEFAULT_GRIDS = {"tiny": [{"rank": [1, 4, 16, 64], "alpha": [32]}]}
REAL_MODEL_GRIDS = [{"rank": [8, 128, 256], "alpha": [16]}]
# The options every cell shares when none are given: few steps on the tiny model, so that a sweep takes a minute, in
# fp32 (its matrices are too small for bf16 autocast to pay for itself).
DEFAULT_ARGS = {"tiny": {"max_steps": 40, "eval_rows": 100, "logging_steps": 5, "mixed_precision": "no"}}
# Short names of options in a cell's folder name (the others keep theirs).
SHORT_NAMES = {"learning_rate": "lr", "max_steps": "steps", "local_batch_size": "batch"}


def workflow_options() -> dict:
    """The workflow's options, in its order: the command line ``parse_config`` generates from its Config (the
    adapter's fields included), name -> argparse action. A field added to the Config or to ``AdapterSpec`` is an
    option here with no edit."""
    parser = config_parser(Config, prog=WORKFLOW, description=DESCRIPTION)
    return {action.dest: action for action in parser._actions if action.option_strings and action.dest != "help"}


def option_flags(options: dict) -> list[str]:
    """Workflow command-line options: ``{"max_steps": 0}`` is ``--max-steps 0`` (every value passes, 0 included),
    True a bare switch (``--rslora``), a list several values (``--targets c_attn c_fc``); False and None leave the
    option out, so that the workflow's default applies."""
    flags = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, *map(str, value)] if isinstance(value, (list, tuple)) else [flag, str(value)]
    return flags


def _workflow_config(options: dict):
    """The workflow's Config for ``options``, read by the workflow's own parser (its types and choices); the
    parser's one-line complaint becomes a UserError."""
    complaint = io.StringIO()
    try:
        with contextlib.redirect_stderr(complaint):
            return parse_args(option_flags(options))
    except SystemExit:
        reason = complaint.getvalue().strip().split(": error: ", 1)[-1]
        raise UserError(f"The LoRA workflow rejects {' '.join(option_flags(options))}: {reason}") from None


def _option_values(cfg) -> dict:
    """The workflow's Config as option -> value (a nested dataclass's fields, e.g. the adapter's, at the top level,
    as they are on the command line)."""
    values = {}
    for key, value in asdict(cfg).items():
        values.update(value if isinstance(value, dict) else {key: value})
    return values


def _canonical(key: str, value, options: dict):
    """``value`` as the workflow reads it (1e-3 and 0.001 are one value; a list of modules stays a list)."""
    if key in SET_BY_SWEEP:
        raise UserError(f"The sweep sets --{key.replace('_', '-')} itself; remove it from the grid and the args.")
    if key not in options:
        raise UserError(f"The LoRA workflow has no option --{key.replace('_', '-')}; "
                        "see python -m my_utils.workflows.lora --help.")
    if options[key].nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise UserError(f"--{key.replace('_', '-')} is a switch: give true or false, not {value!r}.")
        return value
    value = _option_values(_workflow_config({key: value}))[key]
    return list(value) if isinstance(value, tuple) else value


PLAIN_VALUE = re.compile(r"[A-Za-z0-9_.+=-]{1,40}")
LONGEST_NAME = 120  # characters of a cell's folder name; a longer one keeps its start and a hash of the whole


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]


def _name_part(text: str) -> str:
    """A text value as part of a folder name: itself when short and plain (a module name, ``full``), else a readable
    stem and a short hash of the whole value, so that a path never names a folder outside the sweep nor nests
    folders, and two values never share a name."""
    if PLAIN_VALUE.fullmatch(text) and text.strip(".") and not text.startswith("-"):
        return text
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", PurePath(text).stem or text).strip("-")[:24] or "value"
    return f"{stem}-{_short_hash(text)}"


def cell_name(cell: dict) -> str:
    """A cell's folder name, from its options: ``rank16_alpha32_lr0.004``, ``full_lr0.0004``, ``rank4_rslora``,
    ``a-1f2e3d4c`` for a data file ``/data/a.jsonl``; always one folder inside the sweep's. A secret in a value
    (a token-shaped file name) is named by its hash (``hash_secrets``), as sweep.json records it: the name is the same
    from the real cell and from the recorded one, and holds no part of the secret."""
    parts = []
    for key, value in hash_secrets(cell).items():
        if value is True:
            parts.append(key)
        elif isinstance(value, list):
            parts.append("+".join(_name_part(str(v)) for v in value))
        elif isinstance(value, str):
            parts.append(_name_part(value))
        else:
            parts.append(f"{SHORT_NAMES.get(key, key)}{value:g}")
    name = "_".join(parts) or "default"
    return name if len(name) <= LONGEST_NAME else f"{name[:LONGEST_NAME - 9]}-{_short_hash(name)}"


@dataclass
class SweepSpec:
    """What a sweep runs. Options are the workflow's, without dashes (``{"max_steps": 30}`` is ``--max-steps 30``,
    ``{"rslora": True}`` is ``--rslora``): ``args`` holds those every cell shares, and each grid maps options to the
    values they take (``{"rank": [4, 64], "alpha": [32]}`` is two cells). Every value is checked by the workflow's
    own parser and checks when the spec is made: a bad one stops it with one sentence, before anything runs."""

    preset: str = "tiny"
    grids: list[dict] = field(default_factory=list)
    args: dict = field(default_factory=dict)
    num_processes: int = 1

    def __post_init__(self):
        get_preset(self.preset)
        options = workflow_options()
        self.args = {key: _canonical(key, value, options) for key, value in self.args.items()}
        self.grids = [self._checked_grid(grid, options) for grid in
                      (self.grids or DEFAULT_GRIDS.get(self.preset, REAL_MODEL_GRIDS))]
        adapters = set()
        for cell in self.cells():
            cfg = _workflow_config({"preset": self.preset, **self.args, **cell})
            validate(cfg)
            if cfg.method == "lora" and cfg.adapter is not None:
                adapters.add((cfg.adapter.targets, cfg.adapter.rank))
        _check_adapters(self.preset, adapters)

    def _checked_grid(self, grid: dict, options: dict) -> dict:
        if not isinstance(grid, dict):
            raise UserError(f"A grid maps options to lists of values, like {{'rank': [4, 16]}}; got {grid!r}.")
        checked = {}
        for key, values in grid.items():
            if key in self.args:
                raise UserError(f"--{key.replace('_', '-')} is both a grid option and a shared arg; keep one.")
            if not isinstance(values, (list, tuple)) or not values:
                raise UserError(f"The grid's {key} takes a non-empty list of values, like [4, 16]; got {values!r}.")
            checked[key] = [_canonical(key, value, options) for value in values]
            repeated = [v for i, v in enumerate(checked[key]) if v in checked[key][:i]]
            if repeated:
                raise UserError(f"The grid gives {key} {repeated[0]!r} twice; list each value once.")
        return checked

    def cells(self) -> list[dict]:
        """Every grid's cells, in order, each once: the options that set a cell apart (in the workflow's order, the
        shared training settings last, so that a name reads method first: ``rank16_alpha32_lr0.004``; None and
        False, the workflow's defaults, left out). A cell that runs what an earlier one runs (``seed`` 0 beside no
        seed: the workflow's default) is that cell, not a second run of it."""
        training = {f.name for f in fields(TrainingSettings)} - {f.name for f in fields(RunSettings)}
        order = sorted(workflow_options(), key=lambda option: option in training)
        cells, runs = {}, set()
        for grid in self.grids:
            for values in itertools.product(*grid.values()):
                cell = {k: v for k, v in sorted(zip(grid, values), key=lambda kv: order.index(kv[0]))
                        if v is not None and v is not False}
                run = repr(_workflow_config({"preset": self.preset, **self.args, **cell}))
                if run in runs:
                    continue
                runs.add(run)
                if cells.setdefault(cell_name(cell), cell) != cell:
                    raise UserError(f"Two cells would share the folder {cell_name(cell)}; make their values differ "
                                    "in the first six digits.")
        return list(cells.values())


def _check_adapters(preset_name: str, adapters: set) -> None:
    """Every (target modules, rank) exists in the preset's architecture and fits its layers (built on the meta
    device: no weights)."""
    preset = get_preset(preset_name)
    shipped = preset.offline_config.get("causal")
    if not adapters or not shipped:
        return

    model = meta_model(shipped)
    for targets, rank in sorted(adapters, key=str):
        check_lora_targets(model, targets or preset.lora_targets, rank)


def cell_command(spec: SweepSpec, cell: dict, folder: Path) -> list[str]:
    """The command that trains one cell in a new process (``accelerate launch`` for several processes)."""
    args = ["--preset", spec.preset, *option_flags({**spec.args, **cell}), "--output-dir", str(folder)]
    if spec.num_processes > 1:
        return accelerate_command(WORKFLOW, [*args, "--num-processes", str(spec.num_processes)],
                                  num_processes=spec.num_processes)
    return [sys.executable, "-m", WORKFLOW, *args]
