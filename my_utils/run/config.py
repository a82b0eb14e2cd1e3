"""A workflow's settings: one dataclass, from which the command line and its one-sentence errors are made.

A notebook passes the dataclass itself to ``notebook_launcher``; a shell gets ``--flags`` generated from its fields
by ``parse_config``, once for every workflow::

    @dataclass
    class Config(RunSettings):
        eval_rows: int = setting(300, "held-out rows scored")
        optimizer: str = setting("adamw", "the optimizer", choices=("adamw", "sgd"))
        adapter: AdapterSpec = setting(AdapterSpec, "LoRA")   # nested: its fields become flags too (--rank ...)

    cfg = parse_config(Config, argv, prog="python -m my_utils.workflows.mine", description="...")

A field whose default is None means "resolved before the results folder opens" (its help says from what); the
workflow's ``resolve`` fills it, so run.json records what actually ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing

from my_utils import UserError
from my_utils.core.adapters import AdapterSpec
from my_utils.core.learning_rate import default_learning_rate
from my_utils.core.presets import get_preset
from my_utils.run.redaction import redact_secrets
from my_utils.run.results import check_new_run_dir
from my_utils.run.trackers import check_report_to


def check_positive(name: str, value, kind=int) -> None:
    """One sentence for a count or size that is not a positive (finite) number."""
    number_types = (int, float) if kind is float else int
    if (isinstance(value, bool) or not isinstance(value, number_types) or not math.isfinite(value)
            or value <= 0):
        raise UserError(f"{name} must be a positive {'number' if kind is float else 'integer'}, got {value!r}.")


def check_choice(name: str, value, choices) -> None:
    """One sentence for a value that is not one of ``choices``."""
    if value not in choices:
        raise UserError(f"Unknown {name} {value!r}; choose one of {', '.join(map(str, choices))}.")


def check_choices(flag: str, what: str, values, choices) -> None:
    """One sentence for a list ``flag`` that names none, or names a ``what`` that is not one of ``choices``."""
    if not values:
        raise UserError(f"{flag} names none; give one or more of {', '.join(choices)}.")
    for value in values:
        check_choice(what, value, choices)


def setting(default, help: str, *, choices=None, unset: str | None = None):
    """A dataclass field with its command-line help (and choices). A dataclass type as ``default`` nests it: its
    fields become flags of their own. ``unset``: what a default of None stands for, said in the help when a
    workflow keeps that default."""
    metadata = {"help": help, "choices": choices, "unset": unset}
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class RunSettings:
    """What every workflow takes: the same names, flags and meanings everywhere."""

    preset: str = setting("tiny", "model and data preset: tiny (offline CPU), gpt2, opt-350m, smollm2-135m, ...")
    seed: int = setting(0, "seed of the weights' initialisation and the data order")
    output_dir: str | None = setting(None, "results folder, which must not exist (default: a new one under runs/)")
    num_processes: int | None = setting(None, "world size to expect inside each worker (default: the launcher's)")
    random_init: bool = setting(False, "random weights from the shipped config (offline, no quality)")
    report_to: tuple[str, ...] = setting((), "experiment trackers besides metrics.jsonl: tensorboard, trackio, "
                                              "wandb, mlflow... or all (default: none)")
    timeout_s: float = setting(1800, "seconds a collective waits for a rank that stopped (died or hung) before the "
                               "job fails naming it; keep it above the longest time one rank works alone (an "
                               "evaluation on rank 0)")

    def check_common(self):
        """Check what every workflow takes, before anything starts; returns the preset. A new run's
        ``output_dir`` must be able to become a new results folder (``check_new_run_dir``)."""
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise UserError(f"--seed must be an integer from 0 to 2**32 - 1, got {self.seed!r}.")
        check_positive("--timeout-s", self.timeout_s, float)
        if self.output_dir is not None and not getattr(self, "resume", False):
            check_new_run_dir(self.output_dir)
        if self.report_to:
            check_report_to(self.report_to)
        return get_preset(self.preset)


@dataclasses.dataclass
class TrainingSettings(RunSettings):
    """The settings every training workflow takes, each with one name, one flag and one rule for its default: the
    steps, the length, the learning rate, and the batch, whose scope is in its name (``BATCH``), as torchtitan names
    it: ``local_batch_size`` (``LocalBatchSettings``) or ``global_batch_size`` (``GlobalBatchSettings``).

    A workflow gives its own defaults in ``TRAINING_DEFAULTS`` (a setting left out comes from the preset), says what
    a flag means for it in ``SETTING_HELP`` (blocks or examples), ``METHOD`` says what it trains ("full" or "lora")
    and ``ROLE`` which of the preset's models ("causal" or "classifier"), which pick the default learning rate
    (``default_learning_rate``)::

        @dataclass
        class Config(LocalBatchSettings):
            TRAINING_DEFAULTS: ClassVar[dict] = {"local_batch_size": 4, "max_steps": 6, "max_length": 64}
            METHOD: ClassVar[str] = "lora"
    """

    BATCH: typing.ClassVar[str]
    TRAINING_DEFAULTS: typing.ClassVar[dict] = {}
    SETTING_HELP: typing.ClassVar[dict] = {}
    METHOD: typing.ClassVar[str] = "full"
    ROLE: typing.ClassVar[str] = "causal"

    max_steps: int | None = setting(None, "optimizer steps", unset="the preset's")
    max_length: int | None = setting(None, "tokens per example", unset="the preset's")
    learning_rate: float | None = setting(None, "peak rate (default: the preset's for LoRA, its full fine-tuning rate "
                                                "or a tenth of LoRA's for full fine-tuning)")

    def __post_init__(self):
        for name, value in self.TRAINING_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, value)

    def check_common(self):
        """``RunSettings.check_common``, and the training settings positive where given (None: resolved later);
        returns the preset. A workflow checks only its own extra fields."""
        preset = super().check_common()
        for name in (self.BATCH, "max_steps", "max_length"):
            if getattr(self, name) is not None:
                check_positive(f"--{name.replace('_', '-')}", getattr(self, name))
        if self.learning_rate is not None:
            check_positive("--learning-rate", self.learning_rate, float)
        return preset

    def settled(self, preset, method: str | None = None) -> dict:
        """The training settings with every default settled, as run.json records them: the workflow's, else the
        preset's (its batch, ``Preset.batch_size``, whatever the scope); the learning rate by
        ``default_learning_rate`` for ``method`` (default: the workflow's) and the workflow's ``ROLE``."""
        return {self.BATCH: getattr(self, self.BATCH) or preset.batch_size,
                "max_steps": self.max_steps or preset.max_steps, "max_length": self.max_length or preset.max_length,
                "learning_rate": self.learning_rate or default_learning_rate(preset, method or self.METHOD, self.ROLE)}


@dataclasses.dataclass
class LocalBatchSettings(TrainingSettings):
    """Training settings of a workflow that splits the data over processes: the batch is each process's (each model
    replica's) per micro-batch, and the global batch is local x gradient accumulation x processes."""

    BATCH: typing.ClassVar[str] = "local_batch_size"

    local_batch_size: int | None = setting(None, "examples per process per micro-batch", unset="the preset's")

    def global_batch(self, replicas: int) -> int:
        """Examples per optimizer step over ``replicas`` data-parallel processes."""
        return self.local_batch_size * getattr(self, "grad_accum", 1) * replicas


@dataclasses.dataclass
class GlobalBatchSettings(TrainingSettings):
    """Training settings of a workflow whose batch is the whole batch of an optimizer step (one process, or one
    model replica spread over the processes)."""

    BATCH: typing.ClassVar[str] = "global_batch_size"

    global_batch_size: int | None = setting(None, "examples per optimizer step, over all processes",
                                            unset="the preset's")


def _fields(cls):
    """(field, its resolved type) for every field of ``cls``."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _base_type(kind):
    """``int | None`` -> int; ``tuple[str, ...]`` -> tuple."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return typing.get_origin(kind) or kind


def add_arguments(parser, cls) -> None:
    """A flag per field of the dataclass ``cls`` (nested dataclasses flattened), with its help and choices."""
    for f, kind in _fields(cls):
        meta, base = f.metadata, _base_type(kind)
        if meta.get("flag") is False:  # set by the workflow as it resolves its settings
            continue
        if dataclasses.is_dataclass(base):
            add_arguments(parser.add_argument_group(meta.get("help")), base)
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(cls, "TRAINING_DEFAULTS", {}).get(f.name, f.default)
        help = getattr(cls, "SETTING_HELP", {}).get(f.name, meta.get("help"))
        if default is None and meta.get("unset") and "(default:" not in help:
            help += f" (default: {meta['unset']})"
        meta = {**meta, "help": help}
        if base is bool:
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(flag, dest=f.name, action=action, default=default, help=meta.get("help"))
        elif base is tuple:
            parser.add_argument(flag, dest=f.name, nargs="+", default=default, help=meta.get("help"))
        else:
            parser.add_argument(flag, dest=f.name, type=base, default=default, choices=meta.get("choices"),
                                help=meta.get("help"))


def build_config(cls, values: dict):
    """An instance of the dataclass ``cls`` from parsed flags (``vars(args)``); absent ones keep their default."""
    kwargs = {}
    for f, kind in _fields(cls):
        base = _base_type(kind)
        if dataclasses.is_dataclass(base):
            kwargs[f.name] = build_config(base, values)
        elif f.name in values:
            value = values[f.name]
            kwargs[f.name] = tuple(value) if base is tuple and value is not None else value
    return cls(**kwargs)


class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Show a flag's default unless it is None, False or empty (the help says what None resolves to)."""

    def _get_help_string(self, action):
        shown = not (action.default is None or action.default is False or action.default == ())
        return super()._get_help_string(action) if shown else action.help


class OneLineParser(argparse.ArgumentParser):
    """argparse with a bad option reported in one line (what is wrong, where to look), not the whole usage; a
    secret in the value it quotes is redacted."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {redact_secrets(message)}; see --help.\n")


def config_parser(cls, prog: str, description: str) -> argparse.ArgumentParser:
    """The command line of the dataclass ``cls``: a flag per field (nested dataclasses flattened), its help and
    default shown."""
    parser = OneLineParser(prog=prog, description=description, formatter_class=_ShowDefaults)
    add_arguments(parser, cls)
    return parser


def parse_config(cls, argv=None, *, prog: str, description: str):
    """An instance of the dataclass ``cls`` from command-line arguments."""
    return build_config(cls, vars(config_parser(cls, prog, description).parse_args(argv)))


def as_record(cfg) -> dict:
    """``cfg`` as run.json records it: nested dataclasses as dicts, tuples as lists, and an adapter as its resolved
    peft config and file (``AdapterSpec.record``), each of its facts once."""
    record = dataclasses.asdict(cfg)
    for f in dataclasses.fields(cfg):
        if isinstance(getattr(cfg, f.name), AdapterSpec):
            record[f.name] = getattr(cfg, f.name).record()
    return record
