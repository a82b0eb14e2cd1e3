import json
import os

import pytest

from my_utils import UserError
from my_utils.lessons.notebook import lesson_dir
from my_utils.run import locks, redaction, results


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
    assert lesson_dir("04_lora") == tmp_path / "04_lora"
    (tmp_path / "04_lora").mkdir()
    assert lesson_dir("04_lora") == tmp_path / "04_lora_2"


def test_the_command_is_recorded_without_a_kernels_connection_file(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["/opt/env/bin/lora.py", "--preset", "tiny"])
    assert results.Run.create(tmp_path / "a", config={}).info["command"] == ["lora.py", "--preset", "tiny"]
    monkeypatch.setattr("sys.argv", ["/opt/env/ipykernel_launcher.py", "-f", "/tmp/tmpabc.json"])
    assert results.Run.create(tmp_path / "b", config={}).info["command"] == ["ipykernel_launcher.py"]


def _writer(folder, then: str):
    """A separate process that creates the run in ``folder``, says so, then does ``then``."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import os, sys, time
        from my_utils.run.results import Run
        run = Run.create({str(folder)!r}, config={{}})
        print("created", flush=True)
        {then}""")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_the_writer_lock_tells_a_live_run_from_a_dead_one_whatever_its_pid(tmp_path):
    from my_utils.run.lifecycle import check_resumable

    live = _writer(tmp_path / "live", "time.sleep(60)")
    dead = _writer(tmp_path / "dead", "os._exit(9)")  # SIGKILL-like: no finally, no status written
    try:
        assert live.stdout.readline().strip() == dead.stdout.readline().strip() == "created"
        dead.wait()
        assert results.load_run(tmp_path / "live")["run"]["status"] == "running"
        assert results.load_run(tmp_path / "dead")["run"]["status"] == "crashed"
        # a reused process id (a reboot, a container): run.json names a live process, the lock is gone with the writer
        info = json.loads((tmp_path / "dead" / "run.json").read_text())
        (tmp_path / "dead" / "run.json").write_text(json.dumps({**info, "pid": os.getpid()}))
        assert results.load_run(tmp_path / "dead")["run"]["status"] == "crashed"
        with pytest.raises(UserError, match="is still running"):  # a second writer is refused while one lives
            check_resumable(tmp_path / "live", {})
        check_resumable(tmp_path / "dead", {})  # nobody writes it: it can be resumed
    finally:
        live.kill()
        live.wait()
    assert results.load_run(tmp_path / "live")["run"]["status"] == "crashed"


def test_a_run_that_finished_stays_finished(tmp_path):
    run = results.Run.create(tmp_path / "r", config={})
    run.finish({"loss": 1.0})
    run.fail("interrupted: SIGTERM", status="interrupted")  # a signal that arrives as the process ends
    assert results.load_run(tmp_path / "r")["run"]["status"] == "complete"
    assert locks.writer_alive(tmp_path / "r") is False, "a finished run gives its lock back"


def test_a_name_too_long_for_the_file_system_is_one_sentence(tmp_path):
    with pytest.raises(UserError, match=r"is 300 bytes long, over the 255 a file system allows"):
        results.check_new_run_dir(tmp_path / ("x" * 300))


def test_a_run_whose_settings_hold_a_token_shaped_value_can_be_resumed(tmp_path, monkeypatch):
    """run.json records such a value by its hash; the resume compares it hashed too, so it matches."""
    from my_utils.run.lifecycle import check_resumable

    data = str(tmp_path / ("hf_" + "a" * 24 + ".jsonl"))
    run = results.Run.create(tmp_path / "r", config={"data_file": data, "seed": 0})
    run.fail("crashed")
    text = (tmp_path / "r" / "run.json").read_text()
    assert "a" * 24 not in text and redaction.secret_hash("hf_" + "a" * 24) in text
    check_resumable(tmp_path / "r", {"data_file": data, "seed": 0})
    with pytest.raises(UserError, match="was started with --seed 0, not 1"):
        check_resumable(tmp_path / "r", {"data_file": data, "seed": 1})
