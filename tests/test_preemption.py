"""Preemption without a scheduler: SIGUSR1 (SLURM's warning before the time limit) stops the LoRA workflow at the end
of a step with a checkpoint there, on every rank, exit 75 and one line saying how to resume; ``--resume`` then
finishes the run with the uninterrupted run's per-step losses and adapter, each step logged once. The same through a
SLURM job that is requeued: tests/test_cluster.py."""

import json
import signal
import subprocess
import time

import psutil
import pytest
from conftest import logged_losses, lora_command
from safetensors.torch import load_file

from my_utils.core.paths import REPO_ROOT
from my_utils.run.cli import run_main
from my_utils.run.results import load_run
from my_utils.run.signals import PREEMPTED_EXIT, Preempted, Sigterm, on_sigterm

STEPS = 8
# No --save-steps: the only checkpoint is the one the signal asks for.
TRAIN = ["--preset", "tiny", "--max-steps", str(STEPS), "--logging-steps", "1", "--local-batch-size", "4",
         "--eval-rows", "8", "--skip-generation-eval", "--mixed-precision", "no"]
SIGNAL_AFTER_STEP = 3


def logged_steps(run_dir) -> list[int]:
    return [m["step"] for m in load_run(run_dir)["metrics"] if "loss" in m]


def preempt(out, env, processes: int, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """Start the run into ``out`` (slow steps), send SIGUSR1 to one worker once step ``SIGNAL_AFTER_STEP`` is
    logged (on 2 processes, only to the second worker: the other must stop at the same step), and wait."""
    proc = subprocess.Popen(lora_command([*TRAIN, "--output-dir", out], processes), env={**env, "COURSE_STEP_DELAY_S": "1"},
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    while not ((out / "metrics.jsonl").exists() and SIGNAL_AFTER_STEP in logged_steps(out)):
        assert proc.poll() is None and time.monotonic() < deadline, "training never reached the step"
        time.sleep(0.2)
    # the worker itself: a launcher (accelerate launch, torchrun) would die of SIGUSR1, not pass it on
    launched = psutil.Process(proc.pid)
    workers = [p for p in launched.children() if p.environ().get("RANK") == "1"] if processes > 1 else [launched]
    assert len(workers) == 1
    workers[0].send_signal(signal.SIGUSR1)
    output = proc.communicate(timeout=timeout_s)[0]
    return subprocess.CompletedProcess(proc.args, proc.returncode, output)


def check_preempted_then_resumed(tmp_path, env, processes: int):
    baseline, out = tmp_path / "uninterrupted", tmp_path / "preempted"
    subprocess.run(lora_command([*TRAIN, "--output-dir", baseline], processes), env=env, cwd=REPO_ROOT, check=True,
                   capture_output=True, timeout=600)

    stopped = preempt(out, env, processes)
    step = max(logged_steps(out))
    assert SIGNAL_AFTER_STEP <= step < STEPS, stopped.stdout[-3000:]
    line = (f"lora: preempted (SIGUSR1; stopped after step {step} with checkpoints/checkpoint-{step}: the same command "
            "with --resume continues)")
    assert stopped.stdout.count(line) == processes, stopped.stdout[-3000:]  # every rank, at the same step
    if processes == 1:
        assert stopped.returncode == PREEMPTED_EXIT and "Traceback" not in stopped.stdout, stopped.stdout[-3000:]
    info = json.loads((out / "run.json").read_text())
    assert info["status"] == "interrupted" and info["error"].startswith("preempted: SIGUSR1"), info
    assert (out / "checkpoints" / f"checkpoint-{step}" / "checkpoint_complete.json").is_file()
    assert not (out / "summary.json").exists()

    resumed = subprocess.run(lora_command([*TRAIN, "--output-dir", out, "--resume"], processes), env=env, cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert logged_steps(out) == list(range(1, STEPS + 1))  # each step once
    assert logged_losses(out) == logged_losses(baseline)  # exact: the same batches, RNG states and weights
    adapter, expected = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (out, baseline))
    assert adapter.keys() == expected.keys() and all((adapter[k] == expected[k]).all() for k in expected)


def test_sigusr1_asks_once_for_a_stop_at_the_step_and_interrupts_at_once_outside_training(monkeypatch, capsys):
    monkeypatch.setattr(Sigterm, "deferrable", True)
    monkeypatch.setattr(Sigterm, "requested", False)
    monkeypatch.setattr(Sigterm, "name", "SIGTERM")
    on_sigterm(signal.SIGUSR1, None)
    assert Sigterm.requested and Sigterm.name == "SIGUSR1"
    assert capsys.readouterr().err == "SIGUSR1: stopping after this step and saving a checkpoint\n"
    on_sigterm(signal.SIGUSR1, None)  # `scancel --full`: the batch shell passes it on and the step gets it too
    assert Sigterm.requested and Sigterm.name == "SIGUSR1"
    monkeypatch.setattr(Sigterm, "deferrable", False)  # loading the model, or evaluating after training
    with pytest.raises(KeyboardInterrupt, match="SIGUSR1"):
        on_sigterm(signal.SIGUSR1, None)


def test_a_preempted_run_exits_75_with_one_line_and_a_stopped_one_130(capsys):
    def preempted():
        raise Preempted("SIGUSR1; stopped after step 3 with checkpoints/checkpoint-3: the same command with --resume "
                        "continues")

    def stopped():
        raise KeyboardInterrupt("SIGTERM")

    for body, code, line in ((preempted, PREEMPTED_EXIT, "lora: preempted (SIGUSR1; stopped after step 3"),
                             (stopped, 130, "lora: interrupted (SIGTERM)")):
        with pytest.raises(SystemExit) as exit_:
            run_main(body, "lora")
        err = capsys.readouterr().err
        assert exit_.value.code == code and err.startswith(line) and err.count("\n") == 1, err


@pytest.mark.slow
def test_sigusr1_checkpoints_at_the_step_and_resume_reproduces_the_uninterrupted_run(tmp_path, subprocess_env):
    check_preempted_then_resumed(tmp_path, subprocess_env, processes=1)


@pytest.mark.slow
def test_sigusr1_to_one_of_two_workers_stops_both_at_the_same_step(tmp_path, subprocess_env):
    check_preempted_then_resumed(tmp_path, subprocess_env, processes=2)
