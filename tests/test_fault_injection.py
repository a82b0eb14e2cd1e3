"""Failure injection, torchft's way: a fault injected at a chosen step and rank under ``torchrun --max-restarts 1``,
each of the three kinds (a SIGKILL, a hang, an exception) in one of the LoRA, sharded LoRA and tensor-parallel
workflows (every kind in every workflow costs three times the minutes, for the same code paths: the fault's kind
only changes how the other rank learns of it, which the naming tests below cover). The launcher restarts the
workers, they resume by themselves from the newest whole checkpoint, and the run ends with the losses and the
final tensors (the adapter, or the tensor-parallel model's shards) of a run without the fault, exactly.

And when nothing restarts the job, the rank that died or hung is named, with its step, in run.json and in one
sentence, also during set-up, within ``--timeout-s``. Faults come from the COURSE_CRASH_* variables
(``my_utils/run/faults.py``)."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import logged_losses

from my_utils.core.paths import REPO_ROOT

TIMEOUT_S = 10  # --timeout-s: how long a live rank waits in a collective for a hung one
FAULT_STEP = 3  # between the checkpoints of steps 2 and 4: the restart resumes from step 2
WORKFLOWS = {
    "lora": ["--preset", "tiny", "--max-steps", "6", "--save-steps", "2", "--logging-steps", "1",
             "--local-batch-size", "4", "--eval-rows", "6", "--skip-generation-eval"],
    # adapter dropout on: a resume is exact only if every rank's random-number state comes back with the checkpoint
    "sharded_lora": ["--preset", "tiny", "--max-steps", "6", "--save-steps", "2", "--dropout", "0.1"],
    "tensor_parallel": ["--preset", "tiny", "--max-steps", "6", "--save-steps", "2"],
}
RESTART_CASES = [("lora", "kill"), ("sharded_lora", "stop"), ("tensor_parallel", "raise")]


def torchrun(workflow: str, out, *launcher_args, extra=(), **faults) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1",
           "HF_HOME": str(out.parent / "hf_home"), **{k: str(v) for k, v in faults.items()}}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *launcher_args,
           "-m", f"my_utils.workflows.{workflow}", *WORKFLOWS.get(workflow, ["--preset", "tiny"]), *extra,
           "--timeout-s", str(TIMEOUT_S), "--output-dir", str(out)]
    return subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)


def tail(proc) -> str:
    return proc.stdout[-2000:] + proc.stderr[-4000:]


def run_info(out) -> dict:
    return json.loads((out / "run.json").read_text())


def final_tensors(workflow: str, out) -> dict:
    """The trained state at the end: the saved adapter, or (tensor parallel) the last step's distributed
    checkpoint, every process's shards read back into whole tensors."""
    if workflow != "tensor_parallel":
        from safetensors.torch import load_file

        return load_file(out / "adapter" / "adapter_model.safetensors")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = out.parent / f"{out.name}.pt"
    dcp_to_torch_save(out / "checkpoints" / "checkpoint-6", whole)
    state = torch.load(whole, weights_only=True)
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    for name, values in state["optimizer"]["state"].items():
        flat |= {f"optimizer.{name}.{k}": v for k, v in values.items()}
    return flat


def worlds_seen(workflow: str, out) -> list[int]:
    if workflow == "tensor_parallel":
        return json.loads((out / "summary.json").read_text())["world_sizes_seen"]
    return [json.loads(p.read_text())["world_size"] for p in sorted((out / "workers").glob("rank_*.json"))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each workflow once, under the same launcher, without a fault."""
    runs = {}
    for workflow in WORKFLOWS:
        out = tmp_path_factory.mktemp(workflow) / "whole"
        proc = torchrun(workflow, out)
        assert proc.returncode == 0, tail(proc)
        runs[workflow] = out
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("workflow, mode", RESTART_CASES)
def test_a_fault_at_a_step_restarts_and_ends_with_the_tensors_of_a_run_without_it(workflow, mode, uninterrupted,
                                                                                   tmp_path):
    out = tmp_path / f"{mode}"
    proc = torchrun(workflow, out, "--max-restarts", "1", COURSE_CRASH_AT_STEP=FAULT_STEP, COURSE_CRASH_RANK=1,
                    COURSE_CRASH_MODE=mode)
    assert proc.returncode == 0, tail(proc)
    assert f"fault injection: {mode} at step {FAULT_STEP} on rank 1" in proc.stderr  # the fault did happen
    info, baseline = run_info(out), uninterrupted[workflow]
    assert info["status"] == "complete" and [r["from_step"] for r in info["resumes"]] == [2], info.get("resumes")
    assert worlds_seen(workflow, out) == [2, 2]
    assert logged_losses(out) == logged_losses(baseline)
    expected, got = final_tensors(workflow, baseline), final_tensors(workflow, out)
    assert got.keys() == expected.keys() and len(got) > 0
    unequal = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert not unequal, f"{len(unequal)} of {len(expected)} final tensors differ, e.g. {unequal[:3]}"


# Where the launcher does not restart, the dead or hung rank is named (the test's question: which words, how soon)
NAMED = {
    "kill": "rank 1 stopped (its process ended without a word: killed by a signal, or exited at once)",
    "raise": "rank 1 stopped (it failed with RuntimeError: injected crash",
    "stop": "rank 1 stopped (its process is alive but did not answer: hung or stopped)",
}


@pytest.mark.slow
@pytest.mark.parametrize("workflow, mode, step", [
    ("sharding", "kill", 2), ("pipeline_parallel", "kill", 2), ("tensor_parallel", "raise", 2),
    ("tensor_parallel", "stop", 0), ("tensor_parallel", "kill", 0),  # 0: during set-up
])
def test_a_rank_that_dies_or_hangs_is_named_with_its_step_within_the_timeout(workflow, mode, step, tmp_path):
    out = tmp_path / "run"
    extra = ["--strategies", "ddp", "--max-steps", "4"] if workflow == "sharding" else []
    started = time.monotonic()
    proc = torchrun(workflow, out, extra=extra, COURSE_CRASH_AT_STEP=step, COURSE_CRASH_RANK=1,
                    COURSE_CRASH_MODE=mode)
    took = time.monotonic() - started
    assert proc.returncode == 1, tail(proc)
    said = [line for line in proc.stderr.splitlines() if line.startswith(f"{workflow}: error:")]
    assert len(said) == 1 and NAMED[mode] in said[0], tail(proc)  # one sentence, the rank and its fate
    assert (f"after step {step}" in said[0]) == (step > 0), said[0]  # the step, where training had begun
    assert "[rank0]: Traceback" not in proc.stderr  # no worker's traceback: the launcher's report follows
    if (out / "run.json").exists():  # a rank that died before the results folder was agreed on leaves none
        info = run_info(out)
        assert info["status"] == "failed" and info["error"].startswith(f"RankFailure: {NAMED[mode]}"), info
    else:
        assert step == 0 and mode == "kill"
    # a hang costs the collectives' timeout and the 3 s in which live ranks report, not torch's 30 minutes
    assert took < TIMEOUT_S + 40, f"{took:.0f} s"
    print(f"{workflow}, {mode} at step {step}: named after {took:.0f} s (the job's start included)")
