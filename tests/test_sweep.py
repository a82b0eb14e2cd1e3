"""The sweep: a declarative spec of grids, checked before anything runs; one fresh process per cell; finished cells
skipped, failed ones retried; tables and sentences computed from the measured rows."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Finished

from my_utils import JobFailed, UserError
from my_utils.lessons import rank_sweep
from my_utils.tools import sweep
from my_utils.core.adapters import AdapterSpec
from my_utils.core.devices import usable_cores
from my_utils.run.redaction import secret_hash
from my_utils.core.stats import Noise
from my_utils.run.results import Run

LADDER = {"rank": [2, 16], "alpha": [32], "learning_rate": [2e-3]}
# a small instruction data file: the tiny preset's first rows
TINY_ROWS = "".join((Path(__file__).resolve().parent.parent / "assets" / "tiny" / "data"
                     / "instructions_train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:64])


def make_cell(out, cell, status="complete", **summary):
    """A results folder like the workflow's for ``cell``: settings as the workflow records them (the adapter as its
    resolved peft config, ``as_record``), made-up figures."""
    lora = cell.get("method", "lora") == "lora"
    adapter = {k: tuple(v) if k == "targets" else v for k, v in cell.items() if k in sweep.ADAPTER_SETTINGS}
    config = {"seed": 0, "method": "lora", **{k: v for k, v in cell.items() if k not in sweep.ADAPTER_SETTINGS},
              "adapter": AdapterSpec(**adapter).resolved(("c_attn",)).record() if lora else None}
    run = Run.create(out / sweep.cell_name(cell), config=config)
    run.log_metrics({"step": 1, "loss": 2.0})
    if status != "complete":
        run.fail("boom", status=status)
        return
    rank = cell.get("rank", 8)
    run.finish({
        "method": cell.get("method", "lora"), "learning_rate": cell.get("learning_rate", 2e-3),
        "steps": 10, "runtime_s": 10.0 + rank, "samples_per_s": 50.0 - rank, "peak_memory_bytes": 1000 + rank,
        "trainable_params": 100 * rank if lora else 10_000, "adapter_bytes": 400 * rank if lora else None,
        "eval_loss": 2.0 - rank / 100, "train_loss_final": 1.0 / rank, "exact_match_after": None, **summary,
    })


def test_cells_are_the_grids_combinations_each_once():
    spec = sweep.SweepSpec(args={"max_steps": 5, "seed": 0}, grids=[
        LADDER,
        {"rank": [16], "alpha": [32.0], "learning_rate": [0.002, 4e-3]},  # shares rank 16 at 0.002 with LADDER
        {"method": ["full"], "learning_rate": [4e-4]},
        {"rank": [4], "rslora": [True, False], "targets": [["c_attn", "c_fc"]]},
    ])
    assert [sweep.cell_name(c) for c in spec.cells()] == [
        "rank2_alpha32_lr0.002", "rank16_alpha32_lr0.002", "rank16_alpha32_lr0.004", "full_lr0.0004",
        "rank4_c_attn+c_fc_rslora", "rank4_c_attn+c_fc"]
    assert spec.cells()[0] == {"rank": 2, "alpha": 32.0, "learning_rate": 0.002}, "values as the workflow reads them"
    cmd = sweep.cell_command(spec, spec.cells()[4], Path("out"))
    assert cmd[1:3] == ["-m", "my_utils.workflows.lora"]
    # every value passes through, 0 included (--seed 0 was dropped, and --max-steps 0 ran the default 250 steps)
    assert cmd[cmd.index("--seed") + 1] == "0" and cmd[cmd.index("--max-steps") + 1] == "5"
    assert "--rslora" in cmd and cmd[cmd.index("--targets") + 1:cmd.index("--targets") + 3] == ["c_attn", "c_fc"]
    assert "--rslora" not in sweep.cell_command(spec, spec.cells()[5], Path("out")), "False: the default"


def test_a_cell_that_runs_what_an_earlier_one_runs_is_that_cell():
    from my_utils.workflows.lora import Config

    default_seed = Config().seed
    spec = sweep.SweepSpec(args={"max_steps": 5}, grids=[
        {"rank": [16], "learning_rate": [0.002], "seed": [default_seed, default_seed + 1]},
        {"rank": [16, 32], "learning_rate": [0.002]},  # rank 16: the first grid's default-seed cell
    ])
    names = [sweep.cell_name(c) for c in spec.cells()]
    assert names == [f"seed{default_seed}_rank16_lr0.002", f"seed{default_seed + 1}_rank16_lr0.002", "rank32_lr0.002"]


def test_every_adapter_field_is_sweepable_with_no_edit_in_the_sweep():
    """The sweep's options are the workflow's generated command line: AdapterSpec's fields come with it."""
    from dataclasses import fields

    from my_utils.core.adapters import AdapterSpec

    flags = {f.name for f in fields(AdapterSpec) if f.metadata.get("flag") is not False}
    assert flags == {f.name for f in fields(AdapterSpec)} - {"peft"} and flags <= set(sweep.workflow_options())
    assert set(sweep.ADAPTER_SETTINGS) <= set(sweep.SETTINGS)
    spec = sweep.SweepSpec(args={"max_steps": 3}, grids=[{"rank": [4], "dora": [True, False], "dropout": [0, 0.1]}])
    assert [sweep.cell_name(c) for c in spec.cells()] == [
        "rank4_dropout0_dora", "rank4_dropout0.1_dora", "rank4_dropout0", "rank4_dropout0.1"]
    cmd = sweep.cell_command(spec, spec.cells()[1], Path("out"))
    assert "--dora" in cmd and cmd[cmd.index("--dropout") + 1] == "0.1"


def test_defaults_and_the_command_line_grid():
    assert sweep.SweepSpec(preset="tiny").grids == [{"rank": [1, 4, 16, 64], "alpha": [32.0]}]
    assert sweep.SweepSpec(preset="opt-350m").grids == [{"rank": [8, 128, 256], "alpha": [16.0]}]
    assert sweep.parse_grid(["rank=4,16", "targets=c_attn,c_attn+c_fc", "rslora=true", "learning-rate=1e-3"]) == {
        "rank": [4, 16], "targets": ["c_attn", ["c_attn", "c_fc"]], "rslora": [True], "learning_rate": [0.001]}
    spec, out, jobs = sweep.parse_args(["--ranks", "8", "128", "--grid", "rank=4", "alpha=32", "--jobs", "2",
                                        "--max-steps", "7", "--output-dir", "somewhere"])
    assert spec.grids == [{"rank": [4], "alpha": [32.0]}, {"rank": [8, 128]}] and spec.args["max_steps"] == 7
    assert (str(out), jobs) == ("somewhere", 2)


@pytest.mark.parametrize("spec, message", [
    ({"grids": [{"rank": [8, 8]}]}, "gives rank 8 twice"),
    ({"grids": [{"learning_rate": [1e-3, 0.001]}]}, "gives learning_rate 0.001 twice"),
    ({"grids": [{"rank": [4, 0]}]}, "rank must be a positive integer"),
    ({"args": {"max_steps": 0}}, "--max-steps must be a positive integer, got 0"),
    ({"args": {"max_steps": "many"}}, "invalid int value"),
    ({"grids": [{"alpha": [-1]}]}, "alpha must be a positive number"),
    ({"grids": [{"rank": []}]}, "non-empty list"),
    ({"grids": [{"rank": 4}]}, "non-empty list"),
    ({"grids": [{"ranks": [4]}]}, "no option --ranks"),
    ({"grids": [{"rslora": ["yes"]}]}, "--rslora is a switch"),
    ({"grids": [{"targets": [["c_atn"]]}]}, "'c_atn' matches nothing"),
    ({"grids": [{"lr_scheduler": ["sometimes"]}]}, "invalid choice"),
    ({"args": {"rank": 4}, "grids": [{"rank": [8]}]}, "both a grid option and a shared arg"),
    ({"args": {"output_dir": "x"}}, "sets --output-dir itself"),
    ({"preset": "tiniest"}, "Unknown preset"),
])
def test_bad_input_is_one_sentence(spec, message):
    with pytest.raises(UserError, match=message):
        sweep.SweepSpec(**spec)


@pytest.mark.slow
def test_bad_input_on_the_command_line_writes_nothing(tmp_path, subprocess_env):
    out = tmp_path / "sweep"
    # one small cell, should the check ever let it through (--max-steps 0 once ran the default 250 steps)
    result = subprocess.run([sys.executable, "-m", "my_utils", "sweep", "--ranks", "1", "--max-steps", "0",
                             "--eval-rows", "4", "--output-dir", str(out)], env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "my_utils sweep: error: --max-steps must be a positive integer, got 0."
    assert not out.exists(), "nothing written: no sweep.json, no cell folder"
    with pytest.raises(UserError, match="twice"):
        sweep.parse_args(["--ranks", "8", "8", "--output-dir", str(out)])
    with pytest.raises(UserError, match="OPTION=VALUE"):
        sweep.parse_grid(["rank"])


def test_complete_cells_are_skipped_and_failed_ones_rerun(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    spec = sweep.SweepSpec(grids=[{"rank": [2, 4, 16], "alpha": [32]}])
    first, second, third = spec.cells()
    make_cell(out, first)
    make_cell(out, second, status="failed")
    ran, fail, jobs, steady = [], set(), 2, True

    def fake_start(cmd, env, log):  # trains nothing: writes a folder like the workflow's
        name = Path(cmd[cmd.index("--output-dir") + 1]).name
        cell = next(c for c in [*spec.cells(), *more.cells()] if sweep.cell_name(c) == name)
        ran.append(name)
        assert (env.get("MALLOC_MMAP_THRESHOLD_") == sweep.STEADY_MEMORY_ENV["MALLOC_MMAP_THRESHOLD_"]) == steady
        threads = str(usable_cores() // 2) if jobs == 2 else os.environ.get("OMP_NUM_THREADS")
        assert env.get("OMP_NUM_THREADS") == threads, "cells side by side share the cores"
        make_cell(out, cell, status="failed" if name in fail else "complete")
        return Finished(1 if name in fail else 0)

    more = sweep.SweepSpec(grids=[{"rank": [2, 32, 64], "alpha": [32]}])
    monkeypatch.setattr(sweep.running, "_start", fake_start)
    rows = sweep.run_sweep(spec, out, jobs=2)
    assert ran == ["rank4_alpha32", "rank16_alpha32"]
    assert [r["rank"] for r in rows] == [2, 4, 16]
    assert (out / "rank4_alpha32.failed").is_dir(), "the failed attempt is kept aside"
    assert (out / "rank4_alpha32" / "output.log").is_file(), "each cell's output is kept in its folder"
    assert json.loads((out / "sweep.json").read_text())["cells"] == spec.cells()
    ran.clear()
    capsys.readouterr()
    assert [r["pid"] for r in sweep.run_sweep(spec, out)] == [r["pid"] for r in rows] and ran == []
    said = [line for line in capsys.readouterr().out.splitlines() if "skipped" in line]
    assert said == ["3 of 3 cells already complete in sweep, skipped; 0 to run"], "one line for the cells skipped"
    jobs, steady = 1, False
    with pytest.raises(UserError, match="--jobs must be a positive integer"):
        sweep.run_sweep(spec, out, jobs=0)

    fail.add("rank32_alpha32")
    with pytest.raises(JobFailed, match=r"1 of 2 cell\(s\) failed \(rank32_alpha32\); each one's output is in"):
        sweep.run_sweep(more, out, jobs=1, steady_memory=False)
    assert ran == ["rank32_alpha32", "rank64_alpha32"], "a failed cell does not stop the others"
    assert [sweep.cell_name(c) for c in json.loads((out / "sweep.json").read_text())["cells"]] == [
        "rank2_alpha32", "rank4_alpha32", "rank16_alpha32", "rank32_alpha32", "rank64_alpha32"]
    with pytest.raises(UserError, match="was run with another args"):
        sweep.run_sweep(sweep.SweepSpec(grids=[LADDER], args={"max_steps": 99}), out)


def test_the_analyses_come_from_the_rows(tmp_path):
    out = tmp_path / "sweep"
    rates = {"rank": [2], "alpha": [32], "learning_rate": [1e-3, 2e-3, 4e-3, 8e-3]}
    spec = sweep.SweepSpec(grids=[LADDER, rates, {"rank": [2], "alpha": [4], "learning_rate": [2e-3]},
                                  {"method": ["full"], "learning_rate": [1e-4, 2e-4, 4e-4]},
                                  {"rank": [4], "alpha": [32], "targets": [["c_attn", "c_fc"]],
                                   "learning_rate": [2e-3]}])
    # held-out losses: rank x rate symmetric around 4e-3 on a log scale; full fine-tuning lowest at 2e-4
    losses = {"rank2_alpha32_lr0.001": 2.3, "rank2_alpha32_lr0.002": 1.9, "rank2_alpha32_lr0.004": 1.5,
              "rank2_alpha32_lr0.008": 1.9, "rank16_alpha32_lr0.002": 1.6, "rank2_alpha4_lr0.002": 2.9,
              "full_lr0.0001": 0.7, "full_lr0.0002": 0.5, "full_lr0.0004": 0.9,
              "rank4_alpha32_c_attn+c_fc_lr0.002": 1.0}
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"cells": spec.cells()}))
    for cell in spec.cells():
        make_cell(out, cell, eval_loss=losses[sweep.cell_name(cell)],
                  **({"trainable_params": 1600} if "targets" in cell else {}))
    rows = sweep.load_sweep(out)

    ladder = sweep.select(rows, learning_rate=2e-3, alpha=32, targets=["c_attn"])
    assert [r["rank"] for r in ladder] == [2, 16] and rank_sweep.rank_ladder(rows) == ladder
    sentences = rank_sweep.tradeoffs(ladder)
    assert sentences[0] == ("rank 16 trains 8.0x more parameters than rank 2 (1,600 vs 200) for a held-out loss of "
                            "1.600 against 1.900.")
    assert sentences[-1] == "Lowest held-out loss: rank 16 (1.600)."  # no seeds: no rank called as good as another
    # seeds measured beside the cells: a small spread separates the ranks; a wide one leaves them undecided, never
    # "no difference"; rank 2 is as good as the best only within a stated margin that its whole interval fits
    assert rank_sweep.tradeoffs(ladder, Noise(sd=0.05, df=4))[-1].endswith("every smaller rank ends measurably higher.")
    wide = rank_sweep.tradeoffs(ladder, Noise(0.2, 4))[-1]
    assert "rank 2 ends 0.300 [-0.485, 1.085] higher: these seeds neither separate" in wide and "no margin" in wide
    assert rank_sweep.tradeoffs(ladder, Noise(0.2, 4), margin=0.5)[-1].endswith("nor bound the difference within 0.5.")
    level = rank_sweep.tradeoffs(ladder, Noise(0.2, 4), margin=1.2)[-1]
    assert "rank 2 ends within 1.2 of it (0.300 [-0.485, 1.085], inside +-1.2) with 0.12x" in level

    # at rank 16 the three rules give one scale, 2: one run on every line
    lines = rank_sweep.scaling_lines(sweep.select(rows, learning_rate=2e-3, targets=["c_attn"]), rank_sweep.scaling_rules(32, 8))
    assert {label: [r["name"] for r in line] for label, line in lines.items()} == {
        "alpha 32 (scale 32/r)": ["rank2_alpha32_lr0.002", "rank16_alpha32_lr0.002"],
        "rsLoRA, alpha 8 (scale 8/sqrt(r))": ["rank16_alpha32_lr0.002"],
        "alpha = 2r (scale 2)": ["rank2_alpha4_lr0.002", "rank16_alpha32_lr0.002"]}
    findings = rank_sweep.scaling_findings(lines)
    assert findings[1].startswith("alpha = 2r (scale 2): rank 2 ends at held-out loss 2.900 and rank 16 at 1.600 "
                                  "(1.300 lower at the larger rank)")
    assert "4.3x larger with alpha = 2r (scale 2) than with alpha 32 (scale 32/r)" in findings[-1]

    lora_and_full = sweep.select(rows, alpha=32, targets=["c_attn"]) + sweep.select(rows, method="full")
    curves = rank_sweep.learning_rate_curves(lora_and_full)
    assert list(curves) == ["rank 2", "full fine-tuning"]
    rate, best, inside = rank_sweep.best_rate(curves["rank 2"])
    assert rate == pytest.approx(4e-3) and inside, "a symmetric minimum: the parabola's vertex is the best rate"
    rate, best, inside = rank_sweep.best_rate(curves["full fine-tuning"])
    assert 1e-4 < rate < 2e-4 and best["learning_rate"] == 2e-4, "pulled towards the lower neighbour"
    assert rank_sweep.best_rate(curves["rank 2"][:3])[2] is False, "the lowest loss at an end of the rates is no optimum"
    text = rank_sweep.learning_rate_findings(curves)
    assert text[-1].startswith("LoRA's best rate is 22.4x to 22.4x full fine-tuning's") and text[-1].endswith(
        "this one is larger.")

    assert rank_sweep.targets_findings(rows)[0] == (
        "At 1,600 trainable parameters and lr 0.002: c_attn+c_fc at rank 4 reaches held-out loss 1.000; c_attn at "
        "rank 16 reaches held-out loss 1.600.")
    report = rank_sweep.report(out)
    assert (out / "rank_costs.png").is_file() and (out / "learning_rates.png").is_file()
    assert "rank 16 trains" in report and (out / "report.md").read_text().strip() == report


@pytest.mark.slow
def test_each_cell_trains_in_its_own_process(tmp_path, subprocess_env, monkeypatch):
    for key in ("PYTHONPATH", "OMP_NUM_THREADS", "HF_HOME"):
        monkeypatch.setenv(key, subprocess_env[key])
    spec = sweep.SweepSpec(grids=[{"rank": [1, 8], "alpha": [16]}],
                           args={"max_steps": 2, "eval_rows": 4, "logging_steps": 1, "skip_generation_eval": True,
                                 "mixed_precision": "no"})
    rows = sweep.run_sweep(spec, tmp_path / "sweep", jobs=2, steady_memory=False)
    assert [r["rank"] for r in rows] == [1, 8] and all(r["alpha"] == 16 for r in rows)
    pids = [r["pid"] for r in rows]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert all(r["ppid"] == os.getpid() for r in rows), "started by this process"
    assert rows[1]["trainable_params"] == 8 * rows[0]["trainable_params"]
    assert rows[1]["adapter_bytes"] > rows[0]["adapter_bytes"]
    assert all([step for step, _ in r["loss_curve"]] == [1, 2] for r in rows), "the loss curve comes from metrics.jsonl"
    assert all(r["eval_loss"] is not None for r in rows)
    again = sweep.run_sweep(spec, tmp_path / "sweep")
    assert [r["pid"] for r in again] == pids, "a second run re-trains nothing"


def test_a_cell_that_refuses_its_settings_stops_the_sweep_with_its_sentence(tmp_path, monkeypatch):
    out, ran = tmp_path / "sweep", []

    def refusing_start(cmd, env, log):  # as the workflow ends on bad input: one sentence, exit code 2
        ran.append(cmd)
        log.write("lora: error: The data file is empty; pass one with rows.\n")
        return Finished(2)

    monkeypatch.setattr(sweep.running, "_start", refusing_start)
    with pytest.raises(UserError, match="rank2_alpha32 refused its settings, and the sweep stopped: The data file"):
        sweep.run_sweep(sweep.SweepSpec(grids=[{"rank": [2, 4], "alpha": [32]}]), out)
    assert len(ran) == 1, "the other cells would refuse it too"


def test_a_model_neither_cached_nor_downloadable_stops_the_sweep_before_any_cell(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))  # even where it is cached
    monkeypatch.setattr(sweep.running, "_start", lambda *a: pytest.fail("no cell may start"))
    spec = sweep.SweepSpec(preset="opt-350m", grids=[{"rank": [8], "alpha": [16]}])
    with pytest.raises(UserError, match="facebook/opt-350m is not in the Hugging Face cache"):  # offline in tests
        sweep.run_sweep(spec, tmp_path / "sweep")
    assert not (tmp_path / "sweep").exists()


def test_seeds_of_a_cell_merge_into_its_mean_and_measure_the_noise(tmp_path):
    out = tmp_path / "sweep"
    spec = sweep.SweepSpec(grids=[{"rank": [2, 16], "alpha": [32], "seed": [0, 1, 2]}, {"rank": [4], "alpha": [32]}])
    losses = {2: [1.9, 2.0, 2.1], 16: [1.5, 1.6, 1.7], 4: [1.8]}
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"cells": spec.cells()}))
    for cell in spec.cells():
        make_cell(out, cell, eval_loss=losses[cell["rank"]][cell.get("seed", 0)], seed=cell.get("seed", 0))
    rows = sweep.seed_means(sweep.load_sweep(out))
    assert [(r["rank"], r["seeds"], round(r["eval_loss"], 6)) for r in rows] == [(2, [0, 1, 2], 2.0),
                                                                                    (16, [0, 1, 2], 1.6), (4, [0], 1.8)]
    noise = sweep.seed_noise(sweep.load_sweep(out))
    assert noise.df == 4 and noise.sd == pytest.approx(0.1)  # two settings of three seeds, each 0.1 apart
    assert sweep.seed_noise([r for r in sweep.load_sweep(out) if r["rank"] == 4]) is None


def test_a_data_file_value_names_a_safe_folder_and_its_file_is_never_touched(tmp_path, monkeypatch):
    data = tmp_path / "my data" / "a.jsonl"
    data.parent.mkdir()
    data.write_text(TINY_ROWS)
    relative = "b.jsonl"
    (tmp_path / relative).write_text(TINY_ROWS)
    monkeypatch.chdir(tmp_path)  # a relative value means what it means where the sweep starts
    spec = sweep.SweepSpec(grids=[{"data_file": [str(data), relative], "rank": [2]}])
    names = [sweep.cell_name(c) for c in spec.cells()]
    assert names[0].startswith("rank2_a-") and names[1] == "rank2_b.jsonl"  # a path: a stem and a hash; a name: itself
    assert len(set(names)) == 2 and names == [sweep.cell_name(c) for c in spec.cells()], "stable, one per value"
    out = tmp_path / "sweep"
    out.mkdir()
    (out / names[0]).write_text("a stray file with a cell's name")  # unreadable as a run: set aside, inside out

    def fake_start(cmd, env, log):
        cell = next(c for c in spec.cells() if sweep.cell_name(c) == Path(cmd[cmd.index("--output-dir") + 1]).name)
        make_cell(out, cell)
        return Finished(0)

    monkeypatch.setattr(sweep.running, "_start", fake_start)
    sweep.run_sweep(spec, "sweep")  # relative: resolved where the command runs
    assert data.read_text() == TINY_ROWS and (tmp_path / relative).read_text() == TINY_ROWS
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, f"{names[0]}.unreadable", "sweep.json"])
    assert len(sweep.cell_name({"data_file": "x" * 300})) <= sweep.LONGEST_NAME


@pytest.mark.slow
def test_one_sweep_per_folder_and_secrets_stay_out_of_its_record(tmp_path, monkeypatch, held_elsewhere):

    secret = "hf_" + "s3cr3t" * 4
    monkeypatch.setenv("HF_TOKEN", secret)
    data = tmp_path / f"data_{secret}.jsonl"  # a token in a path: recorded as its hash
    data.write_text(TINY_ROWS)
    spec = sweep.SweepSpec(grids=[{"rank": [2]}], args={"data_file": str(data)})
    out = tmp_path / "sweep"
    out.mkdir()
    with held_elsewhere(out):
        monkeypatch.setattr(sweep.running, "_start", lambda *a: pytest.fail("no cell may start"))
        with pytest.raises(UserError, match="sweep folder .* is being written by another process right now"):
            sweep.run_sweep(spec, out)
    monkeypatch.setattr(sweep.running, "_start", lambda cmd, env, log: (make_cell(out, spec.cells()[0]), Finished(0))[1])
    sweep.run_sweep(spec, out)  # the other sweep is gone: its lock went with it
    recorded = (out / "sweep.json").read_text()
    assert secret not in recorded and secret_hash(secret) in recorded


@pytest.mark.slow
def test_sigterm_stops_the_running_cells_and_says_how_to_go_on(tmp_path, monkeypatch):
    import signal
    import subprocess
    import threading

    started = []

    def slow_start(cmd, env, log):
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return started[-1]

    monkeypatch.setattr(sweep.running, "_start", slow_start)
    before = signal.getsignal(signal.SIGTERM)
    threading.Timer(1.0, lambda: signal.raise_signal(signal.SIGTERM)).start()
    with pytest.raises(KeyboardInterrupt, match=r"SIGTERM; 1 cell\(s\) stopped \(rank2_alpha32\): run the same "
                                                r"command to go on where it stopped"):
        sweep.run_sweep(sweep.SweepSpec(grids=[{"rank": [2, 4], "alpha": [32]}]), tmp_path / "sweep")
    assert len(started) == 1 and started[0].poll() is not None, "the running cell was stopped, not orphaned"
    assert signal.getsignal(signal.SIGTERM) == before, "the sweep's handler is gone with it"


@pytest.mark.parametrize("content, message", [
    ('{"args": ["--rank", "4"]}', 'gives args as list \\["--rank", "4"\\]; it takes a dict'),
    ('{"preset": 7}', "gives preset as int 7; it takes a str"),
    ('{"grids": {"rank": [4]}}', "gives grids as dict"),
    ('{"num_processes": true}', "gives num_processes as bool"),
])
def test_a_spec_file_of_the_wrong_shape_is_one_sentence(tmp_path, content, message):
    (tmp_path / "spec.json").write_text(content)
    with pytest.raises(UserError, match=message):
        sweep.read_spec(tmp_path / "spec.json")
