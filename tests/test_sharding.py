"""Sharded data parallel over gloo: DDP and ZeRO-1/2/3 train to the same losses, each rank holds what the formula
says, and each stage moves the volume it should; bad settings are one sentence before anything is written."""

import json
import math
import subprocess
import sys

import pytest

from my_utils.workflows import sharding


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_float32_formulas(world_size):
    P, N = 1000, world_size
    every = sharding.STRATEGIES + sharding.DEEPSPEED_STRATEGIES
    totals = {s: sum(sharding.memory_formula(s, P, N).values()) for s in every}
    assert totals == {"ddp": 16 * P, "zero1": 8 * P + 8 * P / N, "zero2": 4 * P + 16 * P / N, "zero3": 16 * P / N,
                      # DeepSpeed's float32 master partition besides: ZeRO-2 keeps whole weights and no gathered copy
                      "deepspeed_zero2": 4 * P + 16 * P / N, "deepspeed_zero3": 20 * P / N}


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    import os

    from my_utils.core.paths import REPO_ROOT

    out = tmp_path_factory.mktemp("sharding") / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "my_utils.workflows.sharding", "--preset", "tiny", "--max-steps", "4", "--output-dir", out]
    proc = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_every_stage_trains_like_ddp_and_holds_what_the_formula_says(sharded_run):
    workers = [json.loads(p.read_text()) for p in sorted((sharded_run / "workers").glob("rank_*.json"))]
    assert [w["world_size"] for w in workers] == [2, 2]  # as each worker saw it
    summary = json.loads((sharded_run / "summary.json").read_text())
    results = summary["strategies"]
    assert list(results) == list(sharding.STRATEGIES)
    ddp = results["ddp"]["losses"]
    assert len(ddp) == 4 and ddp[-1] < ddp[0]
    for name, result in results.items():
        assert result["losses"] == pytest.approx(ddp, rel=1e-5, abs=1e-6), name
        assert [m["process"] for m in result["memory"]] == [0, 1]
        for measured in result["memory"]:  # every kind, on every rank, within 10% of its formula
            for kind, expected in result["formula"].items():
                assert math.isclose(measured[kind], expected, rel_tol=0.10), (name, measured["process"], kind)
    total = {name: sum(r["memory"][0][k] for k in sharding.MEMORY_KINDS) for name, r in results.items()}
    assert total["zero3"] < total["zero2"] < total["zero1"] < total["ddp"]
    # elements through collectives per step, in units of P: an all-reduce counts twice (reduce-scatter + all-gather);
    # torch's ZeRO-1 adds a broadcast of the updated weights to DDP's all-reduce
    volumes = {name: round(r["volume_over_p"], 2) for name, r in results.items()}
    assert volumes == {"ddp": 2, "zero1": 3, "zero2": 2, "zero3": 3}
    assert (sharded_run / "memory.png").stat().st_size > 10_000


@pytest.mark.parametrize("args, message", [
    (["--strategies", "zero4"], "Unknown strategy 'zero4'; choose one of ddp, zero1, zero2, zero3, deepspeed_zero2"),
    (["--strategies"], "argument --strategies: expected at least one argument"),
    ([], "my_utils.workflows.sharding needs 2 or more processes"),  # this test is one process
    (["--max-steps", "0"], "--max-steps must be a positive integer, got 0"),
])
def test_bad_settings_are_one_sentence_and_write_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        sharding.main([*args, "--output-dir", str(out)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not out.exists()


def test_deepspeed_strategies_without_the_extra_are_one_sentence(monkeypatch):
    from my_utils import UserError

    monkeypatch.setattr(sharding, "deepspeed_installed", lambda: False)
    with pytest.raises(UserError, match=r"--strategies deepspeed_zero3 needs DeepSpeed, an extra of the course: pip "
                                        r"install -e \"\.\[deepspeed\]\""):
        sharding.validate(sharding.Config(strategies=("zero3", "deepspeed_zero3")))


def test_a_model_too_small_to_shard_is_one_sentence():
    import torch

    from my_utils import UserError

    with pytest.raises(UserError, match="too small to shard over 4 processes: a parameter has 3 rows"):
        sharding.check_shardable(torch.nn.Linear(5, 3), world_size=4)


@pytest.mark.slow
def test_the_planner_shards_as_the_run_measured(sharded_run):
    from my_utils.tools.planner import plan

    results = json.loads((sharded_run / "summary.json").read_text())["strategies"]
    for zero, name in enumerate(sharding.STRATEGIES):
        planned = plan("tiny", "full", processes=2, zero=zero)
        measured = results[name]["memory"][0]
        assert math.isclose(planned.weights, measured["weights"], rel_tol=0.01), name
        assert math.isclose(planned.gradients, measured["gradients"], rel_tol=0.01), name
        assert math.isclose(planned.optimizer, measured["optimizer_states"], rel_tol=0.02), name
        if name == "zero2":  # ZeRO-3's gathered unit is transient: after the forward pass nothing is left gathered
            assert math.isclose(planned.gathered, measured["gathered"], rel_tol=0.01)


@pytest.mark.slow
def test_a_batch_larger_than_the_data_is_one_sentence_before_the_folder_exists(tmp_path):
    import os

    from my_utils.core.paths import REPO_ROOT

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "my_utils.workflows.sharding", "--local-batch-size", "100000", "--output-dir", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "fewer than one global batch of 200000" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()
