"""The GPU check (``python -m my_utils gpucheck``) on a machine without CUDA: its plan, its quick run at tiny sizes
(every part that can run on a CPU runs; the rest is skipped with its reason), checks that fail when their figure
says so, and bad input."""

import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from my_utils import UserError
from my_utils.core.paths import REPO_ROOT
from my_utils.tools import gpucheck

pytestmark = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="describes a machine without CUDA")


def run(*args, env):
    return subprocess.run([sys.executable, "-m", "my_utils", "gpucheck", *map(str, args)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)


def test_dry_run_lists_every_part_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "check"
    assert gpucheck.main(["--dry-run", "--output-dir", str(out)]) is None
    lines = capsys.readouterr().out.splitlines()
    assert {line.split()[0] for line in lines} == set(gpucheck.PARTS)
    skipped = {line.split()[1]: line.split("skipped: ", 1)[1] for line in lines if "skipped: " in line}
    levers = "a GPU's figure (lesson 15 measures the levers on a CPU)"
    assert skipped == {"pytest": "no CUDA device here", "lora_fp16": "fp16 mixed precision needs a GPU",
                       "lora_compile": levers, "lora_checkpointing": levers}
    assert sum(line.startswith("planner") for line in lines) == 12  # 3 architectures x LoRA, full x 2 losses
    assert not out.exists()


@pytest.mark.slow
def test_quick_run_on_a_cpu_runs_what_it_can_and_says_why_not_the_rest(tmp_path, subprocess_env):
    out = tmp_path / "check"
    proc = run("--quick", "--output-dir", out, env=subprocess_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((out / "run.json").read_text())["status"] == "complete"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cuda"] is False and summary["quick"] is True
    commands = {f"{part}/{name}": c for part, entry in summary["parts"].items() for name, c in entry["commands"].items()}
    assert commands["tests/pytest"] == {"status": "skipped", "reason": "no CUDA device here"}
    assert commands["series/lora_fp16"]["reason"] == "fp16 mixed precision needs a GPU"
    assert commands["series/lora_seed1"]["reason"] == "--quick runs one seed"
    ran = [name for name, c in commands.items() if c["status"] != "skipped"]
    assert ran and all(commands[name]["status"] == "ok" for name in ran), commands
    lora = commands["series/lora"]["figures"]
    assert lora["memory_columns_filled"] is None  # a CPU has no allocator's columns
    assert all(abs(r - 1) <= gpucheck.PLANNER_TOLERANCE for r in lora["planned_over_measured"].values())
    assert commands["mfu/tiny_b4"]["figures"]["lora"]["attention"] and \
        commands["mfu/tiny_b4"]["figures"]["published_bf16_peak"] is None
    claims = {c["claim"]: c["holds"] for c in summary["checks"]}
    assert any(claim.startswith("the planner predicts") and holds for claim, holds in claims.items())
    assert "checks:" in proc.stdout and "results folder:" in proc.stdout
    # read again with this code: the same commands' outcomes, the same figures, and a note of when
    gpucheck.main(["--collect", str(out)])
    again = json.loads((out / "summary.json").read_text())
    assert again["checks"] == summary["checks"] and again["parts"] == summary["parts"]
    assert again["collected_again"]["at"] and "commit" in again["collected_again"]


def test_a_check_that_ran_nothing_fails_in_one_sentence(tmp_path, capsys):
    out = tmp_path / "check"
    with pytest.raises(UserError) as e:
        gpucheck.main(["--quick", "--budget-s", "1", "--output-dir", str(out)])
    assert str(e.value).startswith("The GPU check ran none of its ") and "so it checked nothing" in str(e.value)
    assert "out of time (--budget-s)" in str(e.value) and str(e.value).count(". ") == 0
    assert json.loads((out / "run.json").read_text())["status"] == "failed"


def _files(folder):
    """Every file under ``folder``: its bytes' hash and its modification time."""
    return {p.relative_to(folder): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_collect_with_dry_run_writes_nothing(tmp_path, capsys):
    folder = tmp_path / "gpu_x1"
    shutil.copytree(REPO_ROOT / "runs" / "reference" / "gpu_x1", folder)
    before = _files(folder)
    gpucheck.main(["--collect", str(folder), "--dry-run"])
    assert "checks:" in capsys.readouterr().out
    assert _files(folder) == before


def test_checks_fail_when_their_figures_say_so():
    def series(filled, ratio):
        return {"status": "ok", "figures": {"memory_columns_filled": filled, "mixed_precision": "no",
                                            "eval_loss": 1.0, "eval_loss_before": 2.0,
                                            "planned_over_measured": {"weights": 1.0, "saved activations": ratio}}}

    parts = {part: {"commands": {}} for part in gpucheck.PARTS}
    parts["series"]["commands"] = {"lora": series(True, 1.0), "full": series(False, 1.3)}
    parts["tests"]["commands"]["pytest"] = {"status": "failed", "figures": {"passed": 3, "failed": ["t::x"],
                                                                              "skipped": 0}}
    found = {c["claim"].split(" ", 3)[1]: c for c in gpucheck.checks(parts, cuda=True, quick=False)}
    assert not found["GPU"]["holds"] and not found["memory"]["holds"] and not found["planner"]["holds"]
    assert found["memory"]["measured"] == "1 of 2 runs filled; empty: full"
    assert not found["precision"]["holds"]  # "no" is not bf16
    parts["series"]["commands"]["full"] = series(True, 1.1)
    parts["tests"]["commands"]["pytest"]["figures"]["failed"] = []
    found = {c["claim"].split(" ", 3)[1]: c for c in gpucheck.checks(parts, cuda=True, quick=False)}
    assert found["GPU"]["holds"] and found["memory"]["holds"] and found["planner"]["holds"]


def test_the_levers_checks_hold_only_when_their_gpu_figures_do():
    def series(**figures):
        return {"status": "ok", "figures": {"memory_columns_filled": True, "mixed_precision": "bf16",
                                            "eval_loss_before": 2.0, "eval_loss": 1.0, "tokens_per_s": 100.0,
                                            "peak_memory_bytes": 1000, "compiled_graphs": None, **figures}}

    parts = {part: {"commands": {}} for part in gpucheck.PARTS}
    parts["series"]["commands"] = {"lora": series(), "lora_compile": series(compiled_graphs=0),
                                   "lora_checkpointing": series(peak_memory_bytes=1200)}
    found = {c["claim"].split(" ", 2)[1]: c for c in gpucheck.checks(parts, cuda=True, quick=True)}
    assert not found["(--compile)"]["holds"]  # nothing compiled
    assert not found["checkpointing"]["holds"]  # a peak that rose
    parts["series"]["commands"]["lora_compile"] = series(compiled_graphs=2, eval_loss=1.005, tokens_per_s=150.0)
    parts["series"]["commands"]["lora_checkpointing"] = series(peak_memory_bytes=600, tokens_per_s=75.0)
    found = {c["claim"].split(" ", 2)[1]: c for c in gpucheck.checks(parts, cuda=True, quick=True)}
    assert found["(--compile)"]["holds"] and "1.50x eager's" in found["(--compile)"]["measured"]
    assert found["checkpointing"]["holds"] and found["checkpointing"]["measured"].startswith("peak 0.60x")
    parts["series"]["commands"]["lora_compile"] = series(compiled_graphs=2, eval_loss=1.5)  # trains off eager
    found = {c["claim"].split(" ", 2)[1]: c for c in gpucheck.checks(parts, cuda=True, quick=True)}
    assert not found["(--compile)"]["holds"]


def test_published_peaks_tell_the_h100_variants_apart():
    assert gpucheck.published_peak("NVIDIA H100 80GB HBM3") == gpucheck.published_peak("NVIDIA H200") == 989.4e12
    assert gpucheck.published_peak("NVIDIA H100 PCIe") == 756.0e12
    assert gpucheck.published_peak("Intel(R) Xeon(R) Processor") is None


@pytest.mark.slow
@pytest.mark.parametrize("args, expected", [
    (["--collect", "configs"], "configs holds no finished GPU check (its summary.json is missing or not a check's); "
                               "name the folder a `python -m my_utils gpucheck` run wrote."),
    (["--parallel", "0"], "--parallel must be a positive integer, got 0."),
    (["--budget-s", "-5"], "--budget-s must be a positive number, got -5.0."),
    (["--budget-s", "nan"], "--budget-s must be a positive number, got nan."),
])
def test_bad_input_is_one_sentence_and_exit_2(args, expected, tmp_path, subprocess_env):
    proc = run(*args, "--output-dir", tmp_path / "check", env=subprocess_env)
    assert proc.returncode == 2 and proc.stderr.strip() == f"my_utils gpucheck: error: {expected}"
    assert not (tmp_path / "check").exists()


@pytest.mark.slow
def test_an_existing_folder_is_never_overwritten(tmp_path, subprocess_env):
    (tmp_path / "check").mkdir()
    (tmp_path / "check" / "keep.txt").write_text("mine")
    proc = run("--quick", "--output-dir", tmp_path / "check", env=subprocess_env)
    assert proc.returncode == 2 and "already exists and is never overwritten" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert (tmp_path / "check" / "keep.txt").read_text() == "mine"
