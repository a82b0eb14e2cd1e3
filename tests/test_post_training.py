"""The DPO and GRPO workflows: their checks before anything starts, and (slow) real runs: DPO on 2 processes equal to
1 process at the same global batch, a crashed DPO run resumed to the same losses, GRPO on 2 processes with its
generation time measured."""

import json
import subprocess
import sys

import pytest

from my_utils import UserError
from my_utils.core.presets import get_preset
from my_utils.run.results import load_run
from my_utils.workflows import dpo, grpo, post_training


def test_resolve_settles_every_default_and_turns_trl_defaults_off(tmp_path):
    preset = get_preset("tiny")
    for workflow in (dpo, grpo):
        cfg = workflow.resolve(workflow.Config(), preset, world_size=2)
        assert cfg.learning_rate == preset.learning_rate and cfg.num_processes == 2
        assert cfg.mixed_precision in ("no", "bf16") and cfg.adapter.peft["target_modules"] == list(preset.lora_targets)
        assert workflow.resolve(cfg, preset, world_size=2) == cfg, "resolving twice changes nothing (resume)"
    # trl's configs default to bf16 and recomputation wherever they run; the workflows say what they want
    args = post_training.trl_arguments(dpo.resolve(dpo.Config(mixed_precision="no"), preset, 1), folder=tmp_path)
    assert (args["bf16"], args["fp16"], args["activation_checkpointing"]) == (False, False, False)


@pytest.mark.parametrize("workflow, changes, message", [
    (dpo, {"beta": "high"}, "--beta must be a positive number, got 'high'"),
    (dpo, {"beta": float("inf")}, "--beta must be a positive number"),
    (dpo, {"reference": "twin"}, "Unknown reference 'twin'; choose one of adapter, copy"),
    (grpo, {"reward": "length"}, "There is no reward called 'length'; choose one of exact_match, similarity"),
    (grpo, {"beta": "0.1"}, "--beta must be a number from 0 up"),
    (grpo, {"num_generations": 1}, "--num-generations must be 2 or more"),
    (grpo, {"local_batch_size": 6, "num_generations": 4}, "--num-generations 4 does not divide the global batch of 6"),
    (grpo, {"temperature": 0}, "--temperature must be a positive number"),
])
def test_bad_settings_are_one_sentence(workflow, changes, message):
    with pytest.raises(UserError, match=message):
        workflow.validate(workflow.Config(**changes))


def test_num_generations_is_checked_against_the_launchers_world(monkeypatch):
    """Inside a worker the launcher has set WORLD_SIZE: 3 answers per process on 2 processes are 6, which groups of
    4 do not divide, though 3 on 4 processes (12) would be."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match=r"global batch of 6 answers .* x 2 process\(es\)"):
        grpo.check_groups(grpo.Config(local_batch_size=3, num_generations=4), get_preset("tiny"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    grpo.check_groups(grpo.Config(local_batch_size=3, num_generations=4), get_preset("tiny"))


def _torchrun(processes: int) -> list[str]:
    if processes == 1:
        return [sys.executable, "-m"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), "-m"]


def _run(subprocess_env, processes: int, workflow: str, out, *args, env=None):
    cmd = [*_torchrun(processes), f"my_utils.workflows.{workflow}", "--output-dir", str(out), "--logging-steps", "1",
           "--skip-generation-eval", "--eval-rows", "16", *map(str, args)]
    return subprocess.run(cmd, env={**subprocess_env, **(env or {})}, capture_output=True, text=True, timeout=600)


def _losses(out, key="loss") -> list[float]:
    return [m[key] for m in load_run(out)["metrics"] if key in m]


@pytest.mark.slow
def test_dpo_on_two_processes_equals_one_and_resumes_after_a_crash(tmp_path, subprocess_env):
    steps = ["--max-steps", "5"]
    one = _run(subprocess_env, 1, "dpo", tmp_path / "one", *steps, "--local-batch-size", "8", "--save-steps", "2")
    assert one.returncode == 0, one.stderr[-3000:]
    two = _run(subprocess_env, 2, "dpo", tmp_path / "two", *steps, "--local-batch-size", "4")
    assert two.returncode == 0, two.stderr[-3000:]
    workers = [json.loads(p.read_text()) for p in sorted((tmp_path / "two" / "workers").glob("rank_*.json"))]
    assert [w["world_size"] for w in workers] == [2, 2]
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(a) == len(b) == 5 and a[0] == pytest.approx(0.6931472, abs=1e-6)  # policy = reference: log 2
    assert a[-1] != a[0] and a == pytest.approx(b, rel=1e-5, abs=0)
    summary = load_run(tmp_path / "two")["summary"]
    assert (summary["world_size"], summary["global_batch_size"], summary["reference_bytes"]) == (2, 8, 0)
    assert 0 <= summary["eval_reward_accuracy"] <= 1 and summary["pairs_per_s"] > 0

    crashed = _run(subprocess_env, 1, "dpo", tmp_path / "crash", *steps, "--local-batch-size", "8", "--save-steps",
                   "2", env={"COURSE_CRASH_AT_STEP": "3"})
    assert crashed.returncode != 0 and load_run(tmp_path / "crash")["run"]["status"] == "failed"
    resumed = _run(subprocess_env, 1, "dpo", tmp_path / "crash", *steps, "--local-batch-size", "8", "--save-steps",
                   "2", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = load_run(tmp_path / "crash")
    assert run["summary"]["resumed_from_step"] == 2 and run["run"]["status"] == "complete"
    assert _losses(tmp_path / "crash") == pytest.approx(a, rel=1e-6, abs=0)


@pytest.mark.slow
def test_grpo_on_two_processes_measures_its_generation_time(tmp_path, subprocess_env):
    out = tmp_path / "grpo"
    proc = _run(subprocess_env, 2, "grpo", out, "--max-steps", "4", "--local-batch-size", "4", "--num-generations", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    workers = [json.loads(p.read_text()) for p in sorted((out / "workers").glob("rank_*.json"))]
    assert [w["world_size"] for w in workers] == [2, 2]
    summary = load_run(out)["summary"]
    assert (summary["global_batch_size"], summary["prompts_per_step"]) == (8, 2)
    assert len(summary["generation_s"]) == 2 and all(s > 0 for s in summary["generation_s"])
    assert 0 < summary["generation_share"] < 1
    rewards = _losses(out, "reward")
    assert len(rewards) == 4 and all(0 <= r <= 1 for r in rewards)
