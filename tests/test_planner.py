"""The memory planner: exact parameter counts from the meta device, an activation model that matches what autograd
keeps, and predictions within 25% of the measured peak of real tiny runs on a CPU."""

import json
import subprocess
import sys

import pytest

from my_utils import UserError, planner
from my_utils.memory import MiB

TINY_TARGETS = ("c_attn", "c_proj", "c_fc")


@pytest.fixture(scope="module")
def tiny():
    return planner.architecture("tiny")


def test_meta_device_counts_match_the_real_model(tiny):
    from my_utils.models import add_lora, build_causal_lm, count_parameters
    from my_utils.presets import get_preset

    model = build_causal_lm(get_preset("tiny"))
    assert tiny.total_params == count_parameters(model)["total"]
    lora = add_lora(model, rank=4, targets=TINY_TARGETS)
    assert planner.lora_parameters(tiny, 4, TINY_TARGETS) == count_parameters(lora)["trainable"]
    p = planner.plan("tiny", "lora", rank=4, targets=TINY_TARGETS, batch=2, seq=8)
    counts = count_parameters(lora)
    assert (p.trainable_params, p.total_params) == (counts["trainable"], counts["total"])


def saved_activation_bytes(model, batch, seq, vocab):
    """Bytes of the tensors autograd keeps for backward in one forward pass (parameters excluded)."""
    import torch

    torch.manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq))
    mask = torch.ones_like(ids)
    mask[: batch // 2, -3:] = 0  # padded rows, as a dynamic-padding batch has
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, attention_mask=mask, labels=ids)
    return sum(storages.values())


def opt_like_config():
    from transformers import AutoConfig

    return AutoConfig.for_model("opt", hidden_size=160, num_hidden_layers=2, ffn_dim=640, num_attention_heads=5,
                                vocab_size=500, word_embed_proj_dim=160, max_position_embeddings=128,
                                do_layer_norm_before=False)


@pytest.mark.parametrize("model_name", ["tiny", "opt-like"])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_activation_model_matches_what_autograd_keeps(model_name, method, tiny):
    """The layer-by-layer rule against the bytes autograd really saves, on a CPU (dropout on, padded batch)."""
    from transformers import AutoModelForCausalLM

    from my_utils.models import add_lora, build_causal_lm
    from my_utils.presets import get_preset

    if model_name == "opt-like":
        config = opt_like_config()
        arch, targets, model = planner.architecture_from_config(config, "opt-like"), ("q_proj", "v_proj"), \
            AutoModelForCausalLM.from_config(config)
    else:
        arch, targets, model = tiny, TINY_TARGETS, build_causal_lm(get_preset("tiny"))
    if method == "lora":
        model = add_lora(model, rank=8, targets=targets)
    batch, seq = 8, 40
    measured = saved_activation_bytes(model, batch, seq, arch.vocab)
    p = planner.estimate(arch, method, rank=8, targets=targets, batch=batch, seq=seq, device="cpu")
    backward_only = 2 * 4 * batch * seq * arch.vocab  # the loss gradients are made in backward, not saved
    assert (p.activations - backward_only) / measured == pytest.approx(1.0, abs=0.05)


def test_each_part_follows_its_rule(tiny):
    full = planner.plan("tiny", "full", batch=4, seq=32)
    lora = planner.plan("tiny", "lora", batch=4, seq=32)
    qlora = planner.plan("tiny", "qlora", batch=4, seq=32)
    q8 = planner.plan("tiny", "qlora-8bit", batch=4, seq=32)
    assert full.optimizer == 8 * tiny.total_params and full.gradients == 4 * tiny.total_params
    assert lora.optimizer == 8 * lora.trainable_params
    assert lora.weights == 4 * (tiny.total_params + lora.trainable_params)
    quantized = sum(tiny.linears[n][0] * tiny.linears[n][1] for n in tiny.quantizable)
    assert "lm_head" not in tiny.quantizable and len(tiny.quantizable) == 4 * tiny.layers
    assert qlora.weights == pytest.approx(quantized * planner.NF4_BYTES + 4 * (tiny.total_params - quantized)
                                          + 4 * qlora.trainable_params)
    assert qlora.method == "qlora-4bit" and q8.method == "qlora-8bit"
    assert qlora.weights < q8.weights < lora.weights
    assert planner.plan("tiny", "lora", batch=4, seq=32, processes=2).gradients == 2 * lora.gradients  # DDP buckets
    checkpointed = planner.plan("tiny", "lora", batch=4, seq=32, gradient_checkpointing=True)
    assert checkpointed.activations < lora.activations
    assert planner.plan("tiny", "lora", batch=8, seq=32).activations == pytest.approx(2 * lora.activations, rel=0.01)
    assert planner.plan("tiny", "lora", batch=4, seq=32, dtype="bf16").activations < lora.activations
    # gpt2 trains with dropout (the tiny model has none): on a CPU its masks are float tensors and attention
    # dropout rules out the fused attention kernel.
    gpt2_cpu = planner.plan("gpt2", "lora", batch=4, seq=32, device="cpu")
    assert gpt2_cpu.activations > planner.plan("gpt2", "lora", batch=4, seq=32).activations


def test_bad_input_is_one_sentence():
    for kwargs, message in [({"method": "dora"}, "Unknown method"), ({"method": "full", "quantize": "4bit"}, "go with"),
                            ({"dtype": "fp16"}, "Unknown dtype"), ({"batch": 0}, "positive"),
                            ({"rank": 0}, "rank must be a positive"), ({"targets": ("q_proj",)}, "No linear layer"),
                            ({"device": "tpu"}, "Unknown device kind")]:
        with pytest.raises(UserError, match=message):
            planner.plan("tiny", **{"method": "lora", **kwargs})
    with pytest.raises(UserError, match="Unknown preset"):
        planner.plan("tinyy")
    with pytest.raises(UserError, match="Unknown device 'K80'"):
        planner.device_memory("K80")
    assert planner.parse_size("24GiB") == 24 * 1024**3 and planner.parse_size("16GB") == 16e9
    assert planner.parse_size("512 MiB") == 512 * MiB and planner.parse_size("1e9") == 1e9
    with pytest.raises(UserError, match="Cannot read the memory size"):
        planner.parse_size("lots")


def test_command_line_says_whether_it_fits(capsys):
    planner.main(["--preset", "tiny", "--method", "full", "--batch", "4", "--seq", "32", "--memory", "100MiB"])
    out = capsys.readouterr().out
    assert "does NOT fit 100MiB" in out  # the CUDA context alone is 600 MiB
    p = planner.main(["--preset", "tiny", "--method", "qlora", "--batch", "4", "--seq", "32", "--device", "t4"])
    out = capsys.readouterr().out
    assert "fits T4" in out and "NOT" not in out and p.overhead == planner.CUDA_CONTEXT
    planner.main(["--preset", "tiny", "--batch", "4", "--seq", "32", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["peak"] == pytest.approx(data["weights"] + data["gradients"] + data["optimizer"]
                                         + data["activations"] + data["overhead"])


@pytest.mark.parametrize("preset, published", [("gpt2", 124_439_808), ("opt-350m", 331_196_416),
                                               ("roberta-large", None)])
def test_real_presets_match_peft_on_the_meta_device(preset, published):
    """Built from the shipped config.json on the meta device (no download, no memory), the counts equal what
    peft reports for the same model, and the causal LMs have their published sizes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from my_utils.models import add_lora, count_parameters
    from my_utils.presets import get_preset

    p = get_preset(preset)
    causal = p.causal_model is not None
    config = AutoConfig.from_pretrained(p.offline_config["causal" if causal else "classifier"])
    config.num_labels = 2
    with torch.device("meta"):
        model = (AutoModelForCausalLM if causal else AutoModelForSequenceClassification).from_config(config)
        full = count_parameters(model)
        lora = count_parameters(add_lora(model, 8, targets=p.lora_targets if causal else p.classifier_lora_targets,
                                         task_type="CAUSAL_LM" if causal else "SEQ_CLS"))
    assert planner.architecture(preset).total_params == full["total"] == (published or full["total"])
    plan = planner.plan(preset, "lora", rank=8)
    assert (plan.trainable_params, plan.total_params) == (lora["trainable"], lora["total"])
    assert planner.plan(preset, "qlora").peak < plan.peak < planner.plan(preset, "full").peak


@pytest.fixture(scope="module")
def baselines():
    """The CPU process baseline, measured now on this machine, for unquantized and quantized runs."""
    return {q: planner.measure_baseline_rss(q) for q in ("none", "4bit")}


@pytest.mark.slow
@pytest.mark.parametrize("method, quantize", [("full", "none"), ("lora", "none"), ("lora", "4bit")])
def test_plan_is_within_25_percent_of_a_measured_tiny_run(method, quantize, baselines, tmp_path, subprocess_env):
    """A fresh process trains the tiny model for 5 steps; its peak RSS against the plan plus the process
    baseline (Python, torch and the libraries, measured in a fresh process that imported them)."""
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "my_utils.workflows.lora", "--preset", "tiny", "--method", method,
                    "--quantize", quantize, "--max-steps", "5", "--skip-generation-eval", "--output-dir", str(out)],
                   env=subprocess_env, check=True, capture_output=True, text=True)
    summary = json.loads((out / "summary.json").read_text())
    p = planner.plan("tiny", method if quantize == "none" else f"qlora-{quantize}",
                     batch=summary["batch_size_per_process"], seq=planner.longest_example("tiny"), device="cpu")
    planner.with_runtime(p, "cpu", baselines[quantize])
    measured = summary["peak_memory_bytes"]
    print(f"\n{p.method}: predicted {p.peak / MiB:.0f} MiB (baseline {p.overhead / MiB:.0f} + tensors "
          f"{(p.peak - p.overhead) / MiB:.0f}), measured {measured / MiB:.0f} MiB, ratio {p.peak / measured:.2f}")
    assert p.trainable_params == summary["trainable_params"]
    assert 0.75 <= p.peak / measured <= 1.25
