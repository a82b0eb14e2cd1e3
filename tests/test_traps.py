"""The traps that need several processes spring and are cured on 2 CPU processes (each worker sees a world of 2),
the course's Trainer refuses an unwrapped model under several processes, and bad settings are one sentence."""

import json
import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

from my_utils.workflows import traps


@pytest.mark.slow
def test_every_trap_springs_and_every_cure_holds(tmp_path):
    from my_utils.core.paths import REPO_ROOT

    out = tmp_path / "traps"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "my_utils.workflows.traps", "--preset", "tiny", "--output-dir", out]
    proc = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers = [json.loads(p.read_text()) for p in sorted((out / "workers").glob("rank_*.json"))]
    assert [w["world_size"] for w in workers] == [2, 2]
    result = json.loads((out / "summary.json").read_text())["traps"]
    # what it prints: a table, a row for each trap and its cure, no dicts, and no warning about the trap's own setting
    table = proc.stdout.split("results folder:")[1]
    assert [line.split()[:2] for line in table.splitlines() if line.startswith(tuple(result))] == [
        [trap, run] for trap in result for run in ("trap", "cure", "guarded") if run in result[trap]]
    assert "{'" not in proc.stdout and "find_unused_parameters" not in proc.stdout + proc.stderr
    assert list(result) == list(traps.TRAPS)
    reentrant, first, saved, upcast = (result[name] for name in traps.TRAPS)
    assert reentrant["trap"]["error"] == "Expected to mark a variable ready only once."
    assert reentrant["cure"]["error"] is None and reentrant["cure"]["adapter_spread"] == 0
    assert first["trap"]["wrapped"] == "PeftModelForCausalLM" and first["trap"]["adapter_spread"] > 1e-4
    assert first["cure"]["wrapped"] == "DistributedDataParallel" and first["cure"]["adapter_spread"] == 0
    assert "without a data-parallel wrapper" in first["guarded"]["error"]
    naive = {"deepspeed_zero3": 0, "fsdp2": saved["expected_elements"] // 2}[saved["form"]]
    assert saved["form"] == ("deepspeed_zero3" if find_spec("deepspeed") else "fsdp2")
    assert saved["trap"]["elements"] == naive and saved["cure"]["elements"] == saved["expected_elements"] > 0
    assert "size mismatch" in saved["trap"]["error"] and saved["cure"]["logit_gap"] < 1e-4
    # each of the 2 ranks stores half the frozen bfloat16 base; upcast first, as much as the whole of it
    assert upcast["cure"]["frozen_bytes_per_rank"] == [upcast["unsharded_frozen_bytes"] // 2] * 2
    assert upcast["trap"]["frozen_bytes_per_rank"] == [upcast["unsharded_frozen_bytes"]] * 2


@pytest.mark.slow
def test_the_sharded_save_trap_springs_under_fsdp2_too(tmp_path):
    from my_utils.core.paths import REPO_ROOT

    out = tmp_path / "traps"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "my_utils.workflows.traps", "--preset", "tiny", "--traps", "sharded_save", "--zero3", "fsdp2",
           "--output-dir", out]
    proc = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads((out / "summary.json").read_text())["traps"]["sharded_save"]
    assert saved["form"] == "fsdp2" and 2 * saved["trap"]["elements"] == saved["expected_elements"]
    assert "size mismatch" in saved["trap"]["error"] and saved["cure"]["logit_gap"] < 1e-4


def test_an_unwrapped_model_under_several_processes_is_refused():
    import torch

    from my_utils import UserError
    from my_utils.run.faults import check_wrapped

    model = torch.nn.Linear(2, 2)
    check_wrapped(model, 1)  # one process: nothing to synchronise
    with pytest.raises(UserError, match="on 2 processes without a data-parallel wrapper"):
        check_wrapped(model, 2)
    wrapped = type("DistributedDataParallel", (torch.nn.Module,), {})()  # the wrapper is recognised by its class
    check_wrapped(wrapped, 2)


@pytest.mark.parametrize("args, message", [
    (["--traps", "oom"], "Unknown trap 'oom'; choose one of reentrant_ddp, evaluate_first, sharded_save"),
    (["--max-steps", "0"], "--max-steps must be a positive integer, got 0"),
    (["--zero3", "fsdp1"], "invalid choice"),
    ([], "my_utils.workflows.traps needs 2 or more processes"),  # this test is one process
])
def test_bad_settings_are_one_sentence_and_write_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        traps.main([*args, "--output-dir", str(out)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not out.exists()
