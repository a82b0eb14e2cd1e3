"""What a run records decides what it compares and names: secrets by their hash (never redacted text, never their
characters), the data file by its fingerprint, completion by its summary whatever signal arrives meanwhile, and a
checkpoint's step by its sealed manifest."""

import json
import os
import signal
from dataclasses import dataclass

import pytest

from my_utils import NothingToDo, UserError
from my_utils.run import results
from my_utils.run.checkpoints import (CHECKPOINT_MANIFEST, find_resume_checkpoint, saved_step,
                                      write_checkpoint_manifest)
from my_utils.run.lifecycle import check_resumable, recorded, run_lifecycle
from my_utils.run.locks import current_status
from my_utils.run.redaction import REDACTED, hash_secrets, secret_hash
from my_utils.tools.sweep.spec import cell_name

TOKEN_A = "hf_" + "Qw3" * 8
TOKEN_B = "hf_" + "Zx9" * 8


def test_two_token_named_data_files_are_two_settings_on_resume(tmp_path):
    first, second = str(tmp_path / f"{TOKEN_A}.jsonl"), str(tmp_path / f"{TOKEN_B}.jsonl")
    results.Run.create(tmp_path / "r", config={"data_file": first}).fail("boom")
    check_resumable(tmp_path / "r", {"data_file": first})
    with pytest.raises(UserError, match="was started with --data-file") as e:
        check_resumable(tmp_path / "r", {"data_file": second})
    assert TOKEN_A not in str(e.value) and TOKEN_B not in str(e.value)


def test_a_sweep_cell_over_a_token_named_file_is_named_by_its_hash_from_the_real_and_the_recorded_cell():
    cell = {"data_file": f"/data/{TOKEN_A}.jsonl", "rank": 4}
    name = cell_name(cell)
    assert not any(TOKEN_A[i:i + 6] in name for i in range(len(TOKEN_A) - 5)), name
    assert REDACTED not in name
    recorded_cell = json.loads(json.dumps(hash_secrets(cell)))  # as sweep.json holds it
    assert cell_name(recorded_cell) == name  # the report and a rerun find the folder the cell ran in
    assert cell_name({**cell, "data_file": f"/data/{TOKEN_B}.jsonl"}) != name
    assert secret_hash(secret_hash(TOKEN_A)) == secret_hash(TOKEN_A)


def test_an_adapter_file_edited_since_the_run_started_is_refused_by_its_fields_on_resume(tmp_path):
    adapter = {"adapter_config": "configs/peft/prompt_tuning.json", "rank": 8,
               "peft": {"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 8, "task_type": "CAUSAL_LM"}}
    results.Run.create(tmp_path / "r", config={"adapter": adapter}).fail("boom")
    check_resumable(tmp_path / "r", {"adapter": adapter})
    edited = {**adapter, "peft": {**adapter["peft"], "num_virtual_tokens": 16}}
    with pytest.raises(UserError, match=r"was started with another adapter \(num_virtual_tokens 8, not 16\); resume "
                                        "with the adapter file as it was") as e:
        check_resumable(tmp_path / "r", {"adapter": edited})
    assert "--peft" not in str(e.value)  # not a flag anyone could type


def test_a_folder_whose_run_stopped_before_its_first_step_is_reused_and_never_resumed(tmp_path, capsys):
    from my_utils.run.results import check_new_run_dir, stopped_before_a_step

    folder = tmp_path / "r"
    results.Run.create(folder, config={}).fail("interrupted: Ctrl-C", status="interrupted")
    (folder / "workers").mkdir()
    assert stopped_before_a_step(folder) and check_new_run_dir(folder) == folder
    with pytest.raises(UserError, match=r"stopped before its first step, so there is nothing to resume; the same "
                                        "command without --resume starts it again in that folder"):
        check_resumable(folder, {}, checkpoints="checkpoints")
    results.Run.create(folder, config={"new": True})
    assert "reusing" in capsys.readouterr().err and json.loads((folder / "run.json").read_text())["config"] == {
        "new": True}
    assert not stopped_before_a_step(folder)  # running, alive: never taken
    with pytest.raises(UserError, match="already exists and is never overwritten"):
        check_new_run_dir(folder)
    # a run that logged a step, or wrote anything else, keeps its folder
    for extra in ("metrics.jsonl", "notes.txt"):
        other = tmp_path / extra
        results.Run.create(other, config={}).fail("boom")
        (other / extra).write_text('{"step": 1, "loss": 2.0}\n')
        assert not stopped_before_a_step(other)
        with pytest.raises(UserError, match="already exists"):
            check_new_run_dir(other)


@dataclass
class DataConfig:
    output_dir: str
    data_file: str
    resume: bool = False


def test_a_data_file_changed_since_the_run_started_is_refused_on_resume(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"instruction": "a", "input": "", "output": "b"}\n', encoding="utf-8")
    cfg = DataConfig(output_dir=str(tmp_path / "r"), data_file=str(data))
    with pytest.raises(RuntimeError, match="crash"), run_lifecycle(cfg, 1, default_dir=tmp_path / "x", report_to=()):
        raise RuntimeError("crash")
    recorded_data = json.loads((tmp_path / "r" / "run.json").read_text())["data_file_fingerprint"]
    assert recorded_data["size"] == data.stat().st_size and len(recorded_data["sha256"]) == 64
    check_resumable(tmp_path / "r", {"data_file": str(data)})
    data.write_text('{"instruction": "a", "input": "", "output": "c"}\n', encoding="utf-8")  # same size
    with pytest.raises(UserError, match=r"^The data file .*rows.jsonl changed since the run started \(size/hash\); "
                                        "restore it or start a new run"):
        check_resumable(tmp_path / "r", {"data_file": str(data)})


def test_sigterm_between_the_summary_and_the_complete_mark_leaves_the_run_complete(tmp_path, monkeypatch):
    run = results.Run.create(tmp_path / "r", config={})
    write = results.atomic_write_json

    def write_then_sigterm(path, obj):
        write(path, obj)
        if path.name == "summary.json":
            os.kill(os.getpid(), signal.SIGTERM)  # delivered before the next Python line runs

    monkeypatch.setattr(results, "atomic_write_json", write_then_sigterm)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"), recorded(run):
        run.finish({"loss": 1.0})
    assert json.loads((tmp_path / "r" / "run.json").read_text())["status"] == "complete"
    loaded = results.load_run(tmp_path / "r")
    assert loaded["run"]["status"] == "complete" and loaded["summary"] == {"loss": 1.0}


def test_a_run_with_its_summary_reads_complete_whatever_run_json_says(tmp_path):
    run = results.Run.create(tmp_path / "r", config={})
    results.atomic_write_json(tmp_path / "r" / "summary.json", {"loss": 1.0})
    run.fail("interrupted: SIGTERM", status="interrupted")  # a stop that came after the summary changes nothing
    assert results.load_run(tmp_path / "r")["run"]["status"] == "complete"
    with pytest.raises(NothingToDo, match="already complete"):
        check_resumable(tmp_path / "r", {})
    (tmp_path / "r" / "summary.json").write_text("{cut", encoding="utf-8")  # a summary cut short is no summary
    assert current_status(results.read_json(tmp_path / "r" / "run.json"), tmp_path / "r") != "complete"


def test_a_checkpoint_renamed_with_its_manifest_edited_to_match_is_refused(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoint = checkpoints / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    write_checkpoint_manifest(checkpoint)
    assert find_resume_checkpoint(checkpoints)[0] == checkpoint and saved_step(checkpoint) == 2
    renamed = checkpoint.rename(checkpoints / "checkpoint-4")
    manifest = json.loads((renamed / CHECKPOINT_MANIFEST).read_text())
    (renamed / CHECKPOINT_MANIFEST).write_text(json.dumps({**manifest, "step": 4}))  # the step the name now says
    with pytest.raises(UserError, match=r"checkpoint-4: its manifest was changed after the save \(its seal differs\)"):
        find_resume_checkpoint(checkpoints)
