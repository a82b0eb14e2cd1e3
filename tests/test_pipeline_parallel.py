"""Layer splits balanced by parameter count, the naive split's timeline, what a schedule holds, torch's multi-stage
schedules as tables, and bad input refused. Lesson 08's closing checks hold the two-process runs (GPipe and 1F1B)
to the plain model: output, gradients, micro-batches held, world size seen by each worker."""

import pytest

from my_utils import UserError
from my_utils.core.devices import (_contiguous_partition, balanced_layer_split, layer_stack, meta_model,
                                   parameters_per_device)


def small_gpt2(vocab=5000, layers=6):
    from transformers import GPT2Config

    return meta_model(GPT2Config(vocab_size=vocab, n_layer=layers, n_embd=64, n_head=4, n_positions=64,
                                 architectures=["GPT2LMHeadModel"]))


def test_contiguous_partition_is_even_and_keeps_order():
    assert _contiguous_partition([5, 1, 1, 1, 1, 5], 2) == [3, 3]
    assert _contiguous_partition([10, 1, 1, 1], 2) == [1, 3]
    assert _contiguous_partition([1] * 6, 3) == [2, 2, 2]
    assert sum(_contiguous_partition([3, 1, 4, 1, 5, 9, 2, 6], 4)) == 8


def test_balanced_split_covers_every_parameter_in_order():
    model = small_gpt2()
    device_map = balanced_layer_split(model, ["cuda:0", "cuda:1", "cuda:2"])
    stack, blocks = layer_stack(model)
    assert stack == "transformer.h" and len(blocks) == 6
    assert list(device_map)[:2] == ["transformer.wte", "transformer.wpe"] and list(device_map)[-1] == "lm_head"
    assert list(dict.fromkeys(device_map.values())) == ["cuda:0", "cuda:1", "cuda:2"], "consecutive, non-empty stages"
    counts = parameters_per_device(model, device_map)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert sum(counts.values()) == sum(unique.values())


def test_balanced_split_beats_equal_layer_counts_when_embeddings_are_large():
    model = small_gpt2(vocab=20000, layers=8)  # embeddings 1.3M parameters, layers 50k each
    balanced = parameters_per_device(model, balanced_layer_split(model, [0, 1]))
    equal = {n: (0 if not n.startswith("transformer.h.") or int(n.rsplit(".", 1)[1]) < 4 else 1)
             for n in balanced_layer_split(model, [0, 1])}
    equal = {**equal, "lm_head": 1, "transformer.ln_f": 1}
    assert max(balanced.values()) < max(parameters_per_device(model, equal).values())


def test_balanced_split_from_a_config_folder_matches_the_model_names():
    from my_utils.core.presets import get_preset

    folder = get_preset("tiny").offline_config["causal"]
    names = dict(meta_model(folder).named_modules())
    device_map = balanced_layer_split(folder, ["cuda:0", "cuda:1"])
    assert set(device_map) <= set(names)


def test_more_devices_than_layers_is_refused():
    with pytest.raises(UserError, match="Cannot split 6 layers over 7 devices"):
        balanced_layer_split(small_gpt2(), list(range(7)))


def test_naive_split_runs_one_stage_at_a_time():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from my_utils.core.pipeline import concurrent_time, naive_split_timeline

    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_layer=4, n_embd=32, n_head=2, n_positions=32)).eval()
    device_map = balanced_layer_split(model, ["a", "b"])
    lanes = naive_split_timeline(model, device_map, [{"input_ids": torch.randint(0, 100, (2, 16))}] * 3)
    assert set(lanes) == {"stage a", "stage b"}
    assert all(len(events) == 3 for events in lanes.values())
    assert concurrent_time(lanes) == 0
    # a synthetic overlap is counted
    overlap = {"x": [{"start": 0.0, "end": 2.0}], "y": [{"start": 1.0, "end": 3.0}], "z": [{"start": 2.0, "end": 4.0}]}
    assert concurrent_time(overlap) == pytest.approx(2.0)


def test_micro_batches_held_are_counted_from_a_stage_timeline():
    from my_utils.core.pipeline import peak_in_flight

    def events(kinds):
        return [{"kind": "forward" if k == "F" else "backward", "start": float(i)} for i, k in enumerate(kinds)]

    assert peak_in_flight(events("FFFFBBBB")) == 4  # GPipe
    assert peak_in_flight(events("FFBFBFBB")) == 2  # 1F1B on the first of two stages
    assert peak_in_flight(events("FBFBFBFB")) == 1  # 1F1B on the last stage


@pytest.mark.parametrize("schedule", ["interleaved 1F1B", "interleaved zero bubble", "zero bubble V"])
def test_multi_stage_schedules_are_tabled_without_a_process_group(schedule):
    from my_utils.core.pipeline import action_table

    table, empty = action_table(schedule, processes=2, microbatches=4)
    assert table.splitlines()[0].split() == ["Rank", "0", "Rank", "1"]
    for stage in range(4):  # every stage runs every micro-batch's forward, and its backward (whole, or I and W)
        for mb in range(4):
            assert f" {stage}F{mb} " in table + " "
            assert f" {stage}B{mb} " in table + " " or (f" {stage}I{mb} " in table + " " and f" {stage}W{mb} " in table + " ")
    assert 0 <= empty < 0.5


def test_splitting_the_backward_idles_less_than_interleaved_1f1b_at_the_same_stage_placement():
    from my_utils.core.pipeline import action_table

    assert action_table("interleaved zero bubble", 2, 4)[1] < action_table("interleaved 1F1B", 2, 4)[1]


def test_the_idle_share_weighs_a_whole_backward_as_two_units():
    """Two processes in lock step: a column where one runs a whole backward (2) and the other a forward (1) leaves
    the second idle for one unit of the two."""
    from types import SimpleNamespace

    from my_utils.core import pipeline

    action = lambda kind: SimpleNamespace(computation_type=SimpleNamespace(name=kind))  # noqa: E731
    order = {0: [action("FULL_BACKWARD")], 1: [action("FORWARD")]}
    schedule = SimpleNamespace(pipeline_order=order)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(pipeline.MULTI_STAGE_SCHEDULES, "fake", "Fake")
        patch.setattr("torch.distributed.pipelining.schedules.Fake", lambda *a, **k: schedule, raising=False)
        patch.setattr("torch.distributed.pipelining.schedules._format_pipeline_order", lambda o: "", raising=False)
        assert pipeline.action_table("fake", processes=2, microbatches=1)[1] == pytest.approx(1 / 4)


def test_bad_pipeline_config_is_refused_before_anything_runs():
    from my_utils.workflows.pipeline_parallel import Config, validate

    with pytest.raises(UserError, match="multiple of --microbatches"):
        validate(Config(global_batch_size=10, microbatches=4))
    with pytest.raises(UserError, match="Unknown schedule"):
        validate(Config(schedule="zero-bubble"))
    with pytest.raises(UserError, match="1F1B needs at least one micro-batch per stage"):
        validate(Config(schedule="1f1b", microbatches=1, global_batch_size=4, num_processes=2))
    with pytest.raises(UserError, match="5 stages for a model of 4 layers"):
        validate(Config(num_processes=5, global_batch_size=20, microbatches=5))


@pytest.mark.slow
@pytest.mark.parametrize("args, expected", [
    (["--seq-len", "32"], "unrecognized arguments: --seq-len 32; see --help."),
    (["--max-steps", "0"], "pipeline_parallel: error: --max-steps must be a positive integer, got 0."),
    (["--schedule", "zb"], "argument --schedule: invalid choice: 'zb'"),
    ([], "pipeline_parallel splits the model over processes but this run has one"),
])
def test_bad_input_from_the_command_line_is_one_line_and_writes_nothing(tmp_path, subprocess_env, args, expected):
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "my_utils.workflows.pipeline_parallel", *args, "--output-dir", str(out)],
                          env=subprocess_env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]
    assert not out.exists()
