"""The classification workflow: full or LoRA, on one process, DDP or a 2-stage pipeline, all doing the same
arithmetic; and the comparison table, built from results folders only."""

import pytest

from my_utils import UserError
from my_utils.core.adapters import AdapterSpec
from my_utils.run.results import Run
from my_utils.workflows.classification import Config, global_batches, validate
from my_utils.lessons.classification import classification_runs, classification_table


def test_global_batches_are_the_same_for_every_mode_and_cover_epochs():
    a, b = global_batches(10, 4, 6, seed=0), global_batches(10, 4, 6, seed=0)
    assert all((x == y).all() for x, y in zip(a, b))
    assert [len(x) for x in a] == [4] * 6
    first_epoch = [int(i) for x in a[:2] for i in x]
    assert len(first_epoch) == len(set(first_epoch)), "no repeat within an epoch"
    assert not all((x == y).all() for x, y in zip(a, global_batches(10, 4, 6, seed=1)))


@pytest.mark.parametrize("change, message", [
    ({"method": "qlora"}, "Unknown method"),
    ({"parallel": "fsdp"}, "Unknown parallel mode"),
    ({"adapter": AdapterSpec(rank=0)}, "positive integer"),
    ({"preset": "gpt2"}, "no classifier model"),
    ({"eval_steps": 0}, "positive integer"),
])
def test_bad_config_is_refused(change, message):
    with pytest.raises(UserError, match=message):
        validate(Config(**change))


def test_a_batch_that_does_not_split_is_refused_before_the_data_is_read():
    from my_utils.workflows.classification import resolve

    preset = validate(Config(parallel="pipeline"))
    with pytest.raises(UserError, match="A batch of 10 does not split into 4 equal micro-batches"):
        resolve(Config(parallel="pipeline", local_batch_size=10), preset, 2, sentences=None)
    with pytest.raises(UserError, match="The preset's batch of 16 does not split over 3 processes"):
        resolve(Config(parallel="ddp"), preset, 3, sentences=None)


def _fake_run(path, status="complete", **summary):
    run = Run.create(path, config={})
    base = {"workflow": "classification", "method": "lora", "parallel": "none", "world_size": 1,
            "accuracy_before": 0.25, "accuracy_after": 0.5, "peak_memory_per_rank": [100 * 2**20], "runtime_s": 1.0,
            "samples_per_s": 10.0, "trainable_params": 1000}
    if status == "complete":
        run.finish({**base, **summary})
    else:
        run.fail("boom")


def test_table_is_built_from_complete_classification_folders_only(tmp_path):
    _fake_run(tmp_path / "b", parallel="pipeline", world_size=2, peak_memory_per_rank=[2**20, 3 * 2**20])
    _fake_run(tmp_path / "a", method="full", parallel="ddp", world_size=2, accuracy_after=0.75,
              peak_memory_per_rank=[2**30, 2**30])
    _fake_run(tmp_path / "c")
    _fake_run(tmp_path / "failed", status="failed")
    _fake_run(tmp_path / "other", workflow="lora")
    runs = classification_runs(tmp_path)
    assert [(r["method"], r["parallel"]) for r in runs] == [("full", "ddp"), ("lora", "none"), ("lora", "pipeline")]
    assert [r["seed"] for r in runs] == [None] * 3  # these folders' run.json record no config
    table = classification_table(tmp_path)
    assert "0.250 -> 0.750" in table and "1.0 GiB / 1.0 GiB" in table and "1.0 MiB / 3.0 MiB" in table
    assert "failed" not in table and "other" not in table
    with pytest.raises(UserError, match="No complete classification run"):
        classification_table(tmp_path / "failed")


def test_the_parser_is_made_from_the_config():
    from my_utils.workflows.classification import parse_args

    cfg = parse_args(["--method", "full", "--rank", "4", "--targets", "query", "--eval-steps", "5"])
    assert (cfg.method, cfg.adapter.rank, cfg.adapter.targets, cfg.eval_steps) == ("full", 4, ("query",), 5)
    assert cfg.local_batch_size is None and cfg.adapter.alpha is None  # resolved inside the run, before its folder opens


def _nulls(value, path=""):
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _nulls(v, f"{path}.{k}" if path else k)]
    return [path] if value is None else []


@pytest.mark.slow
def test_run_json_records_every_default_resolved(tmp_path, subprocess_env):
    import sys

    from my_utils.run.launch import run_command
    from my_utils.run.results import load_run

    out = tmp_path / "run"
    run_command([sys.executable, "-m", "my_utils.workflows.classification", "--preset", "tiny", "--max-steps", "2",
                 "--eval-steps", "2", "--eval-rows", "32", "--output-dir", str(out)], env=subprocess_env)
    run = load_run(out)
    config = run["run"]["config"]
    assert run["run"]["status"] == "complete"
    # null only where it means "none": no adapter file (LoRA from its flags), the resolved config in "peft"
    assert _nulls(config) == ["adapter.adapter_config"], _nulls(config)
    peft = config["adapter"]["peft"]  # the adapter once: peft's config, the flags that set it not again
    assert set(config["adapter"]) == {"adapter_config", "peft"} and peft["peft_type"] == "LORA" and peft["r"] == 8
    assert config["local_batch_size"] == 16 and config["learning_rate"] == 6e-3 and config["num_processes"] == 1
    assert peft["lora_alpha"] == 16 and peft["target_modules"] == ["query", "value"]
    assert 0 < config["max_length"] <= 128 and run["summary"]["global_batch_size"] == 16


@pytest.mark.slow
@pytest.mark.parametrize("args, expected", [
    (["--eval-steps", "0"], "classification: error: --eval-steps must be a positive integer, got 0."),
    (["--eval-every", "5"], "unrecognized arguments: --eval-every 5; see --help."),
    (["--parallel", "ddp"], "--parallel ddp needs 2 or more processes"),
])
def test_bad_input_from_the_command_line_is_one_line_and_writes_nothing(tmp_path, subprocess_env, args, expected):
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "my_utils.workflows.classification", *args, "--output-dir", str(out)],
                          env=subprocess_env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]
    assert not out.exists()
