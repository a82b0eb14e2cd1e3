import json
import os

import pytest

from my_utils import UserError
from my_utils.run import results


def test_create_writes_running_run_json(tmp_path):
    run = results.Run.create(tmp_path / "r", config={"rank": 8}, command=["x"])
    info = json.loads((tmp_path / "r" / "run.json").read_text())
    assert info["status"] == "running"
    assert info["config"] == {"rank": 8}
    assert set(info) >= {"commit", "dirty", "versions", "started", "command"}
    assert info["versions"]["torch"].startswith("2.13.0")
    run.log_metrics({"step": 1, "loss": 2.0})
    run.log_metrics({"step": 2, "loss": 1.0})
    run.finish({"loss": 1.0})
    loaded = results.load_run(tmp_path / "r")
    assert loaded["run"]["status"] == "complete" and loaded["run"]["finished"]
    assert loaded["summary"] == {"loss": 1.0}
    assert [m["step"] for m in loaded["metrics"]] == [1, 2]


def test_existing_folder_is_never_overwritten(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="already exists"):
        results.Run.create(tmp_path / "r", config={})
    assert os.listdir(tmp_path / "r") == ["keep.txt"]


def test_atomic_write_keeps_previous_file_when_writing_fails(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    results.atomic_write_json(target, {"v": 1})

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(results.os, "replace", broken_replace)
    with pytest.raises(OSError):
        results.atomic_write_json(target, {"v": 2})
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"], "temporary file left behind"


def test_fail_marks_status(tmp_path):
    run = results.Run.create(tmp_path / "r", config={})
    run.fail("boom", status="interrupted")
    info = run.info
    assert info["status"] == "interrupted" and info["error"] == "boom"


def test_next_run_root_and_unique_dir(tmp_path):
    assert results.next_run_root("cpu", 2, tmp_path).name == "run_1_cpu_x2"
    (tmp_path / "run_1_cpu_x2").mkdir()
    (tmp_path / "run_7_cuda_x8").mkdir()
    assert results.next_run_root("cpu", 2, tmp_path).name == "run_8_cpu_x2"
    assert results.unique_dir(tmp_path / "run_1_cpu_x2").name == "run_1_cpu_x2_2"
    assert results.unique_dir(tmp_path / "free").name == "free"


def test_find_run_dirs_and_truncated_metrics(tmp_path):
    for name in ("a", "b/c"):
        results.Run.create(tmp_path / name, config={})
    (tmp_path / "a" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')
    assert [p.relative_to(tmp_path).as_posix() for p in results.find_run_dirs(tmp_path)] == ["a", "b/c"]
    assert results.load_run(tmp_path / "a")["metrics"] == [{"step": 1}]


def test_lesson_dir_uses_course_run_root(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_RUN_ROOT", str(tmp_path))
    assert results.lesson_dir("04_lora") == tmp_path / "04_lora"
    (tmp_path / "04_lora").mkdir()
    assert results.lesson_dir("04_lora") == tmp_path / "04_lora_2"


def test_the_command_is_recorded_without_a_kernels_connection_file(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["/opt/env/bin/lora.py", "--preset", "tiny"])
    assert results.Run.create(tmp_path / "a", config={}).info["command"] == ["lora.py", "--preset", "tiny"]
    monkeypatch.setattr("sys.argv", ["/opt/env/ipykernel_launcher.py", "-f", "/tmp/tmpabc.json"])
    assert results.Run.create(tmp_path / "b", config={}).info["command"] == ["ipykernel_launcher.py"]
