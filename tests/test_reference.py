"""The committed reference runs: how a results folder is saved under runs/reference/ (records, not weights, and no
paths of the machine that ran it) and how the README's results section is generated from them."""

import importlib.util
import re
import sys

import pytest

from my_utils.core.paths import REPO_ROOT
from my_utils.run.results import Run, read_json
from my_utils.tools import bench


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lora_run(path, origin):
    run = Run.create(path, config={"preset": "tiny", "method": "lora", "output_dir": str(path)}, command=["test"],
                     world_size=1, devices=[{"kind": "cpu", "index": None, "name": "Test CPU", "cores": 2}])
    run.log_metrics({"step": 1, "loss": 2.0})
    run.finish({"workflow": "lora", "preset": "tiny", "method": "lora", "world_size": 1, "steps": 1,
                "train_loss_first": 2.0, "train_loss_final": 1.0, "exact_match_before": 0.05,
                "exact_match_after": 0.5, "samples_per_s": 10.0, "base_model": f"{origin}/assets/tiny/causal_lm"})


def test_saving_keeps_records_drops_weights_and_machine_paths(tmp_path, monkeypatch):
    save_reference = load_script("save_reference")
    monkeypatch.setattr(save_reference, "REFERENCE", tmp_path / "reference")
    origin = tmp_path / "checkout"  # a checkout elsewhere on the machine that wrote the folder
    (origin / "my_utils").mkdir(parents=True)
    source = origin / "runs" / "run_1_cpu_x2"
    lora_run(source / "04_lora" / "lora", origin)
    (source / "04_lora" / "lora" / "adapter").mkdir()
    (source / "04_lora" / "lora" / "adapter" / "adapter_model.safetensors").write_bytes(b"0" * 100)
    (source / "04_lora" / "lora" / "checkpoints" / "checkpoint-1").mkdir(parents=True)
    (source / "04_lora" / "lora" / "checkpoints" / "checkpoint-1" / "trainer_state.json").write_text("{}")
    (source / "04_lora.ipynb").write_text(f'{{"note": "ran in {origin}/notebooks", '
                                          f'"warning": "{sys.base_prefix}/lib/copyreg.py:105: FutureWarning", '
                                          '"printed": "runs/run_1_cpu_x2/04_lora/lora and runs/run_1_cpu_x20"}')

    saved = save_reference.save(source, "cpu_x2")
    files = sorted(p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file())
    assert files == ["04_lora.ipynb", "04_lora/lora/metrics.jsonl", "04_lora/lora/run.json",
                     "04_lora/lora/summary.json"]
    assert read_json(saved / "04_lora/lora/summary.json")["base_model"] == "assets/tiny/causal_lm"
    saved_text = "".join(p.read_text() for p in saved.rglob("*") if p.is_file())
    assert str(origin) not in saved_text and sys.base_prefix not in saved_text
    assert "<python>/lib/copyreg.py" in saved_text
    # the paths the lesson printed and the run recorded name where the folder now is
    assert "runs/reference/cpu_x2/04_lora/lora and runs/run_1_cpu_x20" in saved_text
    assert read_json(saved / "04_lora/lora/run.json")["config"]["output_dir"] == "runs/reference/cpu_x2/04_lora/lora"
    with pytest.raises(SystemExit, match="exists already"):
        save_reference.save(source, "cpu_x2")


def test_readme_section_has_comparison_and_benchmark_tables(tmp_path, monkeypatch):
    update_readme = load_script("update_readme")
    reference = tmp_path / "reference"
    monkeypatch.setattr(update_readme, "REFERENCE", reference)
    lora_run(reference / "cpu_x2" / "04_lora" / "lora", tmp_path)
    rows = [bench.ratio_row("overhead", "useful tokens/s", "workflow", "bare loop", 0.99, target=0.98)]
    Run.create(reference / "cpu_bench" / "overhead", config={}, command=["test"]).finish(
        {"benchmark": "overhead", "ratios": rows})
    Run.create(reference / "cpu_bench" / "ddp", config={}, command=["test"]).fail("RuntimeError: boom")

    section = update_readme.results_section()
    assert section.startswith(update_readme.START) and section.endswith(update_readme.END)
    assert "### `runs/reference/cpu_x2` — Test CPU (2 cores)" in section
    assert "0.05 -> 0.50" in section  # the quality table of the comparison
    assert "- **overhead 0.990**, target met: at least 0.98: workflow against bare loop" in section
    assert "**ddp" not in section  # a failed benchmark never enters a table


def test_the_series_table_reads_the_notebooks_and_the_claims_table_the_reference_run(tmp_path, monkeypatch):
    from my_utils.lessons.notebook import record_claims

    update_readme = load_script("update_readme")
    monkeypatch.setattr(update_readme, "DEMO_REFERENCE", REPO_ROOT / "runs" / "x" / "cpu_x2")
    notebooks = sorted(p.stem for p in (REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    table = update_readme.series_section().splitlines()
    assert table[0] == update_readme.SERIES_START and table[-1] == update_readme.SERIES_END
    assert [row.split(" | ")[0].strip("| ") for row in table[3:-1]] == [stem[:2] for stem in notebooks]
    assert "| [LoRA on one device](notebooks/04_lora.ipynb) | Adapters, trainable parameters" in table[7]

    monkeypatch.setattr(update_readme, "DEMO_REFERENCE", tmp_path / "cpu_x2")
    record_claims(tmp_path / "cpu_x2" / "04_lora", [("LoRA learns", "exact match 0.05 -> 0.69"), ("small", "1 KiB")])
    section = update_readme.claims_section()
    lessons = re.findall(r"^\*\*(\d\d) · ", section, re.M)
    assert lessons == [stem[:2] for stem in notebooks]  # every notebook, in order
    by_lesson = dict(zip(lessons, re.split(r"^\*\*\d\d · .*$", section, flags=re.M)[1:]))
    assert by_lesson["04"].split() == "- LoRA learns: **exact match 0.05 -> 0.69** - small: **1 KiB**".split()
    assert by_lesson["05"].split() == ["-", "not", "recorded"]  # a lesson without a claims file says so
    assert max(map(len, section.splitlines())) <= 200  # a page to read, not to scroll sideways


def test_a_notebook_without_its_teaches_line_stops_the_generator(tmp_path, monkeypatch):
    import json
    import shutil

    update_readme = load_script("update_readme")
    (tmp_path / "notebooks").mkdir()
    nb = json.loads((REPO_ROOT / "notebooks" / "00_setup.ipynb").read_text(encoding="utf-8"))
    nb["cells"][0]["source"] = ["# 00 · Setup\n", "\n", "No line says what it teaches."]
    (tmp_path / "notebooks" / "00_setup.ipynb").write_text(json.dumps(nb), encoding="utf-8")
    shutil.copy(REPO_ROOT / "notebooks" / "04_lora.ipynb", tmp_path / "notebooks")
    monkeypatch.setattr(update_readme, "REPO_ROOT", tmp_path)
    with pytest.raises(SystemExit, match="00_setup.ipynb: its first cell needs"):
        update_readme.lessons()


def test_the_readme_fits_table_is_the_planners():
    """The planner page's what-fits-per-card tables are generated, never typed: regenerate them when the planner
    changes (python scripts/update_readme.py)."""
    from my_utils.tools.planner import fits_table, split_fits_table

    update_readme = load_script("update_readme")
    page = (REPO_ROOT / "docs" / "planner.md").read_text(encoding="utf-8")
    assert "\n".join([update_readme.FITS_START, fits_table(), update_readme.FITS_END]) in page
    assert "\n".join([update_readme.SPLITS_START, split_fits_table(), update_readme.SPLITS_END]) in page


def test_the_readme_test_times_are_the_reference_reports():
    """The suite's times in the quick start are generated from the reports of a fresh clone's make test and make
    test-fast (COURSE_TEST_REPORT), never typed; each report is of a passing run of its selection."""
    update_readme = load_script("update_readme")
    reports = {name: read_json(update_readme.TESTS_REFERENCE / f"{name}.json") for name in ("test", "test_fast")}
    assert reports["test"]["selection"] == "all" and reports["test_fast"]["selection"] == "not slow"
    assert all(r["exit_status"] == 0 and r["failed"] == r["error"] == 0 and r["workers"] == 2 for r in reports.values())
    sentence = update_readme.tests_sentence()
    assert f"took {reports['test']['seconds'] / 60:.1f} minutes there ({reports['test']['passed']} tests" in sentence
    assert sentence in (REPO_ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_demo_time_is_the_reference_runs():
    """The demo's time in the quick start is generated from the reference demo's summary.json, never typed."""
    from my_utils.run.results import read_json

    update_readme = load_script("update_readme")
    sentence = update_readme.demo_sentence()
    demo = read_json(update_readme.DEMO_REFERENCE / "demo" / "summary.json")
    assert f"took {demo['wall_seconds']:.0f} s for its\n{len(demo['notebook_seconds'])} notebooks" in sentence
    assert sentence in (REPO_ROOT / "README.md").read_text(encoding="utf-8")
