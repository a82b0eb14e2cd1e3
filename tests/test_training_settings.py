"""The training settings (batch, steps, length, learning rate) are declared once, in ``TrainingSettings``: every
training workflow's Config takes them from there with its own defaults, and the default learning rate has one rule."""

import dataclasses
import pkgutil
from importlib import import_module

import pytest

from my_utils import workflows
from my_utils.core.learning_rate import default_learning_rate
from my_utils.core.presets import PRESETS, get_preset
from my_utils.run.config import GlobalBatchSettings, LocalBatchSettings, TrainingSettings, config_parser


def training_workflows() -> list[str]:
    """Every workflow module (under my_utils.workflows) whose Config is a TrainingSettings."""
    modules = (import_module(m.name) for m in pkgutil.walk_packages(workflows.__path__, "my_utils.workflows."))
    return sorted(m.__name__.removeprefix("my_utils.workflows.") for m in modules
                  if isinstance(getattr(m, "Config", None), type) and issubclass(m.Config, TrainingSettings)
                  and m.Config.__module__ == m.__name__)


TRAINING = training_workflows()


def test_the_list_of_training_workflows_is_derived_whole():
    assert {"ddp", "lora", "classification", "tensor_parallel", "accelerate_steps.common"} <= set(TRAINING)


def four(config) -> tuple[str, ...]:
    """The training settings of a workflow's Config: its batch (local or global), steps, length and rate."""
    return (config.BATCH, "max_steps", "max_length", "learning_rate")


# Where the batch is one process's share (the data split over processes) and where it is the whole batch.
LOCAL = {"ddp", "lora", "dpo", "grpo", "sharded_lora", "sharding", "traps", "classification", "accelerate_steps.common"}
GLOBAL = {"data_parallel", "pipeline_parallel", "tensor_parallel"}


def test_a_batchs_scope_is_in_its_name():
    assert set(TRAINING) == LOCAL | GLOBAL
    for name in TRAINING:
        config = import_module(f"my_utils.workflows.{name}").Config
        assert issubclass(config, LocalBatchSettings if name in LOCAL else GlobalBatchSettings), name
    for m in pkgutil.walk_packages(workflows.__path__, "my_utils.workflows."):  # the other workflows too
        config = getattr(import_module(m.name), "Config", None)
        if dataclasses.is_dataclass(config):
            assert "batch_size" not in {f.name for f in dataclasses.fields(config)}, m.name


@pytest.mark.parametrize("name", TRAINING)
def test_a_workflow_takes_the_four_settings_from_the_shared_block(name):
    config = import_module(f"my_utils.workflows.{name}").Config
    assert issubclass(config, TrainingSettings)
    redeclared = [f for f in four(config) if f in vars(config).get("__annotations__", {})]
    assert redeclared == [], f"{name} declares {redeclared} again; give its defaults in TRAINING_DEFAULTS"
    # its own defaults stand from the start, and its command line shows them
    cfg, parser = config(), config_parser(config, prog=name, description="")
    for key, value in config.TRAINING_DEFAULTS.items():
        assert getattr(cfg, key) == value == parser.get_default(key), (name, key)


def resolved(name: str, cfg, preset):
    """``cfg`` as the workflow ``name`` resolves it for one process: what its run.json records."""
    module = import_module(f"my_utils.workflows.{name}")
    if name == "classification":
        return module.resolve(cfg, preset, 1, module.load_sentences(cfg, preset))
    if not hasattr(module, "resolve"):  # every default is the workflow's own
        return cfg
    return module.resolve(cfg, preset, [] if name == "data_parallel" else 1)


@pytest.mark.parametrize("name", TRAINING)
def test_the_resolved_learning_rate_follows_one_rule(name):
    config = import_module(f"my_utils.workflows.{name}").Config
    preset = get_preset("tiny")
    methods = ("full", "lora") if "method" in {f.name for f in dataclasses.fields(config)} else (config.METHOD,)
    for method in methods:
        cfg = config(method=method) if len(methods) > 1 else config()
        record = resolved(name, cfg, preset)
        expected = config.TRAINING_DEFAULTS.get("learning_rate") or default_learning_rate(preset, method, config.ROLE)
        assert record.learning_rate == expected, (name, method)
        assert all(getattr(record, key) is not None for key in four(config))
    given = resolved(name, dataclasses.replace(config(), learning_rate=0.5, max_steps=3), preset)
    assert (given.learning_rate, given.max_steps) == (0.5, 3)


def test_the_presets_rates_are_those_the_lessons_measured():
    def rates(name, role):
        return {method: default_learning_rate(get_preset(name), method, role) for method in ("lora", "full")}

    assert rates("tiny", "causal") == {"lora": 4e-3, "full": 1e-3}
    assert rates("tiny", "classifier") == {"lora": 6e-3, "full": 5e-4}
    assert rates("roberta-large", "classifier") == {"lora": 2e-4, "full": 2e-5}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_presets_rate_is_loras_and_full_fine_tuning_takes_a_smaller_one(name):
    preset = get_preset(name)
    for role in ("causal", "classifier"):
        if preset.causal_model if role == "causal" else preset.classifier_model:
            assert default_learning_rate(preset, "full", role) < default_learning_rate(preset, "lora", role), role


def test_full_fine_tuning_takes_the_presets_measured_rate_else_a_tenth_of_loras():
    tiny = get_preset("tiny")
    assert default_learning_rate(tiny, "full") == tiny.full_learning_rate != tiny.learning_rate / 10
    unmeasured = dataclasses.replace(tiny, full_learning_rate=None)
    assert default_learning_rate(unmeasured, "full") == pytest.approx(tiny.learning_rate / 10)
    assert default_learning_rate(unmeasured, "lora") == default_learning_rate(tiny, "lora") == tiny.learning_rate
