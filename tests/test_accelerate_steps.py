"""The accelerate lesson's steps: each differs from the previous one only by lines under its own
``# New Code # <feature>`` marker, they share their function names, and the complete loop trains, checkpoints,
resumes where it stopped and tracks its metrics, launched on two processes."""

import json
import subprocess
import sys
from importlib import import_module

import pytest

from my_utils.workflows.accelerate_steps import STEPS, marker_tag, step_code, step_diff, step_names, unmarked_changes

PACKAGE = "my_utils.workflows.accelerate_steps"
PAIRS = [(before, after, tag) for (before, _), (after, tag) in zip(STEPS, STEPS[1:])]


@pytest.mark.parametrize("before, after, tag", PAIRS, ids=[after for _, after, _ in PAIRS])
def test_step_changes_only_its_marked_lines(before, after, tag):
    assert unmarked_changes(step_code(before), step_code(after), tag) == []
    assert step_diff(after).count("\n+") > 0


def test_checker_catches_unmarked_and_removed_lines():
    before = step_code("step1_base")
    after = step_code("step2_prepare")
    sneaky = list(after)
    sneaky.insert(sneaky.index("    losses = []") + 1, "    torch.manual_seed(1)")
    problems = unmarked_changes(before, sneaky, "prepare")
    assert len(problems) == 1 and "torch.manual_seed(1)" in problems[0]
    removed = [line for line in after if "model.train()" not in line]
    assert any("removed without a marked replacement" in p for p in unmarked_changes(before, removed, "prepare"))
    assert unmarked_changes(before, after, "tracking")  # wrong feature: every change is outside its blocks


def test_steps_share_function_names_and_the_last_has_every_feature():
    for name in step_names():
        module = import_module(f"{PACKAGE}.{name}")
        assert callable(module.training_loop) and callable(module.train) and callable(module.main), name
    last = {marker_tag(line) for line in step_code(step_names()[-1])} - {None}
    assert last == {tag for _, tag in STEPS if tag}


def test_bad_options_are_one_sentence(tmp_path):
    from my_utils import UserError
    from my_utils.workflows.accelerate_steps.common import Config, validate

    with pytest.raises(UserError, match="fp16 mixed precision needs a GPU"):
        validate(Config(mixed_precision="fp16"))
    with pytest.raises(UserError, match="does not exist"):
        validate(Config(resume_from=str(tmp_path / "nope")))
    (tmp_path / "checkpoints" / "step_5").mkdir(parents=True)
    with pytest.raises(UserError, match="at step 5, not before --max-steps 4"):
        validate(Config(resume_from=str(tmp_path / "checkpoints" / "step_5"), max_steps=4))


def _launch(module, args, env, num_processes=2):
    from my_utils.run.launch import accelerate_command

    cmd = accelerate_command(module, args, num_processes=num_processes)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _summary(path):
    return json.loads((path / "summary.json").read_text())


@pytest.mark.slow
def test_base_step_runs_alone(tmp_path, subprocess_env):
    out = tmp_path / "base"
    cmd = [sys.executable, "-m", f"{PACKAGE}.step1_base", "--preset", "tiny", "--max-steps", "3", "--local-batch-size",
           "2", "--max-length", "32", "--output-dir", str(out)]
    subprocess.run(cmd, env=subprocess_env, check=True, capture_output=True, timeout=600)
    summary = _summary(out)
    assert summary["world_size"] == 1 and summary["batches"] == 3 and summary["samples_per_s"] > 0


@pytest.mark.slow
def test_complete_loop_on_two_processes_resumes_where_it_stopped(tmp_path, subprocess_env, tracked_losses):
    common = ["--preset", "tiny", "--max-steps", "4", "--grad-accum", "2", "--local-batch-size", "2", "--max-length", "32"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    module = f"{PACKAGE}.step6_tracking"
    _launch(module, [*common, "--save-steps", "2", "--report-to", "tensorboard", "--output-dir", straight],
            subprocess_env)
    _launch(module, [*common, "--resume-from", straight / "checkpoints" / "step_2", "--output-dir", resumed],
            subprocess_env)

    for run in (straight, resumed):
        workers = [json.loads(p.read_text()) for p in sorted((run / "workers").glob("rank_*.json"))]
        assert [w["world_size"] for w in workers] == [2, 2] and {w["process"] for w in workers} == {0, 1}
        assert _summary(run)["world_size"] == 2
    assert (straight / "checkpoints" / "step_2").is_dir() and (straight / "checkpoints" / "step_4").is_dir()
    # 4 steps x 2 accumulated batches; the resumed run trains the batches of steps 3 and 4 only, from the same state
    full, tail = _summary(straight)["losses"], _summary(resumed)["losses"]
    assert len(full) == 8 and len(tail) == 4
    assert tail == pytest.approx(full[4:], rel=1e-5, abs=1e-6)
    metrics = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[-1]["loss"] == pytest.approx((full[6] + full[7]) / 2)
    # step 6 hands --report-to to accelerate, which logs the same lines to TensorBoard
    tensorboard, logged = tracked_losses(straight)
    assert len(logged) == 4 and tensorboard == pytest.approx(logged)
