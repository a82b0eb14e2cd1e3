"""A diverged run is a failed run: a loss or gradient that is not finite stops the step before its optimizer update, on
every rank at the same step, with one sentence, exit code 2, the run marked failed and the last good checkpoint kept;
the weights after the refused step are the weights before it (torchtitan's test of the same guard). A sweep records
such a cell as failed, with its sentence, and goes on to the next cell."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import Finished

from my_utils import JobFailed
from my_utils.core.paths import REPO_ROOT
from my_utils.run import divergence
from my_utils.run.divergence import Diverged, check_finite, diverged
from my_utils.run.launch import accelerate_command
from my_utils.run.results import Run
from my_utils.tools import sweep

HUGE_RATE = "1e30"  # the tiny model's loss is nan within three steps
SENTENCE = re.compile(r"Training diverged at step (\d+): .*(nan|inf).*; lower --learning-rate \(now 1e\+30\)\.")


def tiny_steps(poison_at: int, poison) -> tuple[list, list]:
    """Three AdamW steps of a small linear model, each guarded; ``poison(loss, model)`` spoils step ``poison_at``.
    Returns the weights before every step taken or refused, and those after the loop."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = []
    for step in range(1, 4):
        before.append([p.detach().clone() for p in model.parameters()])
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss = poison(loss, model) if step == poison_at else loss
        loss.backward()
        if step == poison_at and loss.isfinite():  # spoil a gradient, not the loss
            model.weight.grad[0, 0] = float("nan")
        check_finite(step, loss, model.parameters(), 0.1)
        optimizer.step()
        optimizer.zero_grad()
    return before, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("poison, said", [
    (lambda loss, model: loss * float("inf"), "the loss is inf"),
    (lambda loss, model: loss, "a gradient is nan"),
])
def test_a_non_finite_loss_or_gradient_is_refused_before_the_update(poison, said, monkeypatch):
    weights = {}

    def keep(step, loss, parameters, learning_rate):  # the weights as the refusal left them
        parameters = list(parameters)
        try:
            check(step, loss, parameters, learning_rate)
        except Diverged:
            weights["refused"] = parameters
            raise

    check = check_finite
    monkeypatch.setattr(sys.modules[__name__], "check_finite", keep)
    with pytest.raises(Diverged) as refused:
        tiny_steps(2, poison)
    message = str(refused.value)
    assert message.startswith("Training diverged at step 2: ") and said in message, message
    assert message.endswith("lower --learning-rate (now 0.1).") and "\n" not in message
    assert ("loss" in said) == ("the loss" in message), "the loss is named only when it is the loss"
    before, _ = tiny_steps(0, poison)  # the same steps without the poison: the weights step 2 began with
    for after, start in zip(weights["refused"], before[1]):
        assert torch.equal(after, start), "the refused step changed the weights"


def test_finite_steps_pass():
    before, after = tiny_steps(0, None)
    assert not torch.equal(before[0][0], after[0]), "the steps trained"


def test_a_run_that_diverged_is_told_from_one_that_failed_otherwise(tmp_path):
    for name, error in (("diverged", "Diverged: Training diverged at step 3: ..."), ("crashed", "RuntimeError: boom")):
        Run.create(tmp_path / name, config={}).fail(error)
    assert diverged(tmp_path / "diverged") and not diverged(tmp_path / "crashed")
    assert not diverged(tmp_path / "missing")


def test_a_sweep_records_a_diverged_cell_as_failed_and_goes_on(tmp_path, monkeypatch, capsys):
    """A diverged cell exits 2 as a refusal does, but the other cells (lower rates) still run: the sweep does not stop
    there, says the cell's sentence on its line, and ends naming it, with no row for it in the report."""
    out = tmp_path / "sweep"
    spec = sweep.SweepSpec(grids=[{"learning_rate": [1e30, 1e-3]}])
    ran = []
    sentence = "Training diverged at step 3: the loss is nan, so ...; lower --learning-rate (now 1e+30)."

    def fake_start(cmd, env, log):
        folder = Path(cmd[cmd.index("--output-dir") + 1])
        ran.append(folder.name)
        run = Run.create(folder, config={})
        if "1e+30" in folder.name:
            run.fail(f"Diverged: {sentence}")
            return Finished(2)
        run.fail("RuntimeError: boom")
        return Finished(1)

    monkeypatch.setattr(sweep.running, "_start", fake_start)
    with pytest.raises(JobFailed, match=r"2 of 2 cell\(s\) failed \(lr1e\+30, lr0\.001\)"):
        sweep.run_sweep(spec, out)
    assert ran == ["lr1e+30", "lr0.001"], "the diverged cell stopped the sweep"
    assert f"lr1e+30: failed after 0 s ({sentence})" in capsys.readouterr().out
    assert sweep.load_sweep(out) == []


# ---------------------------------------------------------------------------------------------- the workflows


def environment(**more) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", **more}


def check_refused(proc, out: Path, world_size: int, checkpoints: str | None = "checkpoints") -> int:
    """The run ended with the sentence once, exit code 2 on every rank, status failed; returns the refused step.
    With ``checkpoints``, the newest checkpoint is the step before the refused one."""
    said = SENTENCE.findall(proc.stderr)
    assert len(said) == 1, proc.stderr[-3000:]
    step = int(said[0][0])
    if world_size == 1:
        assert proc.returncode == 2, proc.stderr[-3000:]
    else:  # each worker exits 2; the launcher's table reports each
        assert proc.returncode != 0 and len(re.findall(r"exitcode\s+: 2\b", proc.stderr)) == world_size, \
            proc.stderr[-3000:]
    info = json.loads((out / "run.json").read_text())
    assert info["status"] == "failed" and info["world_size"] == world_size
    assert info["error"].startswith(f"Diverged: Training diverged at step {step}: ")
    assert not (out / "summary.json").exists()
    if checkpoints:
        saved = sorted(int(p.name.rsplit("-", 1)[1]) for p in (out / checkpoints).glob("checkpoint-*"))
        assert saved and saved[-1] == step - 1, (saved, step)
    return step


@pytest.mark.slow
def test_lora_on_one_process_keeps_the_weights_the_refused_step_began_with(tmp_path, monkeypatch, capsys):
    """torchtitan's form: the adapter as the refusal left it is the adapter the step began with, which is the last
    checkpoint's; nothing is written after it."""
    from safetensors.torch import load_file

    from my_utils.workflows import lora

    seen = {}

    def watched(step, loss, parameters, learning_rate):
        parameters = [p for p in parameters if p.requires_grad]
        seen.update(step=step, parameters=parameters, before=[p.detach().clone() for p in parameters])
        check(step, loss, parameters, learning_rate)

    check = divergence.check_finite
    monkeypatch.setattr(divergence, "check_finite", watched)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as ended:
        lora.main(["--preset", "tiny", "--max-steps", "5", "--save-steps", "1", "--eval-rows", "4",
                   "--skip-generation-eval", "--learning-rate", HUGE_RATE, "--output-dir", str(out)])
    proc = subprocess.CompletedProcess([], ended.value.code, "", capsys.readouterr().err)
    step = check_refused(proc, out, 1)
    assert seen["step"] == step > 1
    for now, then in zip(seen["parameters"], seen["before"]):
        assert torch.equal(now.detach(), then), "the refused step changed the adapter"
    saved = load_file(out / "checkpoints" / f"checkpoint-{step - 1}" / "adapter_model.safetensors")
    assert saved and all(t.isfinite().all() for t in saved.values())
    assert all(any(torch.equal(t, p) for p in seen["before"]) for t in saved.values()), \
        "the last checkpoint is not the adapter the refused step began with"


@pytest.mark.slow
def test_lora_on_two_processes_stops_every_rank_at_the_same_step(tmp_path):
    out = tmp_path / "run"
    cmd = accelerate_command("my_utils.workflows.lora", ["--preset", "tiny", "--max-steps", "5", "--save-steps", "1",
                                                         "--eval-rows", "4", "--skip-generation-eval",
                                                         "--learning-rate", HUGE_RATE, "--output-dir", str(out)],
                             num_processes=2, config_file=REPO_ROOT / "configs" / "cpu_x2.yaml")
    proc = subprocess.run(cmd, env=environment(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    check_refused(proc, out, 2)


def torchrun(workflow: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           f"my_utils.workflows.{workflow}", "--preset", "tiny", "--max-steps", "4", "--learning-rate", HUGE_RATE,
           *args, "--output-dir", str(out)]
    return subprocess.run(cmd, env=environment(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_sharded_lora_on_two_processes_stops_with_its_last_good_checkpoint(tmp_path):
    out = tmp_path / "run"
    check_refused(torchrun("sharded_lora", out, "--save-steps", "1"), out, 2)


@pytest.mark.slow
def test_tensor_parallel_on_two_processes_stops_every_rank(tmp_path):
    out = tmp_path / "run"
    check_refused(torchrun("tensor_parallel", out), out, 2, checkpoints=None)


@pytest.mark.slow
def test_a_sweep_cell_that_diverged_is_failed_and_has_no_row(tmp_path, capsys):
    out = tmp_path / "sweep"
    spec = sweep.SweepSpec(args={"max_steps": 4, "eval_rows": 4, "skip_generation_eval": True},
                           grids=[{"learning_rate": [1e30]}])
    with pytest.raises(JobFailed, match=r"1 of 1 cell\(s\) failed \(lr1e\+30\)"):
        sweep.run_sweep(spec, out)
    assert SENTENCE.search(capsys.readouterr().out)
    assert diverged(out / "lr1e+30") and sweep.load_sweep(out) == []
