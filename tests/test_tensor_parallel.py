"""Megatron-style tensor parallel, ring attention and the 2D mesh: the arithmetic they are held to, the plan's
coverage, a tied embedding, bad degrees refused before any process group starts. Lesson 09's closing checks hold
the untied runs (tensor and sequence parallel, ring attention, dp x tp) to the unsplit model."""

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

    from my_utils.core.splits import TINY_LLAMA
    from my_utils.workflows.tensor_parallel import megatron_plan

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


TIED_CHECK = """
import json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig, AutoModelForCausalLM
from my_utils.core.splits import TINY_LLAMA
from my_utils.workflows.tensor_parallel import Config, expected_collectives, one_step_check

dist.init_process_group("gloo")
config = AutoConfig.from_pretrained(TINY_LLAMA)
config.tie_word_embeddings = True  # as SmolLM2's: one weight for the embedding and the output layer
results = {}
for sequence_parallel in (False, True):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    batch = torch.randint(3, config.vocab_size, (2, 16))
    check = one_step_check(model, init_device_mesh("cpu", (2,)), batch, Config(sequence_parallel=sequence_parallel))
    check["expected"] = expected_collectives(config.num_hidden_layers, sequence_parallel, tied=True)
    check["tied_still"] = model.lm_head.weight is model.model.embed_tokens.weight
    results[str(sequence_parallel)] = check
if dist.get_rank() == 0:
    print("RESULTS " + json.dumps(results))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_tied_embedding_stays_whole_and_the_step_still_equals_the_unsplit_models(tmp_path, subprocess_env):
    """SmolLM2's case (the lesson's tiny Llama is untied): the plan keeps a tied embedding and output layer whole."""
    import json
    import subprocess
    import sys

    script = tmp_path / "tied.py"
    script.write_text(TIED_CHECK)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
                          env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    for sequence_parallel, check in json.loads(line.removeprefix("RESULTS ")).items():
        assert check["tied_still"], sequence_parallel
        assert check["loss"] == pytest.approx(check["reference_loss"], abs=1e-5)
        assert check["grad_rel_diff"] < 1e-5 and check["param_max_diff"] < 1e-6
        assert check["collectives"] == check["expected"], (sequence_parallel, check["collectives"])


@pytest.mark.slow
def test_two_d_steps_equal_the_unsplit_model_on_the_whole_batch(tmp_path):
    """dp 2 x tp 2, its ranks simulated in this process (LocalTensor)."""
    from my_utils.run.results import load_run
    from my_utils.workflows import parallel_2d

    for sequence_parallel in (False, True):
        out = tmp_path / f"sp{sequence_parallel}"
        parallel_2d.main(["--dp", "2", "--tp", "2", "--global-batch-size", "4", "--max-length", "16", "--output-dir", str(out),
                          *(["--sequence-parallel"] if sequence_parallel else [])])
        s = load_run(out)["summary"]
        assert s["simulated_ranks"] == 4 and s["coordinates"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
        # the ranks of one replica share its loss; the mean over replicas is the whole batch's
        losses = s["losses_per_rank"]
        assert losses[0] == losses[1] and losses[2] == losses[3] and losses[0] != losses[2]
        assert s["loss_mean_over_replicas"] == pytest.approx(s["reference_loss"], abs=1e-5)
        assert s["grad_max_diff"] < 1e-5 * s["grad_scale"] and s["param_max_diff"] < 1e-6
        assert s["tolerances"] == {"grad_max_diff": 1e-5 * s["grad_scale"], "param_max_diff": 1e-6}
        assert s["collectives"]["gradient average"] == {"all_reduce": s["parameters"]}
        assert s["layer0_shapes"]["self_attn.o_proj.weight"] == [192, 96]


@pytest.mark.parametrize("args, message", [
    ({"dp": 4, "tp": 8}, "32 simulated ranks, more than 16"),
    ({"tp": 3}, "attention heads, 4, do not split over 3"),
    ({"dp": 3}, "--global-batch-size 8 does not split over 3 replicas"),
])
def test_a_2d_mesh_that_does_not_fit_is_refused(args, message):
    from my_utils.workflows.parallel_2d import Config, validate

    with pytest.raises(UserError, match=message):
        validate(Config(**args))


def test_a_2d_simulation_under_a_launcher_is_refused(monkeypatch):
    from my_utils.workflows.parallel_2d import Config, validate

    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it: every process would simulate the whole mesh
    with pytest.raises(UserError, match="simulates its ranks in one process; run it with python -m"):
        validate(Config())


def test_context_parallel_bytes_are_the_rings_arithmetic():
    from my_utils.workflows.context_parallel import Config, ring_bytes

    block = 2 * 4 * 128 * 32 * 4  # batch x heads x (512 / 4 positions) x head_dim x float32
    assert ring_bytes(Config(), 4) == {"forward": 2 * 3 * block, "backward": 2 * 3 * block + 2 * 4 * block}


def test_context_parallel_refuses_a_sequence_that_does_not_split():
    from my_utils.workflows.context_parallel import Config, validate

    with pytest.raises(UserError, match="--seq-len 511 does not split into 2 equal blocks"):
        validate(Config(seq_len=511, num_processes=2))
    with pytest.raises(UserError, match="could hold 128 GiB of scores at --seq-len 65536"):
        validate(Config(seq_len=65536, num_processes=2))


def test_an_equality_claim_fails_the_run_beyond_its_stated_tolerance():
    import math

    from my_utils import JobFailed
    from my_utils.core.stats import check_tolerances
    from my_utils.workflows import context_parallel, pipeline_parallel, tensor_parallel

    assert pipeline_parallel.TOLERANCES == {"max_abs_diff": 1e-4, "grad_rel_diff": 1e-5}
    assert tensor_parallel.TOLERANCES == {"grad_rel_diff": 1e-5, "param_max_diff": 1e-6}
    ring = {"max_abs_diff": {"output": 6e-7, "grad_v": 3.8e-6}, "tolerances": context_parallel.TOLERANCES}
    check_tolerances(ring, "Ring attention and whole attention")  # the reference run's differences are equal
    for worst in (2e-5, math.nan):
        with pytest.raises(JobFailed, match=r"^Ring attention and whole attention differ by (2.0e-05|nan) "
                           r"\(max_abs_diff\), over the tolerance 1e-05 that counts as equal;"):
            check_tolerances({**ring, "max_abs_diff": {"output": 6e-7, "grad_v": worst}},
                             "Ring attention and whole attention")


@pytest.mark.slow
@pytest.mark.parametrize("workflow", ["tensor_parallel", "context_parallel", "pipeline_parallel"])
def test_a_workflow_prints_no_warning_or_profiler_line_of_its_own(workflow, tmp_path, subprocess_env):
    """What the course's own code prints under torchrun: the workflow's lines, not a UserWarning from converting a
    tensor that requires grad, nor the profiler's start and stop lines (torchrun's own banner is its launcher's)."""
    import json
    import subprocess
    import sys

    out = tmp_path / workflow
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                           f"my_utils.workflows.{workflow}", "--preset", "tiny", "--output-dir", str(out)],
                          env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "run.json").read_text())["world_size"] == 2
    lines = (proc.stdout + proc.stderr).splitlines()
    course = [line for line in lines if "torch/distributed/run.py" not in line]  # torchrun's OMP_NUM_THREADS banner
    assert not [line for line in course if "Warning" in line or "profiler_st" in line], course
