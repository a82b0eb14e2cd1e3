"""The rank sweep: declarative spec, one fresh process per rank, finished ranks skipped, failed ones retried,
trade-off sentences computed from the measured rows."""

import json
import os

import pytest

from my_utils import UserError, sweep
from my_utils.runs import Run


def fake_summary(rank, **over):
    return {"rank": rank, "runtime_s": 10.0 + rank, "samples_per_s": 50.0 - rank, "peak_memory_bytes": 1000 + rank,
            "trainable_params": 100 * rank, "adapter_bytes": 400 * rank, "exact_match_before": 0.0,
            "exact_match_after": 0.1 * rank, "train_loss_final": 1.0 / rank, **over}


def make_rank(out, rank, status="complete"):
    run = Run.create(sweep.rank_dir(out, rank), config={"rank": rank})
    run.log_metrics({"step": 1, "loss": 2.0})
    if status == "complete":
        run.finish(fake_summary(rank))
    else:
        run.fail("boom", status=status)


def test_spec_defaults_and_bad_ranks():
    assert sweep.SweepSpec(preset="tiny").ranks == sweep.DEFAULT_RANKS["tiny"]
    assert sweep.SweepSpec(preset="opt-350m").ranks == sweep.REAL_MODEL_RANKS
    assert sweep.SweepSpec(ranks=(8, 1, 8)).ranks == (1, 8)
    with pytest.raises(UserError, match="positive integer"):
        sweep.SweepSpec(ranks=(4, 0))
    with pytest.raises(UserError, match="sets --rank itself"):
        sweep.SweepSpec(args={"rank": 4})
    with pytest.raises(UserError, match="Unknown preset"):
        sweep.SweepSpec(preset="tiniest")


def test_rank_command_is_a_fresh_python_process(tmp_path):
    spec = sweep.SweepSpec(ranks=(4,), args={"max_steps": 3, "random_init": True, "skip_generation_eval": False})
    cmd = sweep.rank_command(spec, 4, tmp_path / "rank_4")
    assert cmd[1:3] == ["-m", "my_utils.workflows.lora"]
    assert cmd[cmd.index("--rank") + 1] == "4" and cmd[cmd.index("--max-steps") + 1] == "3"
    assert "--random-init" in cmd and "--skip-generation-eval" not in cmd


def test_complete_ranks_are_skipped_and_failed_ones_rerun(tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    make_rank(out, 1)
    make_rank(out, 2, status="failed")
    ran = []

    def fake_run_command(cmd, env=None, echo=True):  # trains nothing: writes a complete folder like the workflow
        rank = int(cmd[cmd.index("--rank") + 1])
        ran.append(rank)
        make_rank(out, rank)

    import my_utils.launch

    monkeypatch.setattr(my_utils.launch, "run_command", fake_run_command)
    rows = sweep.run_sweep(sweep.SweepSpec(ranks=(1, 2, 4)), out)
    assert ran == [2, 4]
    assert [r["rank"] for r in rows] == [1, 2, 4]
    assert (out / "rank_2.failed").is_dir(), "the failed attempt is kept aside"
    assert json.loads((out / "sweep.json").read_text())["ranks"] == [1, 2, 4]
    ran.clear()
    sweep.run_sweep(sweep.SweepSpec(ranks=(1, 2, 4)), out)
    assert ran == []
    with pytest.raises(UserError, match="was run with another args"):
        sweep.run_sweep(sweep.SweepSpec(ranks=(1,), args={"max_steps": 99}), out)


def test_tradeoff_sentences_come_from_the_rows(tmp_path):
    for rank in (1, 4):
        make_rank(tmp_path, rank)
    rows = sweep.load_sweep(tmp_path)
    sentences = sweep.tradeoffs(rows)
    assert sentences[0].startswith("rank 4 trains 4.0x more parameters than rank 1 (400 vs 100) for +0.30 exact match")
    assert sentences[-1] == "Best exact match: rank 4 (0.40); no smaller rank comes within 0.02 of it."
    text = sweep.report(tmp_path)
    assert (tmp_path / "loss_curves.png").is_file() and (tmp_path / "rank_tradeoffs.png").is_file()
    assert "rank 4 trains" in text and (tmp_path / "report.md").read_text().strip() == text


@pytest.mark.slow
def test_each_rank_trains_in_its_own_process(tmp_path, subprocess_env, monkeypatch):
    for key in ("PYTHONPATH", "OMP_NUM_THREADS", "HF_HOME"):
        monkeypatch.setenv(key, subprocess_env[key])
    spec = sweep.SweepSpec(ranks=(1, 8), args={"max_steps": 2, "eval_rows": 4, "logging_steps": 1})
    rows = sweep.run_sweep(spec, tmp_path / "sweep")
    assert [r["rank"] for r in rows] == [1, 8]
    pids = [r["pid"] for r in rows]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert all(r["ppid"] == os.getpid() for r in rows), "started by this process, one at a time"
    assert rows[1]["trainable_params"] == 8 * rows[0]["trainable_params"]
    assert rows[1]["adapter_bytes"] > rows[0]["adapter_bytes"]
    assert all([step for step, _ in r["loss_curve"]] == [1, 2] for r in rows), "the loss curve comes from metrics.jsonl"
    again = sweep.run_sweep(spec, tmp_path / "sweep")
    assert [r["pid"] for r in again] == pids, "a second run re-trains nothing"
