"""``my_utils.core.records``: one way to read a results folder's records, for the folders written now and for the
older ones (LoRA's flag fields beside or instead of peft's config, the table's label in summary.json's ``method``,
the process index named ``rank``): tests/fixtures/old_records keeps two such folders, trimmed, and the committed
reference runs are read whatever version wrote them."""

import json
from pathlib import Path

import pytest

from my_utils.core.adapters import AdapterSpec
from my_utils.core.paths import REPO_ROOT
from my_utils.core.records import (adapter_file_of, adapter_of, adapter_spec_of, global_batch_of, label_of,
                                   local_batch_of, lora_settings, method_of, process_of, row_of, settings_of)
from my_utils.run.config import as_record
from my_utils.run.results import load_run
from my_utils.tools import compare

OLD = Path(__file__).parent / "fixtures" / "old_records"


def test_old_folders_read_as_new_ones():
    qlora, dora = load_run(OLD / "qlora_4bit"), load_run(OLD / "dora")
    # the oldest run.json: LoRA's flag fields alone; summary.json's method was the label
    assert adapter_of(qlora["run"]) == {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
                                        "use_rslora": False, "use_dora": False, "target_modules": ["c_attn"]}
    assert qlora["summary"]["method"] == "qlora-4bit"
    assert method_of(qlora["run"], qlora["summary"]) == "lora"
    assert label_of(qlora["run"], qlora["summary"]) == "qlora-4bit"
    # flag fields and peft's config side by side, and a DoRA run that summary.json called "lora"
    assert adapter_of(dora["run"])["use_dora"] is True and adapter_file_of(dora["run"]) == "../configs/peft/dora.json"
    assert label_of(dora["run"], dora["summary"]) == "dora"
    for run in (qlora, dora):
        assert [process_of(entry) for entry in run["summary"]["memory"]] == list(range(run["run"]["world_size"]))
        assert [process_of(entry) for entry in run["summary"]["first_batches"]] == [0]
        row = row_of(run["run"], run["summary"])
        assert (row["rank"], row["alpha"], row["targets"], row["method"]) == (8, 16, ["c_attn"], "lora")
        assert "adapter" not in row and row["peft_type"] == "LORA"


@pytest.mark.parametrize("spec, method, quantize, label", [
    (AdapterSpec(rank=4), "lora", "none", "lora"),
    (AdapterSpec(rank=4, dora=True), "lora", "none", "dora"),
    (AdapterSpec(rank=4), "lora", "4bit", "qlora-4bit"),
    (AdapterSpec(adapter_config="configs/peft/ia3.json"), "lora", "none", "ia3"),
    (AdapterSpec(), "full", "none", "full"),
])
def test_new_records_state_the_adapter_once(spec, method, quantize, label):
    resolved = spec.resolved(("c_attn",))
    run_info = {"config": {"method": method, "quantize": quantize, "adapter": resolved.record()}}
    assert resolved.record() == {"adapter_config": spec.adapter_config, "peft": resolved.peft}
    assert adapter_of(run_info) == (None if method == "full" else resolved.peft)
    assert adapter_spec_of(run_info) == (None if method == "full" else resolved)
    assert label_of(run_info, {"method": method}) == label and method_of(run_info) == method
    if label in ("lora", "dora", "qlora-4bit"):
        assert lora_settings(adapter_of(run_info)) == {"rank": 4, "alpha": 8, "dropout": 0.0, "rslora": False,
                                                       "dora": label == "dora", "targets": ["c_attn"]}
    assert settings_of(run_info)["adapter_config"] == spec.adapter_config


def test_as_record_writes_the_resolved_adapter_as_peft_config():
    from my_utils.workflows import lora

    cfg = lora.Config(adapter=AdapterSpec(rank=4).resolved(("c_attn",)))
    record = as_record(cfg)
    assert record["adapter"] == {"adapter_config": None, "peft": cfg.adapter.peft}
    assert '"rank"' not in json.dumps(record) and json.dumps(record).count('"r":') == 1


def test_every_reference_run_reads_through_the_accessor():
    """The committed reference, as it stands (old records until regenerated, new ones after): every LoRA-workflow
    run has an adapter unless it fine-tuned fully, a method and a label, and every memory entry a process index."""
    runs = [load_run(p.parent) for p in sorted((REPO_ROOT / "runs" / "reference").rglob("summary.json"))
            if (p.parent / "run.json").is_file()]
    lora_runs = [r for r in runs if r["summary"].get("workflow") == "lora"]
    assert lora_runs, "the reference holds LoRA-workflow runs"
    for r in lora_runs:
        method = method_of(r["run"], r["summary"])
        assert method in ("lora", "full")
        assert (adapter_of(r["run"]) is None) == (method == "full"), r["path"]
        label = label_of(r["run"], r["summary"])
        if r["summary"]["method"] not in ("lora", "full"):  # an older summary.json: its method was the label
            assert label == r["summary"]["method"], r["path"]
        peft = adapter_of(r["run"]) or {}
        assert label == "dora" if peft.get("use_dora") else label != "dora", r["path"]
    for r in runs:
        for j, entry in enumerate(r["summary"].get("memory") or [] if isinstance(r["summary"], dict) else []):
            assert isinstance(process_of(entry, j), int), r["path"]


def test_compare_shows_each_method_by_its_label(tmp_path):
    """The comparison table names DoRA's run dora and the quantized one qlora-4bit, from old records as from new."""
    c = compare.compare(OLD)
    runs_table = next(t for t in c.tables if t.title == "Runs")
    method = runs_table.header.index("method")
    assert sorted(row[method] for row in runs_table.rows) == ["dora", "qlora-4bit"]
    memory = next(t for t in c.tables if t.title == "Memory per device")
    assert {row[memory.header.index("rank")] for row in memory.rows} == {"0"}


def test_the_batch_reads_the_same_from_old_and_new_records():
    new_run = {"config": {"local_batch_size": 4, "grad_accum": 2}}
    new_summary = {"world_size": 2, "local_batch_size": 4, "global_batch_size": 16}
    assert (local_batch_of(new_summary), global_batch_of(new_run, new_summary)) == (4, 16)
    old_summary = {"world_size": 2, "batch_size_per_process": 4, "effective_batch": 16}
    assert (local_batch_of(old_summary), global_batch_of({}, old_summary)) == (4, 16)
    # a summary without its batch: the config's, per process (old name or new) x accumulation x processes
    assert global_batch_of({"config": {"batch_size": 4, "grad_accum": 2}, "world_size": 2}, {}) == 16
    assert global_batch_of({"config": {"global_batch_size": 12}}, {}) == 12
    dora = load_run(OLD / "dora")
    assert global_batch_of(dora["run"], dora["summary"]) == dora["run"]["config"]["batch_size"] == 16
    reference = [load_run(p.parent) for p in sorted((REPO_ROOT / "runs" / "reference").rglob("summary.json"))
                 if (p.parent / "run.json").is_file()]
    recorded = [r for r in reference if r["summary"].get("effective_batch") or r["summary"].get("global_batch_size")]
    assert recorded, "the reference holds runs that record their global batch"
    for r in recorded:
        assert global_batch_of(r["run"], r["summary"]) == r["summary"].get("global_batch_size",
                                                                          r["summary"].get("effective_batch"))
