"""The training settings (batch, steps, length, learning rate) are declared once, in ``TrainingSettings``: every
training workflow's Config takes them from there with its own defaults, and the default learning rate has one rule."""

import dataclasses
from importlib import import_module

import pytest

from my_utils.core.learning_rate import default_learning_rate
from my_utils.core.presets import get_preset
from my_utils.run.config import TrainingSettings, config_parser

TRAINING = ["data_parallel", "ddp", "lora", "classification", "pipeline_parallel", "sharding", "sharded_lora", "traps",
            "accelerate_steps.common"]
FOUR = ("batch_size", "max_steps", "max_length", "learning_rate")


@pytest.mark.parametrize("name", TRAINING)
def test_a_workflow_takes_the_four_settings_from_the_shared_block(name):
    config = import_module(f"my_utils.workflows.{name}").Config
    assert issubclass(config, TrainingSettings)
    redeclared = [f for f in FOUR if f in vars(config).get("__annotations__", {})]
    assert redeclared == [], f"{name} declares {redeclared} again; give its defaults in TRAINING_DEFAULTS"
    # its own defaults stand from the start, and its command line shows them
    cfg, parser = config(), config_parser(config, prog=name, description="")
    for key, value in config.TRAINING_DEFAULTS.items():
        assert getattr(cfg, key) == value == parser.get_default(key), (name, key)


@pytest.mark.parametrize("name", TRAINING)
def test_the_default_learning_rate_follows_one_rule(name):
    config = import_module(f"my_utils.workflows.{name}").Config
    preset = get_preset("tiny")
    for method in ("full", "lora"):
        settled = config().settled(preset, method)
        assert settled["learning_rate"] == default_learning_rate(preset, method)
        assert all(settled[key] is not None for key in FOUR)
    assert config().settled(preset)["learning_rate"] == default_learning_rate(preset, config.METHOD)
    given = dataclasses.replace(config(), learning_rate=0.5, max_steps=3)
    assert given.settled(preset)["learning_rate"] == 0.5 and given.settled(preset)["max_steps"] == 3


def test_full_fine_tuning_takes_the_presets_measured_rate_else_a_tenth_of_loras():
    tiny = get_preset("tiny")
    assert default_learning_rate(tiny, "full") == tiny.full_learning_rate != tiny.learning_rate / 10
    unmeasured = dataclasses.replace(tiny, full_learning_rate=None)
    assert default_learning_rate(unmeasured, "full") == pytest.approx(tiny.learning_rate / 10)
    assert default_learning_rate(unmeasured, "lora") == default_learning_rate(tiny, "lora") == tiny.learning_rate
