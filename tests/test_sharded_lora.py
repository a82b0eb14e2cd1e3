"""LoRA on a base sharded with FSDP2 (ZeRO-3) over 2 gloo processes: the saved adapter is whole (the shapes and size
of a 1-process adapter, the same outputs once reloaded into an unsharded model), and a run resumed from a checkpoint
restores the adapter and the optimizer on every rank (the same losses and the same final adapter)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from my_utils.core.paths import REPO_ROOT

# adapter dropout on: a resume is exact only if every rank's random-number state comes back with the checkpoint
ARGS = ["--preset", "tiny", "--max-steps", "6", "--save-steps", "2", "--dropout", "0.1"]


def sharded_lora(out, *extra, processes=2, **env):
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1",
                   **{k: str(v) for k, v in env.items()}}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
           "-m", "my_utils.workflows.sharded_lora", *ARGS, *extra, "--output-dir", str(out)]
    return subprocess.run(cmd, env=environment, capture_output=True, text=True, timeout=600)


def losses(out):
    return [(m["step"], m["loss"]) for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded_lora") / "whole"
    proc = sharded_lora(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_saved_adapter_is_whole_and_gives_the_sharded_models_outputs(uninterrupted):
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from my_utils.core.adapters import AdapterSpec
    from my_utils.core.models import add_adapter
    from my_utils.core.blocks import block_dataset
    from my_utils.core.presets import get_preset
    from my_utils.core.records import adapter_of
    from my_utils.workflows.ddp_common import build_model

    workers = [json.loads(p.read_text()) for p in sorted((uninterrupted / "workers").glob("rank_*.json"))]
    assert [w["world_size"] for w in workers] == [2, 2]
    preset = get_preset("tiny")
    one_process = get_peft_model_state_dict(add_adapter(build_model(preset), AdapterSpec().resolved(preset.lora_targets)))
    saved = load_file(uninterrupted / "adapter" / "adapter_model.safetensors")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in one_process.items()}  # not a shard
    assert all(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # trained, not the zero init
    reloaded = PeftModel.from_pretrained(build_model(preset), uninterrupted / "adapter")
    probe = torch.as_tensor(block_dataset(preset, 64)[0]["input_ids"])[None]
    with torch.no_grad():
        logits = reloaded(input_ids=probe).logits[0, :4, :4].flatten().tolist()
    summary = json.loads((uninterrupted / "summary.json").read_text())
    assert logits == pytest.approx(summary["probe_logits"], abs=1e-5)
    assert summary["trainable_params"] == sum(v.numel() for v in saved.values())
    # beside it, what loading it needs and what trained it
    assert AutoTokenizer.from_pretrained(uninterrupted / "adapter").eos_token is not None
    rank = adapter_of(json.loads((uninterrupted / "run.json").read_text()))["r"]
    assert f"| rank, alpha | {rank}, " in (uninterrupted / "adapter" / "README.md").read_text()


@pytest.mark.slow
def test_a_resumed_run_restores_the_adapter_on_every_rank(uninterrupted, tmp_path):
    out = tmp_path / "crashed"
    crashed = sharded_lora(out, COURSE_CRASH_AT_STEP=3)  # after step 3; the newest checkpoint is step 2's
    assert crashed.returncode != 0
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    resumed = sharded_lora(out, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    # steps 3-6 again from checkpoint-2: the same losses only if both ranks' adapter and optimizer shards, and their
    # random-number states (the dropout masks), came back
    assert losses(out) == losses(uninterrupted)
    from safetensors.torch import load_file

    a, b = (load_file(o / "adapter" / "adapter_model.safetensors") for o in (uninterrupted, out))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_run_of_2_processes_resumes_on_4_with_the_same_global_batch(tmp_path):
    """The checkpoint is whole, so 4 processes continue what 2 started: with the global batch kept (2 x 4 = 4 x 2),
    the same examples each step and the uninterrupted run's losses (dropout off: the ranks' masks cannot carry
    over). With the batch per process kept instead, the resume is refused in one sentence and changes nothing."""
    no_dropout = ["--dropout", "0", "--local-batch-size", "4"]
    whole = sharded_lora(tmp_path / "whole", *no_dropout)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    out = tmp_path / "crashed"
    assert sharded_lora(out, *no_dropout, COURSE_CRASH_AT_STEP=3).returncode != 0  # checkpoint-2 is the newest
    before = (out / "run.json").read_text()
    more = {"processes": 4, "COURSE_OVERSUBSCRIBE": 1}  # 4 processes on the 2 cores the tests may have
    kept_local = sharded_lora(out, "--resume", "--dropout", "0", "--local-batch-size", "4", **more)
    said = "trained global batches of 8 (4 per process on 2); on 4 process(es) resume with --local-batch-size 2."
    assert kept_local.returncode != 0 and said in kept_local.stderr, kept_local.stderr[-3000:]
    assert (out / "run.json").read_text() == before
    resumed = sharded_lora(out, "--resume", "--dropout", "0", "--local-batch-size", "2", **more)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed on 4 process(es) from a run on 2" in resumed.stdout
    run = json.loads((out / "run.json").read_text())
    assert run["world_size"] == 4 and run["status"] == "complete"  # as the resumed workers saw it
    assert (run["config"]["num_processes"], run["config"]["local_batch_size"]) == (4, 2)
    assert run["resumes"][-1]["layout_before"] == {"world_size": 2, "num_processes": 2, "local_batch_size": 4}
    steps, expected = zip(*losses(tmp_path / "whole"))
    got = dict(losses(out))
    assert sorted(got) == list(steps)
    assert [got[step] for step in steps] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("extra, message", [
    (["--resume"], "is already complete; there is nothing to resume"),
    (["--resume", "--stage", "zero2"], "is already complete"),  # the status is checked before the settings
])
def test_resuming_a_finished_run_is_one_sentence_exit_0_and_changes_nothing(uninterrupted, capsys, extra, message):
    from my_utils.workflows import sharded_lora as workflow

    before = (uninterrupted / "run.json").read_text()
    with pytest.raises(SystemExit) as e:
        workflow.main([*ARGS, *extra, "--output-dir", str(uninterrupted)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 0 and len(lines) == 1 and message in lines[0], lines  # a retry loop ends
    assert (uninterrupted / "run.json").read_text() == before


def test_resume_needs_the_folder_it_continues(capsys):
    from my_utils.workflows import sharded_lora as workflow

    with pytest.raises(SystemExit) as e:
        workflow.main(["--resume"])
    assert e.value.code == 2 and "--resume continues an existing results folder" in capsys.readouterr().err
