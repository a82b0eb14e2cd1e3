"""Megatron-style tensor parallel (and sequence parallel) on two gloo processes: one step equal to an unsplit copy,
the collectives of each phase as the plan's arithmetic says, half of every split matrix on each process; bad
degrees refused before any process group starts."""

import pytest

from my_utils import UserError


def test_the_collective_count_is_megatrons():
    from my_utils.workflows.tensor_parallel import expected_collectives

    # two layers, untied: 2 blocks per layer, plus the vocabulary-split embedding and output layer
    assert expected_collectives(2, sequence_parallel=False, tied=False) == {
        "forward": {"all_reduce": 5, "all_gather": 1}, "backward": {"all_reduce": 5}, "optimizer": {}}
    # sequence parallel: every all-reduce becomes a reduce-scatter and an all-gather; 5 norms summed at the step
    assert expected_collectives(2, sequence_parallel=True, tied=False) == {
        "forward": {"all_gather": 6, "reduce_scatter": 5}, "backward": {"all_gather": 5, "reduce_scatter": 5},
        "optimizer": {"all_reduce": 5}}
    # a whole (tied) embedding and output layer add no sums
    assert expected_collectives(3, sequence_parallel=False, tied=True) == {
        "forward": {"all_reduce": 6}, "backward": {"all_reduce": 6}, "optimizer": {}}


def test_the_plan_splits_every_linear_layer_of_a_llama_block():
    import torch
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from my_utils.workflows.tensor_parallel import TINY_LLAMA, megatron_plan

    layer = LlamaDecoderLayer(AutoConfig.from_pretrained(TINY_LLAMA), layer_idx=0)
    linears = {name for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    norms = {name for name, m in layer.named_modules() if "norm" in type(m).__name__.lower()}
    for sequence_parallel in (False, True):
        top, plan = megatron_plan(sequence_parallel, tied=False)
        assert linears <= set(plan), linears - set(plan)
        assert (norms <= set(plan)) == sequence_parallel, "only sequence parallel splits the norms' work"
        assert {"model.embed_tokens", "lm_head"} <= set(top)


@pytest.mark.parametrize("args, message", [
    ({"preset": "gpt2", "num_processes": 2}, "written for Llama-family layers"),
    ({"num_processes": 3}, "The model's attention heads, 4, do not split over 3 processes"),
    ({"num_processes": 2, "sequence_parallel": True, "max_length": 63}, "make it a multiple of 2"),
    ({"num_processes": 2, "max_length": 257}, "beyond the model's 256 positions"),
    ({"num_processes": 2, "learning_rate": 0.0}, "--learning-rate"),
])
def test_bad_degrees_and_models_are_refused_before_anything_starts(args, message):
    from my_utils.workflows.tensor_parallel import Config, validate

    with pytest.raises(UserError, match=message):
        validate(Config(**args))


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_one_step_equals_the_unsplit_model_and_the_collectives_are_counted(tmp_path, subprocess_env,
                                                                           sequence_parallel):
    from my_utils.run.launch import accelerate_command, run_command
    from my_utils.run.results import load_run

    out = tmp_path / "run"
    args = ["--preset", "tiny", "--num-processes", 2, "--max-steps", 4, "--batch-size", 4, "--max-length", 32,
            "--output-dir", out, *(["--sequence-parallel"] if sequence_parallel else [])]
    run_command(accelerate_command("my_utils.workflows.tensor_parallel", args, num_processes=2), env=subprocess_env)
    run = load_run(out)
    s = run["summary"]
    assert run["run"]["status"] == "complete" and s["world_sizes_seen"] == [2, 2]
    assert s["mode"] == ("tp+sp" if sequence_parallel else "tp")
    assert s["loss"] == pytest.approx(s["reference_loss"], abs=1e-5)
    assert s["grad_rel_diff"] < 1e-5 and s["param_max_diff"] < 1e-6
    assert s["collectives"] == s["collectives_expected"]
    assert s["parameters_local"] == [s["parameters_formula"]] * 2
    assert s["parameters_formula"] < 0.55 * s["total_parameters"]
    assert s["layer0_shapes"]["self_attn.q_proj.weight"] == [s["full_shapes"]["q_proj"][0] // 2,
                                                             s["full_shapes"]["q_proj"][1]]
    assert s["layer0_shapes"]["mlp.down_proj.weight"] == [s["full_shapes"]["down_proj"][0],
                                                          s["full_shapes"]["down_proj"][1] // 2]
    assert max(s["saved_activation_bytes"]) < s["saved_activation_bytes_whole"]
    assert s["train_loss_final"] < s["train_loss_first"]
