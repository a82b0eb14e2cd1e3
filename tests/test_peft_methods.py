"""Every adapter is a peft config file: the shipped ones counted by the planner as peft counts them on every
preset, a new method added as one JSON file, a bad file refused in one sentence with nothing written, and a sweep
whose cells share worker processes giving each cell the results of its own process."""

import json
from pathlib import Path

import pytest

from my_utils import UserError
from my_utils.core.adapters import AdapterSpec
from my_utils.core.paths import REPO_ROOT
from my_utils.core.records import label_of
from my_utils.run.results import load_run
from my_utils.lessons.peft_methods import TRAINING_PARAMS, training_params
from my_utils.workflows import lora

PEFT = REPO_ROOT / "configs" / "peft"
SHIPPED = sorted(f for f in PEFT.glob("*.json") if not f.name.endswith(TRAINING_PARAMS))
TINY_RUN = ["--preset", "tiny", "--max-steps", "2", "--logging-steps", "1", "--local-batch-size", "4", "--eval-rows", "4",
            "--skip-generation-eval"]


# Why peft refuses a shipped method on some preset: LoHa adapts nn.Linear, not GPT-2's Conv1D; peft knows no layer
# norms of OPT to tune without names.
CANNOT = {"loha": "Conv1D", "ln_tuning": "name them with --targets"}


def test_the_planner_counts_every_shipped_method_as_peft_does_on_every_preset():
    from my_utils.core.devices import meta_model
    from my_utils.core.models import add_adapter
    from my_utils.core.presets import PRESETS
    from my_utils.tools.planner import adapter_parameters, architecture

    counted, refused = [], []
    for name, preset in PRESETS.items():
        if not preset.offline_config.get("causal"):
            continue
        for file in SHIPPED:
            spec = AdapterSpec(adapter_config=str(file)).resolved(preset.lora_targets)
            try:
                model = add_adapter(meta_model(preset.offline_config["causal"]), spec)
            except UserError as e:  # refused in one sentence, for a reason the sentence names
                assert CANNOT[file.stem] in str(e), (name, file.name, e)
                refused.append((name, file.stem))
                continue
            peft_count = model.get_nb_trainable_parameters()[0]
            planned = adapter_parameters(architecture(name), model.peft_config["default"].to_dict())
            assert planned == peft_count > 0, (name, file.name, planned, peft_count)
            counted.append((name, file.stem))
    assert len(SHIPPED) >= 9 and len(counted) >= 3 * len(SHIPPED), counted
    assert sorted(refused) == [("gpt2", "loha"), ("opt-350m", "ln_tuning"), ("tiny", "loha")], refused


def test_every_methods_learning_rates_are_data_beside_its_adapter_config(tmp_path):
    trained = sorted(f.name[:-len(TRAINING_PARAMS)] for f in PEFT.glob(f"*{TRAINING_PARAMS}"))
    assert "full" in trained and all((PEFT / f"{m}.json").is_file() for m in trained if m != "full"), trained
    for method in trained:
        rates = training_params(PEFT, method)["learning_rates"]
        assert len(rates) >= 3 and rates == sorted(rates), (method, rates)
    for rates in ([1e-3, 1e-2], [1e-2, 1e-3, 1e-1], [1e-3, 1e-3, 1e-2], "1e-3"):
        (tmp_path / f"x{TRAINING_PARAMS}").write_text(json.dumps({"learning_rates": rates}))
        with pytest.raises(UserError, match="three or more increasing positive rates"):
            training_params(tmp_path, "x")
    with pytest.raises(UserError, match="has no training parameters"):
        training_params(tmp_path, "y")


def _refusal(argv, capsys) -> str:
    """The one line a refused run prints; it exits 2."""
    with pytest.raises(SystemExit) as stop:
        lora.main(argv)
    assert stop.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1, said
    return said[0]


@pytest.mark.parametrize("content, flags, expected", [
    ("{not json", [], "is not valid JSON"),
    ('{"r": 8}', [], "has no peft_type field"),
    ('{"peft_type": "NOPE"}', [], "names an unknown peft_type 'NOPE'"),
    ('{"peft_type": "IA3", "rank": 4}', [], "sets 'rank', which IA3Config does not have"),
    ('{"peft_type": "IA3", "target_modules": ["q_proj"]}', [], "peft cannot add"),
    ('{"peft_type": "LORA", "r": 0}', [], "sets r to 0; it must be a positive whole number"),
    ('{"peft_type": "PROMPT_TUNING", "num_virtual_tokens": -5}', [],
     "sets num_virtual_tokens to -5; it must be a positive whole number"),  # torch's traceback, otherwise
    ('{"peft_type": "LORA", "lora_dropout": -0.5}', [], "sets lora_dropout to -0.5; it must be a finite number, at least 0"),
    ('{"peft_type": "IA3"}', ["--rank", "4"], "--rank sets a LoRA field, but"),
    ('{"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 16}', ["--targets", "c_attn"], "adapts no module"),
    ('{"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 16}', ["--max-length", "250"],
     "max_length 250 and 16 virtual tokens is longer than the model allows (256)"),
])
def test_a_bad_adapter_file_is_refused_in_one_sentence_naming_it_and_nothing_is_written(tmp_path, capsys, content,
                                                                                        flags, expected):
    file = tmp_path / "adapter.json"
    file.write_text(content)
    out = tmp_path / "out"
    said = _refusal([*TINY_RUN, "--adapter-config", str(file), *flags, "--output-dir", str(out)], capsys)
    assert expected in said and (str(file) in said or "virtual tokens" in said), said
    assert not out.exists()


def test_a_missing_adapter_file_and_a_method_a_workflow_cannot_train_are_refused(tmp_path):
    from my_utils.tools.planner import plan
    from my_utils.workflows import classification, sharded_lora

    with pytest.raises(UserError, match="does not exist"):
        AdapterSpec(adapter_config=str(tmp_path / "none.json")).check()
    ia3 = AdapterSpec(adapter_config=str(REPO_ROOT / "configs" / "peft" / "ia3.json"))
    for workflow in (classification, sharded_lora):
        with pytest.raises(UserError, match="trains LoRA adapters"):
            workflow.validate(workflow.Config(adapter=ia3))
    with pytest.raises(UserError, match="models the memory of LoRA, not of IA3"):
        plan("tiny", adapter=ia3)
    dora = AdapterSpec(adapter_config=str(REPO_ROOT / "configs" / "peft" / "dora.json"))
    with pytest.raises(UserError, match="not of DoRA"):
        plan("tiny", adapter=dora)


def test_a_lora_file_takes_the_flags_that_are_set_over_its_fields():
    spec = AdapterSpec(adapter_config=str(REPO_ROOT / "configs" / "peft" / "dora.json"), rank=4,
                       targets=("c_attn", "c_proj"))
    resolved = spec.resolved(("c_attn",))
    assert (resolved.rank, resolved.alpha, resolved.dora) == (4, 16, True)  # alpha and DoRA from the file
    assert resolved.peft["r"] == 4 and resolved.peft["use_dora"] is True
    assert resolved.peft["target_modules"] == ["c_attn", "c_proj"] and resolved.resolved(()) == resolved


@pytest.mark.slow
def test_a_method_added_as_one_json_file_trains_through_the_lora_workflow(tmp_path):
    """FourierFT ships no file here: writing one is all it takes."""
    file = tmp_path / "fourierft.json"
    file.write_text(json.dumps({"peft_type": "FOURIERFT", "n_frequency": 50, "target_modules": ["c_attn"]}))
    out = tmp_path / "run"
    summary = lora.main([*TINY_RUN, "--adapter-config", str(file), "--output-dir", str(out)])
    assert summary["method"] == "lora" and label_of(load_run(out)["run"], summary) == "fourierft"
    assert summary["trainable_params"] == 4 * 50  # 4 blocks' c_attn, n_frequency spectral coefficients each
    assert summary["steps"] == 2 and summary["eval_loss"] < summary["eval_loss_before"]
    recorded = load_run(out)["run"]["config"]["adapter"]
    assert recorded["peft"] == {"peft_type": "FOURIERFT", "n_frequency": 50, "target_modules": ["c_attn"]}
    saved = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "FOURIERFT" and saved["n_frequency"] == 50
    assert "FOURIERFT adapter" in (out / "adapter" / "README.md").read_text()


@pytest.mark.slow
def test_a_sweep_in_worker_processes_gives_each_cell_the_results_of_its_own_process(tmp_path):
    import os

    from my_utils.tools.sweep import SweepSpec, run_sweep

    spec = SweepSpec(preset="tiny", args={"max_steps": 3, "local_batch_size": 4, "eval_rows": 4, "logging_steps": 1,
                                          "skip_generation_eval": True},
                     grids=[{"adapter_config": [str(REPO_ROOT / "configs" / "peft" / "ia3.json")],
                             "learning_rate": [0.1]}, {"learning_rate": [0.004]}])
    fresh = run_sweep(spec, tmp_path / "fresh", steady_memory=False)
    shared = run_sweep(spec, tmp_path / "shared", steady_memory=False, fresh_processes=False)
    assert [r["name"] for r in fresh] == [r["name"] for r in shared] and len(shared) == 2
    for a, b in zip(fresh, shared):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-6), (a["name"], a["eval_loss"], b["eval_loss"])
        assert [loss for _, loss in a["loss_curve"]] == pytest.approx([loss for _, loss in b["loss_curve"]], rel=1e-6)
        assert (Path(b["path"]) / "output.log").is_file()
    assert len({r["pid"] for r in fresh}) == 2 and len({r["pid"] for r in shared}) == 1
    assert os.getpid() not in {r["pid"] for r in shared}
