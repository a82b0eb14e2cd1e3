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


@pytest.mark.slow
def test_two_d_steps_equal_the_unsplit_model_on_the_whole_batch(tmp_path):
    """dp 2 x tp 2, its ranks simulated in this process (LocalTensor)."""
    from my_utils.run.results import load_run
    from my_utils.workflows import parallel_2d

    for sequence_parallel in (False, True):
        out = tmp_path / f"sp{sequence_parallel}"
        parallel_2d.main(["--dp", "2", "--tp", "2", "--batch-size", "4", "--max-length", "16", "--output-dir", str(out),
                          *(["--sequence-parallel"] if sequence_parallel else [])])
        s = load_run(out)["summary"]
        assert s["simulated_ranks"] == 4 and s["coordinates"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
        # the ranks of one replica share its loss; the mean over replicas is the whole batch's
        losses = s["losses_per_rank"]
        assert losses[0] == losses[1] and losses[2] == losses[3] and losses[0] != losses[2]
        assert s["loss_mean_over_replicas"] == pytest.approx(s["reference_loss"], abs=1e-5)
        assert s["grad_max_diff"] < 1e-5 * s["grad_scale"] and s["param_max_diff"] < 1e-6
        assert s["collectives"]["gradient average"] == {"all_reduce": s["parameters"]}
        assert s["layer0_shapes"]["self_attn.o_proj.weight"] == [192, 96]


@pytest.mark.parametrize("args, message", [
    ({"dp": 4, "tp": 8}, "32 simulated ranks, more than 16"),
    ({"tp": 3}, "attention heads, 4, do not split over 3"),
    ({"dp": 3}, "--batch-size 8 does not split over 3 replicas"),
])
def test_a_2d_mesh_that_does_not_fit_is_refused(args, message):
    from my_utils.workflows.parallel_2d import Config, validate

    with pytest.raises(UserError, match=message):
        validate(Config(**args))


def test_context_parallel_bytes_are_the_rings_arithmetic():
    from my_utils.workflows.context_parallel import Config, ring_bytes

    block = 2 * 4 * 128 * 32 * 4  # batch x heads x (512 / 4 positions) x head_dim x float32
    assert ring_bytes(Config(), 4) == {"forward": 2 * 3 * block, "backward": 2 * 3 * block + 2 * 4 * block}


def test_context_parallel_refuses_a_sequence_that_does_not_split():
    from my_utils.workflows.context_parallel import Config, validate

    with pytest.raises(UserError, match="--seq-len 511 does not split into 2 equal blocks"):
        validate(Config(seq_len=511, num_processes=2))


@pytest.mark.slow
def test_ring_attention_equals_whole_attention_forward_and_backward(tmp_path, subprocess_env):
    from my_utils.run.launch import accelerate_command, run_command
    from my_utils.run.results import load_run

    out = tmp_path / "ring"
    run_command(accelerate_command("my_utils.workflows.context_parallel",
                                   ["--num-processes", 2, "--seq-len", 128, "--output-dir", out], num_processes=2),
                env=subprocess_env)
    s = load_run(out)["summary"]
    assert s["world_sizes_seen"] == [2, 2]
    assert max(s["max_abs_diff"].values()) < 1e-5, s["max_abs_diff"]
    assert set(s["max_abs_diff"]) == {"output", "grad_q", "grad_k", "grad_v"}
    assert s["bytes_sent"] == [s["bytes_expected"]] * 2
    assert s["blocks_computed"] == [1, 2], "causal: the first block attends only to itself"
