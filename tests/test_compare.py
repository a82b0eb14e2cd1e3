"""``python -m my_utils compare``: tables and plots from complete results folders only."""

import itertools
import json
import subprocess
import sys

import pytest

from my_utils import UserError
from my_utils.tools import compare
from my_utils.run.results import Run

CPU = [{"kind": "cpu", "index": None, "name": "Test CPU", "cores": 2, "total_memory": 8 << 30}]


FAKE_PIDS = itertools.count(10_000)


def fake_run(path, *, processes=1, samples_per_s=10.0, method="lora", rank=8, versions=None, commit=None,
             losses=(2.0, 1.5, 1.2), finish=True, global_batch=8):
    """A results folder shaped like the LoRA workflow's, with the memory figures of ``processes`` processes, each
    taking its share of ``global_batch``."""
    adapter = {"adapter_config": None, "peft": {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                "target_modules": ["c_attn"]}} if rank else None
    config = {"preset": "tiny", "method": method, "adapter": adapter, "local_batch_size": global_batch // processes,
              "num_processes": processes, "output_dir": str(path)}
    # each run's own process, as a workflow's (runs that share one are marked: a test of its own)
    fields = {"world_size": processes, "backend": "gloo" if processes > 1 else None, "devices": CPU,
              "pid": next(FAKE_PIDS)}
    run = Run.create(path, config=config, command=["test"], **fields)
    if versions or commit:
        run.update(**({"versions": {**run.info["versions"], **versions}} if versions else {}),
                   **({"commit": commit} if commit else {}))
    for step, loss in enumerate(losses, start=1):
        run.log_metrics({"step": step, "loss": loss, "learning_rate": 1e-3})
    if not finish:
        return run
    memory = [{"process": r, "first_step": {"device": "cpu", "peak_allocated": None, "peak_rss": 300 << 20},
               "end": {"device": "cpu", "peak_allocated": None, "peak_rss": (400 + r) << 20}} for r in range(processes)]
    run.finish({
        "workflow": "lora", "preset": "tiny", "method": method, "world_size": processes,
        "local_batch_size": global_batch // processes, "grad_accum": 1, "global_batch_size": global_batch,
        "learning_rate": 1e-3,
        "lr_scaling": "none", "steps": len(losses), "train_loss_first": losses[0], "train_loss_final": losses[-1],
        "eval_loss": 1.3, "exact_match_before": 0.1, "exact_match_after": 0.5, "runtime_s": 3.0,
        "samples_per_s": samples_per_s, "tokens_per_s": 50 * samples_per_s, "trainable_params": 1000,
        "total_params": 100000, "adapter_bytes": 4096, "memory": memory,
        "peak_memory_bytes": max(m["end"]["peak_rss"] for m in memory),
    })
    return run


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "runs"
    fake_run(root / "lora_x1", processes=1, samples_per_s=10.0)
    fake_run(root / "lora_x2", processes=2, samples_per_s=16.0)
    fake_run(root / "full_x1", processes=1, samples_per_s=5.0, method="full", rank=None)
    fake_run(root / "crashed", processes=2, finish=False).fail("RuntimeError: boom")
    fake_run(root / "still_running", processes=2, finish=False)
    fake_run(root / "killed", processes=2, finish=False).fail("interrupted: SIGTERM", status="interrupted")
    (root / "lora_x1" / ".summary.json.abc123.tmp").write_text("{half a fi")  # a crash's temporary file
    return root


def table(comparison, title):
    return next(t for t in comparison.tables if t.title == title)


def test_only_complete_runs_enter_the_tables(results):
    c = compare.compare(results)
    assert sorted(c.labels[r["path"]] for r in c.runs) == ["full_x1", "lora_x1", "lora_x2"]
    assert sorted(c.left_out) == [("crashed", "failed"), ("killed", "interrupted"), ("still_running", "running")]
    text = compare.render(c)
    for t in c.tables:
        for row in t.rows:
            assert t.title == "Left out" or not any(bad in cell for cell in row
                                                    for bad in ("crashed", "killed", "still_running"))
    assert sorted(table(c, "Left out").rows) == [["crashed", "failed"], ["killed", "interrupted"],
                                                 ["still_running", "running"]]
    said = [line for line in text.splitlines() if line.startswith("not compared")]
    assert len(said) == 1 and "3 run(s)" in said[0] and "failed: 1" in said[0], said


def test_speedup_groups_runs_that_split_one_global_batch_over_other_process_counts(results):
    fake_run(results / "benchmark" / "lora_x1_repeat", processes=1, samples_per_s=40.0)  # another folder's run
    c = compare.compare(results)
    assert c.speedup_groups == {"runs: lora tiny r8 Test CPU": [(1, 1.0), (2, pytest.approx(1.6))]}
    rows = table(c, "Speedup").rows
    header = table(c, "Speedup").header
    by_run = {r[header.index("run")]: r for r in rows}
    assert set(by_run) == {"lora_x1", "lora_x2"}  # the full fine-tuning run is another experiment
    assert by_run["lora_x2"][header.index("speedup")] == "1.60x"
    assert by_run["lora_x2"][header.index("efficiency")] == "80%"
    assert by_run["lora_x1"][header.index("global batch")] == by_run["lora_x2"][header.index("global batch")] == "8"


def test_runs_of_other_global_batches_or_steps_are_no_speedup_and_each_pair_is_listed_once(tmp_path):
    fake_run(tmp_path / "x1", processes=1, samples_per_s=10.0, global_batch=8)
    fake_run(tmp_path / "x2", processes=2, samples_per_s=16.0, global_batch=16)  # each process keeps 8
    fake_run(tmp_path / "y1", processes=1, samples_per_s=10.0, losses=(2.0, 1.5))  # other steps
    c = compare.compare(tmp_path)
    assert c.speedup_groups == {}
    assert [(a, b) for a, b, _ in c.unpaired] == [("x1", "x2"), ("y1", "x2")]  # x2 against x1 is the same pair
    assert c.unpaired[0][2] == "global batch 8 against 16"
    assert "steps 2 against 3" in c.unpaired[1][2]
    assert table(c, "Not a speedup").rows[0][:4] == ["x1", "1", "x2", "2"]
    said = [line for line in compare.render(c).splitlines() if "not compared" in line]
    assert len(said) == 1 and "2 pair(s)" in said[0], said
    text = compare.render(c)  # the pairs themselves: with --verbose, and in comparison.txt
    assert "Not a speedup\n" not in text and "not shown: Not a speedup (2 rows)" in text
    assert "Not a speedup\n" in compare.render(c, verbose=True)


def test_runs_that_differ_in_more_than_the_process_count_form_no_group_and_a_line_says_why(tmp_path):
    fake_run(tmp_path / "lora_x1", processes=1, samples_per_s=10.0).update(threads_per_process=2)
    fake_run(tmp_path / "lora_x2", processes=2, samples_per_s=16.0).update(threads_per_process=1)
    c = compare.compare(tmp_path)
    assert c.speedup_groups == {}
    assert c.unpaired == [("lora_x1", "lora_x2", "threads per process 2 against 1: run both with the same "
                                                 "OMP_NUM_THREADS")]


def test_memory_batch_and_quality_tables(results):
    c = compare.compare(results)
    memory = table(c, "Memory per device")
    assert [(r[0], r[2]) for r in memory.rows if r[0] == "lora_x2"] == [("lora_x2", "0"), ("lora_x2", "1")]
    assert {r[memory.header.index("peak")] for r in memory.rows if r[0] == "lora_x2"} == {"400.0 MiB", "401.0 MiB"}
    batch = table(c, "Batch and learning rate")
    assert {r[0]: r[batch.header.index("global batch")] for r in batch.rows}["lora_x2"] == "8"
    quality = table(c, "Quality")
    assert quality.rows[0][quality.header.index("exact match")] == "0.10 -> 0.50"


def test_runs_with_other_versions_or_commit_are_marked(tmp_path):
    fake_run(tmp_path / "a", commit="aaaa")
    fake_run(tmp_path / "b", commit="aaaa")
    fake_run(tmp_path / "c", commit="bbbb", versions={"torch": "2.0.0"})
    c = compare.compare(tmp_path)
    names = [r[0] for r in table(c, "Runs").rows]
    assert names == ["a", "b", f"c{compare.VERSIONS_MARK}{compare.COMMIT_MARK}"]
    assert any("torch 2.0.0 (others 2.13.0" in n for n in c.notes)
    assert any("other commit bbbb" in n for n in c.notes)


def test_the_reference_comparison_fits_a_terminal_and_its_plots_stay_readable(tmp_path, capsys):
    """The committed reference folders (the benchmarks, the series, the GPU check) read as a report: under 150 lines,
    none over 120 characters, a few notes rather than one per run, the long tables named in one line (whole with
    --verbose and in comparison.txt), at most 12 curves a panel, and images of sane size."""
    import struct

    from my_utils.core.plots import LEGEND_ENTRIES, loss_panels
    from my_utils.core.paths import REPO_ROOT

    folders = sorted((REPO_ROOT / "runs" / "reference").iterdir())
    compare.main([*map(str, folders), "--output-dir", str(tmp_path / "out")])
    lines = capsys.readouterr().out.splitlines()
    assert compare.TERMINAL_WIDTH == 120 and max(map(len, lines)) <= 120, max(lines, key=len)
    assert len(lines) < 150 and "Speedup" in lines and "Runs" not in lines
    assert any(line.startswith("not shown: Runs (") for line in lines)
    assert (tmp_path / "out" / "comparison.txt").read_text(encoding="utf-8").startswith("Runs\n")
    compare.main([*map(str, folders), "--verbose"])
    verbose = capsys.readouterr().out.splitlines()
    assert "Runs" in verbose and "Left out" in verbose and len(verbose) > 500
    assert sum(line.startswith(("not compared", compare.COMMIT_MARK, compare.VERSIONS_MARK)) for line in lines) < 10
    assert sum(line.startswith("not compared") for line in lines) == 1
    c = compare.compare(*folders)
    panels = loss_panels(c.runs, c.labels)
    assert len(panels) > 5 and max(len(runs) for _, runs in panels) <= LEGEND_ENTRIES
    for png in (tmp_path / "out").glob("*.png"):
        width, height = struct.unpack(">II", png.read_bytes()[16:24])  # the PNG header's IHDR
        assert width <= 2000 and height <= 3000, (png.name, width, height)


def test_loss_curves_are_legible_at_a_glance(tmp_path):
    """Rendered and inspected: every line of a panel styled apart (identical curves still both show), a folder split
    over panels says which share each is, axes named, and a run without a curve named instead of dropped."""
    from my_utils.core.plots import LEGEND_ENTRIES, loss_figure

    for i in range(LEGEND_ENTRIES + 2):  # more runs than one panel labels, all with the same curve
        fake_run(tmp_path / "lesson" / f"run_{i:02d}", processes=1 + i % 2)
    fake_run(tmp_path / "lesson" / "one_point", losses=(2.0,))
    c = compare.compare(tmp_path)
    fig = loss_figure(c.runs, c.labels)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    titles = [ax.get_title() for ax in axes]
    assert len(axes) == 2 and len(set(titles)) == 2 and "(1 of 2)" in titles[0] and "(2 of 2)" in titles[1]
    assert "no curve (under 2 losses logged): one_point" in titles[0]
    for ax in axes:
        styles = [(line.get_color(), line.get_linestyle()) for line in ax.get_lines()]
        assert len(set(styles)) == len(styles), "two lines of one panel look alike"
        assert len(ax.get_legend().get_texts()) == len(styles) and ax.get_xlabel() and ax.get_ylabel()
        assert ax.get_xlabel().startswith("samples seen")  # every run reports its batch: one x-axis for all


def test_runs_that_shared_one_process_are_marked_for_their_peak_memory(tmp_path):
    for name in ("a", "b", "own"):
        fake_run(tmp_path / name)
    for name in ("a", "b"):  # a sweep's worker trained both
        record = json.loads((tmp_path / name / "run.json").read_text())
        (tmp_path / name / "run.json").write_text(json.dumps({**record, "pid": 4242}))
    c = compare.compare(tmp_path)
    rows = {row[0] for row in table(c, "Runs").rows}
    assert rows == {"a" + compare.SHARED_MARK, "b" + compare.SHARED_MARK, "own"}, rows
    assert any(note.startswith(compare.SHARED_MARK) and "a, b" in note for note in c.notes), c.notes


def test_unreadable_and_summaryless_folders_are_listed(tmp_path):
    fake_run(tmp_path / "ok")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "run.json").write_text('{"status": "compl')
    (tmp_path / "a_list").mkdir()
    (tmp_path / "a_list" / "run.json").write_text('[1, 2]')
    run = fake_run(tmp_path / "no_summary", finish=False)
    run.update(status="complete")
    Run.create(tmp_path / "demo", config={}).finish({"notebook_seconds": {"00_setup.ipynb": 3.0}})
    c = compare.compare(tmp_path)
    assert [c.labels[r["path"]] for r in c.runs] == ["ok"]
    assert dict(c.left_out) == {"broken": "unreadable: run.json is not valid JSON (line 1, column 12)",
                                "a_list": "unreadable: run.json holds no JSON object",
                                "no_summary": "complete, but no summary.json", "demo": "complete, no training figures"}


def test_markdown_and_output_folder(results, tmp_path):
    c = compare.compare(results)
    files = compare.write_outputs(c, tmp_path / "out")
    assert {p.name for p in files.values()} == {"loss_curves.png", "memory.png", "speedup.png", "comparison.md",
                                                "comparison.txt"}
    for p in files.values():
        assert p.stat().st_size > 1000
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = files["markdown"].read_text()
    assert "### Runs" in md and "### Speedup" in md and "| lora_x2 | 2 |" in md
    assert "![Speedup against the ideal](speedup.png)" in md
    assert not list((tmp_path / "out").glob(".*.tmp"))


@pytest.mark.slow
def test_command_line(results, tmp_path):
    out = subprocess.run([sys.executable, "-m", "my_utils", "compare", str(results), "--output-dir", str(tmp_path / "o")],
                         capture_output=True, text=True, check=True)
    assert "Speedup" in out.stdout and "not compared: 3 run(s)" in out.stdout and "Left out" in out.stdout
    assert (tmp_path / "o" / "speedup.png").is_file()
    md = subprocess.run([sys.executable, "-m", "my_utils", "compare", str(results), "--markdown"],
                        capture_output=True, text=True, check=True).stdout
    assert "| run |" in md and "| killed | interrupted |" in md and "- not compared: 3 run(s)" in md
    bad = subprocess.run([sys.executable, "-m", "my_utils", "compare", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def test_a_folder_without_a_complete_training_run_says_so_in_one_sentence(tmp_path, capsys):
    Run.create(tmp_path / "demo", config={}).finish({"notebook_seconds": {"00_setup.ipynb": 3.0}})
    compare.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert out.startswith(f"No complete training run under {tmp_path} to compare") and "Runs\n" not in out
    assert "demo  complete, no training figures" in out


def test_a_resumed_run_says_which_steps_its_runtime_timed(results):
    summary = json.loads((results / "lora_x2" / "summary.json").read_text())
    (results / "lora_x2" / "summary.json").write_text(json.dumps({**summary, "resumed_from_step": 2}))
    runs = table(compare.compare(results), "Runs")
    row = next(r for r in runs.rows if r[0] == "lora_x2")
    assert row[runs.header.index("steps")] == "3 (from 2)"


def test_no_results_folder_is_one_sentence(tmp_path):
    with pytest.raises(UserError, match="No results folder"):
        compare.main([str(tmp_path)])


def test_overview_keeps_working_for_the_demo(results):
    text = compare.overview(results, root=results)
    assert text.startswith("Runs\n") and "lora_x2" in text and "still_running" in text and "running: 1" in text


@pytest.mark.slow
def test_a_real_tiny_run_is_compared(tmp_path, subprocess_env):
    out = tmp_path / "runs" / "real"
    subprocess.run([sys.executable, "-m", "my_utils.workflows.lora", "--preset", "tiny", "--max-steps", "2",
                    "--skip-generation-eval", "--eval-rows", "8", "--output-dir", str(out)],
                   env=subprocess_env, check=True, capture_output=True, text=True)
    fake_run(tmp_path / "runs" / "crashed", finish=False).fail("RuntimeError: boom")
    c = compare.compare(tmp_path / "runs")
    assert [c.labels[r["path"]] for r in c.runs] == ["real"]
    summary = json.loads((out / "summary.json").read_text())
    runs_row = table(c, "Runs").rows[0]
    assert f"{summary['samples_per_s']:.1f}" in runs_row
    assert c.left_out == [("crashed", "failed")]
    memory = table(c, "Memory per device")
    assert memory.rows[0][memory.header.index("peak")] == compare.format_bytes(summary["peak_memory_bytes"])
    files = compare.write_outputs(c, tmp_path / "out")
    assert files["Peak memory per device"].is_file() and "### Memory per device" in files["markdown"].read_text()
    # the run in the layout of peft's published method comparison
    peft_layout = json.loads((files["peft"] / "real.json").read_text())
    assert set(peft_layout) == {"run_info", "train_info", "meta_info"}
    assert peft_layout["run_info"]["experiment_name"] == f"lora/tiny-lr_{summary['learning_rate']:g}"
    assert peft_layout["run_info"]["peft_config"]["peft_type"] == "LORA"
    assert peft_layout["train_info"]["num_trainable_params"] == summary["trainable_params"]
    assert peft_layout["train_info"]["metrics"][-1]["test loss"] == summary["eval_loss"]
