"""Faults a run survives, rehearsed on the tiny preset: a crash and a resume that reproduces the uninterrupted
run's per-step losses exactly (1 and 2 processes), a checkpoint cut short, SIGTERM under accelerate launch, a
rank that exits or is stopped (SIGSTOP), out of memory, a results file whose rename fails, and no network at all.

Faults are injected through the COURSE_* variables documented in my_utils/run/faults.py, or through a
sitecustomize module put first on PYTHONPATH (a socket guard, a failing rename).
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import logged_losses, lora_command

from my_utils import UserError
from my_utils.run.checkpoints import (CHECKPOINT_MANIFEST, checkpoint_problem, find_resume_checkpoint,
                                      write_checkpoint_manifest)
from my_utils.core.paths import REPO_ROOT
from my_utils.run.launch import accelerate_command, is_cpu_only
from my_utils.run.results import load_run
from my_utils.tools.compare import load_runs
from my_utils.workflows.lora import default_mixed_precision

COMMON = ["--preset", "tiny", "--logging-steps", "1", "--local-batch-size", "4", "--save-steps", "2"]
STEPS = 6
ARGS = [*COMMON, "--max-steps", str(STEPS)]
# The 1-process runs train 8 steps on 13 rows (3 batches of 4 per epoch), so a resume from step 4 lands in the
# middle of the second epoch. They also keep the out-of-memory back-off on: a crash that is not an OOM must go
# straight through it, and a resume must keep the batch size.
ONE_PROCESS_STEPS = 8
ONE_PROCESS_ARGS = [*COMMON, "--max-steps", str(ONE_PROCESS_STEPS), "--eval-rows", "8", "--auto-batch-size"]
SECRET = "hf_" + "Zq8" * 10  # a token-shaped value in the environment: it must never reach a results folder


def env_for(tmp: Path, **extra) -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", HF_HOME=str(tmp / "hf_home"), HF_TOKEN=SECRET)
    if is_cpu_only():
        env["ACCELERATE_USE_CPU"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def with_sitecustomize(env: dict, folder: Path, code: str) -> dict:
    """``env`` with a sitecustomize module, imported by every Python process at start-up, first on the path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(textwrap.dedent(code), encoding="utf-8")
    return {**env, "PYTHONPATH": f"{folder}{os.pathsep}{env['PYTHONPATH']}"}


def lora(args, env, processes: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the LoRA workflow from a shell: ``python -m`` for one process, ``accelerate launch`` for two."""
    return subprocess.run(lora_command(args, processes), env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout)


def run_info(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text(encoding="utf-8"))


def tail(proc) -> str:
    return proc.stdout[-3000:] + proc.stderr[-3000:]


def wait_for_training(out: Path, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    """Until the run in ``out`` has logged a training loss (a signal sent then lands mid-training)."""
    deadline = time.monotonic() + timeout_s
    while not [m for m in (load_run(out)["metrics"] if (out / "run.json").exists() else []) if "loss" in m]:
        assert proc.poll() is None and time.monotonic() < deadline, "training never started"
        time.sleep(0.2)


def write_data(folder: Path, rows: int = 14) -> Path:
    """A copy of the first rows of the tiny data (of 14, a tenth, one row, is held out), in a folder named with
    spaces and non-ASCII letters."""
    folder.mkdir(parents=True)
    source = REPO_ROOT / "assets" / "tiny" / "data" / "instructions_train.jsonl"
    path = folder / "train set.jsonl"
    path.write_text("".join(source.read_text(encoding="utf-8").splitlines(keepends=True)[:rows]), encoding="utf-8")
    return path


OFFLINE_GUARD = """
    import ipaddress, os, socket

    LOG = os.environ["COURSE_TEST_NET_LOG"]

    def _note(line):
        with open(LOG, "a", encoding="utf-8") as f:
            f.write(line + "\\n")

    def _local(host):
        if host in (None, "", "localhost"):
            return True
        try:
            return ipaddress.ip_address(host.split("%")[0]).is_loopback
        except ValueError:
            return False

    def _check(address):
        if isinstance(address, tuple) and not _local(address[0]):
            _note(f"blocked {address!r}")
            raise OSError(f"network access blocked by the offline test: {address!r}")

    _connect, _connect_ex, _getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

    def connect(self, address):
        _check(address)
        return _connect(self, address)

    def connect_ex(self, address):
        _check(address)
        return _connect_ex(self, address)

    def getaddrinfo(host, *args, **kwargs):
        _check((host if isinstance(host, str) or host is None else host.decode(), 0))
        return _getaddrinfo(host, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo
    _note(f"guard active in {os.getpid()}")
"""


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The uninterrupted 1-process run every 1-process fault is compared with. It runs the whole tiny
    pipeline (generation evaluation included) with no network beyond loopback, on a data file and into a
    results folder whose paths have spaces and non-ASCII letters."""
    tmp = tmp_path_factory.mktemp("one")
    data = write_data(tmp / "dätä mit Leerzeichen")
    net_log = tmp / "network.log"
    env = with_sitecustomize(env_for(tmp, COURSE_TEST_NET_LOG=net_log), tmp / "guard", OFFLINE_GUARD)
    out = tmp / "rüns ünd spaces" / "baseline"
    proc = lora([*ONE_PROCESS_ARGS, "--data-file", data, "--output-dir", out], env)
    return {"tmp": tmp, "data": data, "out": out, "proc": proc, "net_log": net_log}


@pytest.mark.slow
def test_tiny_pipeline_runs_offline_with_spaces_and_non_ascii_paths(one_process):
    proc, out = one_process["proc"], one_process["out"]
    assert proc.returncode == 0, tail(proc)
    log = one_process["net_log"].read_text(encoding="utf-8")
    assert "guard active" in log  # the guard was loaded in the training process
    assert "blocked" not in log, log  # and nothing tried to leave the machine (not even a swallowed attempt)
    info, summary = run_info(out), load_run(out)["summary"]
    assert info["status"] == "complete" and info["config"]["data_file"] == str(one_process["data"])
    assert summary["exact_match_after"] is not None and summary["steps"] == ONE_PROCESS_STEPS
    assert [s for s, _ in logged_losses(out)] == list(range(1, ONE_PROCESS_STEPS + 1))
    # weights as safetensors, in the adapter and in every checkpoint; never a pickled weights file
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    for checkpoint in (out / "checkpoints").glob("checkpoint-*"):
        assert (checkpoint / "adapter_model.safetensors").is_file() and checkpoint_problem(checkpoint) is None
    assert not list(out.rglob("*model*.bin"))
    # a token in the environment reaches no file of the results folder
    assert not [p for p in out.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


@pytest.mark.slow
def test_crash_then_resume_passes_over_a_truncated_checkpoint_and_reproduces_the_losses(one_process):
    tmp, baseline = one_process["tmp"], one_process["out"]
    assert one_process["proc"].returncode == 0, tail(one_process["proc"])
    out = tmp / "rüns ünd spaces" / "crashed"
    args = [*ONE_PROCESS_ARGS, "--data-file", one_process["data"], "--output-dir", out]
    crashed = lora(args, env_for(tmp, COURSE_CRASH_AT_STEP=7))
    assert crashed.returncode != 0 and "injected crash at step 7" in crashed.stderr
    assert "batch of 3" not in crashed.stdout  # not an out-of-memory error: no retry with a smaller batch
    assert run_info(out)["status"] == "failed" and not (out / "summary.json").exists()
    # the newest two are kept
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-4", "checkpoint-6"]
    assert find_resume_checkpoint(out / "checkpoints")[0].name == "checkpoint-6"

    # 4,000 bytes inside the newest checkpoint's weights change on disk (same size, headers intact): its hash
    # gives it away and the resume must take the one before
    weights = out / "checkpoints" / "checkpoint-6" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5000:-1000] = bytes(4000)
    weights.write_bytes(bytes(data))
    resumed = lora([*args, "--resume"], env_for(tmp))
    assert resumed.returncode == 0, tail(resumed)
    assert ("passing over checkpoint-6: adapter_model.safetensors changed since it was saved (its SHA-256 differs)"
            in resumed.stderr)

    info, summary = run_info(out), load_run(out)["summary"]
    assert info["status"] == "complete" and info["error"] is None
    assert [(r["from_step"], r["previous_status"], r["set_aside"]) for r in info["resumes"]] == [
        (4, "failed", ["incomplete-checkpoint-6"])]
    assert summary["resumed_from_step"] == 4 and summary["steps"] == ONE_PROCESS_STEPS
    assert summary["local_batch_size"] == 4
    assert logged_losses(out) == logged_losses(baseline)  # every step, exactly: same data order, RNG and optimizer state
    assert summary["train_loss_first"] == load_run(baseline)["summary"]["train_loss_first"]

    # preempted again, after its last step (in the final evaluation): a second resume finishes it from
    # checkpoint-8 without training a step past --max-steps
    (out / "summary.json").unlink()
    (out / "run.json").write_text(json.dumps({**run_info(out), "status": "interrupted"}), encoding="utf-8")
    finished = lora([*args, "--resume"], env_for(tmp))
    assert finished.returncode == 0, tail(finished)
    assert "checkpoint-8 is the last step" in finished.stdout
    again = load_run(out)["summary"]
    assert again["steps"] == ONE_PROCESS_STEPS and again["resumed_from_step"] == ONE_PROCESS_STEPS
    assert again["eval_loss"] == summary["eval_loss"]  # the same weights, evaluated again
    assert max(m["step"] for m in load_run(out)["metrics"]) == ONE_PROCESS_STEPS
    assert not (out / "checkpoints" / f"checkpoint-{ONE_PROCESS_STEPS + 1}").exists()
    assert [r["from_step"] for r in run_info(out)["resumes"]] == [4, ONE_PROCESS_STEPS]


def _fake_checkpoint(folder: Path, step: int, whole: bool = True) -> Path:
    checkpoint = folder / f"checkpoint-{step}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (checkpoint / "optimizer.pt").write_bytes(b"x" * 100)
    if whole:
        write_checkpoint_manifest(checkpoint)
    return checkpoint


def test_resume_never_silently_starts_from_scratch(tmp_path):
    folder = tmp_path / "checkpoints"
    with pytest.raises(UserError, match="There is no checkpoint in .* to resume from"):
        find_resume_checkpoint(folder)
    _fake_checkpoint(folder, 2)
    _fake_checkpoint(folder, 4, whole=False)  # cut short before its manifest
    (_fake_checkpoint(folder, 6) / "optimizer.pt").write_bytes(b"x" * 10)  # truncated afterwards
    (_fake_checkpoint(folder, 8) / "optimizer.pt").write_bytes(b"x" * 99 + b"y")  # one byte changed
    chosen, skipped = find_resume_checkpoint(folder)
    assert chosen.name == "checkpoint-2"
    assert skipped == [("checkpoint-8", "optimizer.pt changed since it was saved (its SHA-256 differs)"),
                       ("checkpoint-6", "optimizer.pt has 10 bytes instead of 100"),
                       ("checkpoint-4", "it was not finished (no manifest)")]
    (folder / "checkpoint-2" / CHECKPOINT_MANIFEST).unlink()
    with pytest.raises(UserError, match=r"No checkpoint in .* can be resumed from \(checkpoint-8: optimizer.pt"):
        find_resume_checkpoint(folder)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The uninterrupted 2-process run, launched while a stray user-level accelerate config (4 processes,
    fp16) sits in HF_HOME: the course's explicit --config_file must win."""
    tmp = tmp_path_factory.mktemp("two")
    stray = tmp / "hf_home" / "accelerate" / "default_config.yaml"
    stray.parent.mkdir(parents=True)
    stray.write_text("distributed_type: MULTI_CPU\nnum_processes: 4\nmixed_precision: fp16\nuse_cpu: true\n")
    out = tmp / "baseline"
    # 6 eval rows: 3 per rank, fewer than a batch of 4; evaluation must not drop them (eval_loss not None)
    proc = lora([*ARGS, "--eval-rows", "6", "--skip-generation-eval", "--timeout-s", "60", "--output-dir", out],
                env_for(tmp), processes=2)
    return {"tmp": tmp, "out": out, "proc": proc}


@pytest.mark.slow
def test_rank_exit_ends_the_job_naming_it_and_a_resume_reproduces_the_losses(two_processes):
    tmp, baseline = two_processes["tmp"], two_processes["out"]
    assert two_processes["proc"].returncode == 0, tail(two_processes["proc"])
    info = run_info(baseline)
    assert info["world_size"] == 2 and info["backend"] == "gloo"  # not the stray config's 4 processes
    # the course's own default precision, not the stray config's fp16
    assert load_run(baseline)["summary"]["mixed_precision"] == default_mixed_precision("none")
    assert load_run(baseline)["summary"]["eval_loss"] is not None

    out = tmp / "crashed"
    args = [*ARGS, "--eval-rows", "6", "--skip-generation-eval", "--timeout-s", "60", "--output-dir", out]
    crashed = lora(args, env_for(tmp, COURSE_CRASH_AT_STEP=5, COURSE_CRASH_RANK=1, COURSE_CRASH_MODE="exit"),
                   processes=2)
    assert crashed.returncode != 0
    info = run_info(out)
    assert info["status"] == "failed" and not (out / "summary.json").exists()
    # rank 0 names the rank that went away; the launcher's report names it as the first failure too
    assert info["error"].startswith("RankFailure: rank 1 stopped"), info["error"]
    assert "rank      : 1" in crashed.stderr and "Root Cause" in crashed.stderr

    resumed = lora([*args, "--resume"], env_for(tmp), processes=2)
    assert resumed.returncode == 0, tail(resumed)
    info = run_info(out)
    assert info["status"] == "complete" and [r["from_step"] for r in info["resumes"]] == [4]
    assert logged_losses(out) == logged_losses(baseline)  # both ranks' data, RNG and optimizer state restored exactly
    assert [s for s, _ in logged_losses(out)] == list(range(1, STEPS + 1))  # no step recorded twice


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_the_timeout_and_every_message_names_it(tmp_path):
    out, timeout_s = tmp_path / "stopped", 8
    cmd = accelerate_command("my_utils.workflows.lora", [*ARGS, "--eval-rows", "6", "--skip-generation-eval",
                                                         "--timeout-s", timeout_s, "--output-dir", out],
                             num_processes=2, config_file=REPO_ROOT / "configs" / "cpu_x2.yaml")
    # rank 1 sends itself SIGSTOP after step 2: alive, but deaf even to the launcher's SIGTERM
    env = env_for(tmp_path, COURSE_CRASH_AT_STEP=2, COURSE_CRASH_RANK=1, COURSE_CRASH_MODE="stop")
    launcher = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    guard = threading.Timer(180, launcher.kill)  # torch's default would wait 30 minutes: bound a failing test
    guard.start()
    lines, stopped_at = [], None
    for line in launcher.stdout:
        lines.append(line)
        if "fault injection: stop" in line:
            stopped_at = time.monotonic()
    launcher.wait()
    guard.cancel()
    output = "".join(lines)
    assert launcher.returncode != 0 and stopped_at is not None, output[-3000:]
    took = time.monotonic() - stopped_at
    # the collective's timeout, the 3 s in which live ranks report, and the end of the job: not torch's 30 s wait
    # for a process that ignores SIGTERM
    assert took < timeout_s + 12, f"the job ended {took:.0f} s after rank 1 stopped\n{output[-3000:]}"
    info = run_info(out)
    assert info["status"] == "failed"
    assert info["error"].startswith("RankFailure: rank 1 stopped"), info["error"]
    assert f"--timeout-s {timeout_s}" in info["error"]
    # the same rank on stderr (one line: no worker prints a traceback, the launcher's own comes before its summary)
    # and in the launcher's report: rank 1 killed, rank 0's failure read from its error file. Which of the two the
    # report calls "Root Cause" is torch's choice (the earliest timestamp, kept to the second), so either.
    assert "lora: error: rank 1 stopped" in output
    assert output.split("ChildFailedError")[0].count("Traceback (most recent call last)") == 1
    report = output.split("Failures:")[1]
    failures = {int(block.split("rank      : ")[1].split()[0]): block for block in report.split("host      :")[1:]}
    assert sorted(failures) == [0, 1], report
    assert "SIGKILL" in failures[1] and "error_file: <N/A>" in failures[1], failures[1]
    assert "error_file: /" in failures[0] and "RankFailure: rank 1 stopped" in failures[0], failures[0]
    print(f"stopped rank: the job ended {took:.0f} s after rank 1 stopped (--timeout-s {timeout_s})")


@pytest.mark.slow
def test_sigterm_under_accelerate_launch_stops_both_workers_with_a_checkpoint(tmp_path):
    out = tmp_path / "preempted"
    cmd = accelerate_command("my_utils.workflows.lora",
                             [*ARGS, "--eval-rows", "6", "--skip-generation-eval", "--output-dir", out],
                             num_processes=2, config_file=REPO_ROOT / "configs" / "cpu_x2.yaml")
    # slow steps leave time to send the signal mid-training, as a scheduler preempting the job would
    launcher = subprocess.Popen(cmd, env=env_for(tmp_path, COURSE_STEP_DELAY_S=0.5), cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_training(out, launcher)
    launcher.send_signal(signal.SIGTERM)  # to the launcher, which forwards it to both workers
    output = launcher.communicate(timeout=120)[0]
    assert launcher.returncode != 0

    info = run_info(out)
    assert info["status"] == "interrupted", output[-3000:]
    assert "SIGTERM" in info["error"] and "--resume" in info["error"]
    assert not (out / "summary.json").exists()  # nothing half-written
    assert not list(out.rglob("*.tmp"))
    assert output.count("lora: interrupted (SIGTERM") == 1, output[-3000:]  # said once for the job, not per worker
    checkpoint, skipped = find_resume_checkpoint(out / "checkpoints")
    step = int(checkpoint.name.split("-")[1])
    assert skipped == [] and 1 <= step < STEPS
    assert {"rng_state_0.pth", "rng_state_1.pth", "adapter_model.safetensors"} <= {
        p.name for p in checkpoint.iterdir()}  # both workers stopped cleanly at the step, neither was killed
    assert max(s for s, _ in logged_losses(out)) == step


@pytest.mark.slow
def test_ctrl_c_stops_as_sigterm_does_with_a_checkpoint_the_reason_and_the_resume_line(tmp_path):
    out = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "my_utils.workflows.lora", *map(str, ARGS), "--eval-rows", "6",
           "--skip-generation-eval", "--output-dir", str(out)]
    proc = subprocess.Popen(cmd, env=env_for(tmp_path, COURSE_STEP_DELAY_S=0.5), cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_training(out, proc)
    proc.send_signal(signal.SIGINT)  # what a terminal sends its foreground process on Ctrl-C
    output = proc.communicate(timeout=120)[0]

    assert proc.returncode == 130, output[-3000:]
    info = run_info(out)
    assert info["status"] == "interrupted" and "Ctrl-C" in info["error"] and "--resume" in info["error"], info
    assert output.count("lora: interrupted (Ctrl-C") == 1 and "Traceback" not in output, output[-3000:]
    assert not (out / "summary.json").exists()
    checkpoint, skipped = find_resume_checkpoint(out / "checkpoints")
    step = int(checkpoint.name.split("-")[1])
    assert skipped == [] and 1 <= step < STEPS and max(s for s, _ in logged_losses(out)) == step, "a checkpoint at the step"


@pytest.mark.slow
def test_ctrl_c_before_the_first_step_says_how_to_start_again_in_the_same_folder(tmp_path):
    out = tmp_path / "early"
    cmd = [sys.executable, "-m", "my_utils.workflows.lora", *map(str, ARGS), "--eval-rows", "64", "--output-dir",
           str(out)]
    proc = subprocess.Popen(cmd, env=env_for(tmp_path), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (out / "run.json").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)  # the folder exists; the generation evaluation before training is under way
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output[-3000:]
    said = f"lora: interrupted (Ctrl-C before the first step; run it again with --output-dir {out}, which reuses"
    assert said in output and "Traceback" not in output, output[-3000:]
    assert run_info(out)["status"] == "interrupted" and not (out / "checkpoints").exists()
    again = lora([*ARGS, "--skip-generation-eval", "--output-dir", out], env_for(tmp_path))
    assert again.returncode == 0 and f"reusing {out}: its run stopped before its first step" in again.stderr, tail(again)
    assert run_info(out)["status"] == "complete"


@pytest.mark.slow
def test_auto_batch_size_backs_off_on_out_of_memory(tmp_path):
    # Batches above 5 rows raise torch.OutOfMemoryError: 8 -> 7 -> 6 -> 5 (accelerate takes 90% each time).
    # That other errors go straight through is checked by the 1-process crash above.
    out = tmp_path / "backed_off"
    proc = lora(["--preset", "tiny", "--max-steps", "2", "--logging-steps", "1", "--local-batch-size", "8",
                 "--eval-rows", "8", "--skip-generation-eval", "--auto-batch-size", "--output-dir", out],
                env_for(tmp_path, COURSE_FAKE_OOM_ABOVE=5))
    assert proc.returncode == 0, tail(proc)
    assert [f"batch of {n} x" in proc.stdout for n in (8, 7, 6, 5)] == [True] * 4
    summary = load_run(out)["summary"]
    assert (summary["local_batch_size_requested"], summary["local_batch_size"]) == (8, 5)
    assert summary["global_batch_size"] == 5 and summary["first_batches"][0]["batch_size"] == 5
    assert run_info(out)["status"] == "complete" and [s for s, _ in logged_losses(out)] == [1, 2]


RENAME_FAILS = """
    import os

    _replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if os.path.basename(dst) == "summary.json":
            raise OSError("injected failure between writing and renaming summary.json")
        return _replace(src, dst, *args, **kwargs)

    os.replace = replace
"""


@pytest.mark.slow
def test_a_failed_rename_leaves_no_summary_and_compare_ignores_temporary_files(tmp_path, one_process):
    root = tmp_path / "runs"
    out = root / "rename_fails"
    env = with_sitecustomize(env_for(tmp_path), tmp_path / "rename", RENAME_FAILS)
    proc = lora(["--preset", "tiny", "--max-steps", "2", "--local-batch-size", "4", "--eval-rows", "8",
                 "--skip-generation-eval", "--output-dir", out], env)
    assert proc.returncode != 0 and "injected failure between writing and renaming" in proc.stderr
    info = run_info(out)  # rewritten atomically along the way: still whole JSON
    assert info["status"] == "failed" and "summary.json" in info["error"]
    assert not (out / "summary.json").exists() and not list(out.glob("*.tmp"))

    # a hard kill between write and rename leaves temporary files: comparisons never read them
    (out / ".summary.json.k1.tmp").write_text('{"steps": 2, "samples_per_s": 1e9, "train_lo')
    (out / ".run.json.k2.tmp").write_text('{"status": "complete"}')
    complete, other = load_runs(root, one_process["out"])
    assert [r["path"] for r in complete] == [str(one_process["out"])]
    assert [(r["path"], r["reason"]) for r in other] == [(str(out), "failed")]


DISK_FULL = """
    import errno

    import safetensors.torch

    def save_file(tensors, filename, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    safetensors.torch.save_file = save_file
"""


@pytest.mark.slow
@pytest.mark.parametrize("workflow", ["lora", "sharded_lora"])
def test_a_full_disk_during_a_save_fails_the_run_in_one_sentence(tmp_path, workflow):
    """Every safetensors write refused as a full disk refuses it: the run is marked failed, not left running, and
    every rank ends with one sentence and exit 2."""
    out = tmp_path / "full"
    env = with_sitecustomize(env_for(tmp_path), tmp_path / "disk_full", DISK_FULL)
    if workflow == "lora":
        proc = lora(["--preset", "tiny", "--max-steps", "2", "--local-batch-size", "4", "--eval-rows", "8",
                     "--skip-generation-eval", "--output-dir", out], env)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, tail(proc)
    else:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               "-m", "my_utils.workflows.sharded_lora", "--preset", "tiny", "--max-steps", "2",
                               "--output-dir", str(out)], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode != 0, tail(proc)
    said = [line for line in proc.stderr.splitlines() if "error: The disk is full writing" in line]
    assert len(said) == 1 and "(No space left on device); free space there" in said[0], tail(proc)
    info = run_info(out)
    assert info["status"] == "failed" and "The disk is full writing" in info["error"], info
