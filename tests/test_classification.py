"""The classification workflow: full or LoRA, on one process, DDP or a 2-stage pipeline, all doing the same
arithmetic; and the comparison table, built from results folders only."""

import pytest

from my_utils import UserError
from my_utils.run.results import Run
from my_utils.workflows.classification import Config, global_batches, validate
from my_utils.workflows.classification_table import classification_runs, classification_table


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
    ({"rank": 0}, "positive integer"),
    ({"preset": "gpt2"}, "no classifier model"),
    ({"eval_every": 0}, "positive integer"),
])
def test_bad_config_is_refused(change, message):
    with pytest.raises(UserError, match=message):
        validate(Config(**change))


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
    table = classification_table(tmp_path)
    assert "0.250 -> 0.750" in table and "1.0 GiB / 1.0 GiB" in table and "1.0 MiB / 3.0 MiB" in table
    assert "failed" not in table and "other" not in table
    with pytest.raises(UserError, match="No complete classification run"):
        classification_table(tmp_path / "failed")


@pytest.mark.slow
def test_one_device_ddp_and_pipeline_do_the_same_arithmetic(tmp_path, subprocess_env):
    import sys

    from my_utils.run.launch import accelerate_command, run_command
    from my_utils.run.results import load_run

    args = ["--preset", "tiny", "--method", "lora", "--max-steps", 4, "--eval-every", 2, "--eval-rows", 32,
            "--batch-size", 8]
    summaries = {}
    for parallel in ("none", "ddp", "pipeline"):
        out = tmp_path / parallel
        my_args = [*args, "--parallel", parallel, "--output-dir", out]
        if parallel == "none":
            cmd = [sys.executable, "-m", "my_utils.workflows.classification", *map(str, my_args)]
        else:
            cmd = accelerate_command("my_utils.workflows.classification", [*my_args, "--num-processes", 2],
                                     num_processes=2)
        run_command(cmd, env=subprocess_env)
        summaries[parallel] = load_run(out)["summary"]
    one, ddp, pipe = summaries["none"], summaries["ddp"], summaries["pipeline"]
    assert one["world_sizes_seen"] == [1] and ddp["world_sizes_seen"] == [2, 2] and pipe["world_sizes_seen"] == [2, 2]
    assert len(ddp["peak_memory_per_rank"]) == 2
    assert one["num_labels"] == 4  # the tiny set's classes: chance is a quarter
    for other in (ddp, pipe):  # same batches, same initial weights, no dropout: the same numbers
        assert other["train_loss_first"] == pytest.approx(one["train_loss_first"], abs=1e-4)
        assert other["train_loss_final"] == pytest.approx(one["train_loss_final"], abs=1e-3)
        assert [s for s, _ in other["eval_curve"]] == [s for s, _ in one["eval_curve"]] == [0, 2, 4]
    assert sum(pipe["trainable_params_per_rank"]) == one["trainable_params"] == ddp["trainable_params_per_rank"][0]
    table = classification_table(tmp_path)
    assert all(p in table for p in ("none", "ddp", "pipeline"))
    # the general comparison shows accuracy before -> after, as it shows exact match for the LoRA lessons
    from my_utils.tools.compare import overview

    after = f"{one['eval_curve'][0][1]:.2f} -> {one['eval_curve'][-1][1]:.2f}"
    assert any(line.startswith("none") and after in line for line in overview(tmp_path, root=tmp_path).splitlines())
