"""The memory planner: exact parameter counts from the meta device, an activation model that matches what autograd
keeps, and real tiny runs on a CPU whose weights, gradients, optimizer states and saved activations, each measured
from the tensors, are within 15% of the plan (and whose peak, process baseline included, within 25%)."""

import json
import subprocess
import sys

import pytest

from my_utils import UserError
from my_utils.tools import planner
from my_utils.core.adapters import AdapterSpec
from my_utils.core.chunked_loss import CHUNK_BYTES, use_chunked_loss
from my_utils.core.memory import MiB

TINY_TARGETS = ("c_attn", "c_proj", "c_fc")
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora(model, rank, targets, task_type="CAUSAL_LM"):
    """``model`` with peft's LoRA adapters of ``rank`` on ``targets``, as the workflows add them."""
    from my_utils.core.models import add_adapter

    return add_adapter(model, AdapterSpec(rank=rank, targets=tuple(targets)).resolved(targets), task_type=task_type)


@pytest.fixture(scope="module")
def tiny():
    return planner.architecture("tiny")


def test_meta_device_counts_match_the_real_model(tiny):
    from my_utils.core.models import build_causal_lm, count_parameters
    from my_utils.core.presets import get_preset

    model = build_causal_lm(get_preset("tiny"))
    assert tiny.total_params == count_parameters(model)["total"]
    adapted = lora(model, 4, TINY_TARGETS)
    assert planner.lora_parameters(tiny, 4, TINY_TARGETS) == count_parameters(adapted)["trainable"]
    p = planner.plan("tiny", "lora", adapter=AdapterSpec(rank=4, targets=TINY_TARGETS), batch_size=2, max_length=8)
    counts = count_parameters(adapted)
    assert (p.trainable_params, p.total_params) == (counts["trainable"], counts["total"])
    everywhere = lora(build_causal_lm(get_preset("tiny")), 4, ("all-linear",))  # peft picks the layers itself
    assert planner.lora_parameters(tiny, 4, ("all-linear",)) == count_parameters(everywhere)["trainable"]


def saved_activation_bytes(model, batch, seq, vocab, dtype="fp32"):
    """Bytes autograd keeps for backward in one training forward pass, counted as the memory callback counts
    them: a padded batch as dynamic padding makes, no key-value cache (the Trainer trains without one), bf16
    autocast when asked."""
    import torch

    from my_utils.run.callbacks import SavedActivations

    torch.manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq))
    mask = torch.ones_like(ids)
    mask[: batch // 2, -3:] = 0  # padded rows
    model.train()
    with SavedActivations(model) as saved, torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
        model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
    return saved.bytes


def opt_like_config():
    from transformers import AutoConfig

    return AutoConfig.for_model("opt", hidden_size=160, num_hidden_layers=2, ffn_dim=640, num_attention_heads=5,
                                vocab_size=500, word_embed_proj_dim=160, max_position_embeddings=128,
                                do_layer_norm_before=False)


def gpt2_like_config():
    """A small GPT-2 with its dropout (0.1 on the residuals, embeddings and attention weights): on a CPU no fused
    attention kernel takes attention dropout."""
    from transformers import AutoConfig

    return AutoConfig.for_model("gpt2", n_embd=96, n_layer=2, n_head=4, vocab_size=500, n_positions=128)


def llama_like_config():
    """A small Llama (RMSNorm, SwiGLU, grouped-query attention: 6 query heads share 2 key/value heads, tied
    embeddings), every width distinct so that a wrong one shows."""
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", hidden_size=192, num_hidden_layers=2, intermediate_size=512,
                                num_attention_heads=6, num_key_value_heads=2, vocab_size=500,
                                max_position_embeddings=128, tie_word_embeddings=True)


@pytest.mark.parametrize("loss", ["chunked", "plain"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("model_name", ["tiny", "gpt2-like", "opt-like", "llama-like"])
@pytest.mark.parametrize("method", ["full", "lora", "lora-all-linear"])
def test_activation_model_matches_what_autograd_keeps(model_name, method, dtype, loss, tiny):
    """The layer-by-layer rule against the bytes autograd really saves, on a CPU (dropout on where the model has
    it, padded batch): GPT-2's fused attention, and its plain attention where attention dropout is on (float32
    even under autocast), OPT's post-LN blocks, Llama's RMSNorm, gated MLP and grouped-query
    attention; adapters on the attention only (each preset's default) or on every linear layer of the blocks; the
    workflow's chunked loss and the plain one."""
    import torch
    from transformers import AutoModelForCausalLM

    from my_utils.core.models import build_causal_lm, fused_activation
    from my_utils.core.presets import get_preset

    torch.manual_seed(0)
    if model_name == "tiny":
        arch, targets, model = tiny, ("c_attn",), build_causal_lm(get_preset("tiny"))
        every = TINY_TARGETS
    elif model_name == "gpt2-like":
        config = gpt2_like_config()
        arch, targets, model = planner.architecture_from_config(config, model_name), ("c_attn",), \
            fused_activation(AutoModelForCausalLM.from_config(config))
        every = TINY_TARGETS
    else:
        config = opt_like_config() if model_name == "opt-like" else llama_like_config()
        arch, targets, model = planner.architecture_from_config(config, model_name), ("q_proj", "v_proj"), \
            AutoModelForCausalLM.from_config(config)
        every = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2") if model_name == "opt-like" \
            else LLAMA_TARGETS
    if method == "lora-all-linear":
        method, targets = "lora", every
    if method == "lora":
        model = lora(model, 8, targets)
    if loss == "chunked":
        assert use_chunked_loss(model)
    batch, seq = 8, 40
    measured = saved_activation_bytes(model, batch, seq, arch.vocab, dtype)
    p = planner.estimate(arch, method, rank=8, targets=targets, batch=batch, seq=seq, dtype=dtype, device="cpu",
                         chunked_loss=loss == "chunked")
    assert p.saved_activations / measured == pytest.approx(1.0, abs=0.05)


def test_saved_activations_include_tensors_a_custom_function_keeps():
    """bitsandbytes' 8-bit matmul keeps its input on its context, where no saved-tensors hook sees it; the
    counter the runs' breakdowns come from finds it in the graph."""
    import torch

    from my_utils.run.callbacks import SavedActivations

    class KeepsInput(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            ctx.x = x  # kept for backward, but not through save_for_backward
            return x @ weight.t()

        @staticmethod
        def backward(ctx, grad):
            return None, grad.t() @ ctx.x

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3, 5))

        def forward(self, x):
            return KeepsInput.apply(x * 2, self.weight)

    model = Layer()
    with SavedActivations(model) as saved:
        model(torch.randn(4, 5)).sum().backward()
    assert saved.bytes == 4 * 4 * 5  # x * 2, kept on the context


def test_each_part_follows_its_rule(tiny):
    full = planner.plan("tiny", "full", batch_size=4, max_length=32)
    lora = planner.plan("tiny", "lora", batch_size=4, max_length=32)
    qlora = planner.plan("tiny", "qlora", batch_size=4, max_length=32)
    q8 = planner.plan("tiny", "qlora-8bit", batch_size=4, max_length=32)
    assert full.optimizer == 8 * tiny.total_params and full.gradients == 4 * tiny.total_params
    assert lora.optimizer == 8 * lora.trainable_params
    assert lora.weights == 4 * (tiny.total_params + lora.trainable_params)
    quantized = sum(tiny.linears[n][0] * tiny.linears[n][1] for n in tiny.quantizable)
    assert "lm_head" not in tiny.quantizable and len(tiny.quantizable) == 4 * tiny.layers
    tables = planner.NF4_LAYER_BYTES * len(tiny.quantizable)  # each 4-bit layer's code tables
    assert qlora.weights == pytest.approx(quantized * planner.NF4_BYTES + tables + 4 * (tiny.total_params - quantized)
                                          + 4 * qlora.trainable_params)
    # FSDP2 over the 4-bit base shards the parameters; the quantization constants stay whole on every module
    fsdp = planner.plan("tiny", "qlora", batch_size=4, max_length=32, processes=2, zero=3)
    constants = quantized * (planner.NF4_BYTES - 0.5) + tables
    assert fsdp.weights == pytest.approx((qlora.weights - constants) / 2 + constants)
    assert fsdp.gradients == qlora.gradients / 2 and fsdp.optimizer == qlora.optimizer / 2
    assert qlora.method == "qlora-4bit" and q8.method == "qlora-8bit"
    assert qlora.weights < q8.weights < lora.weights
    ddp = planner.plan("tiny", "lora", batch_size=4, max_length=32, processes=2)
    assert ddp.gradients == lora.gradients and ddp.ddp_buckets == lora.gradients and not lora.ddp_buckets
    assert ddp.peak == pytest.approx(lora.peak + lora.gradients)
    assert "DDP gradient buckets" in [part for part, _, _ in ddp.parts()]
    plain = planner.plan("tiny", "lora", batch_size=4, max_length=32, chunked_loss=False)
    checkpointed = planner.plan("tiny", "lora", batch_size=4, max_length=32, gradient_checkpointing=True,
                                chunked_loss=False)
    assert checkpointed.saved_activations < plain.saved_activations
    assert checkpointed.backward_extra > plain.backward_extra  # one layer is recomputed during backward
    # the plain loss: fp32 log-probabilities kept, their gradient and the logits' made in backward
    assert plain.backward_extra == 2 * 4 * 4 * 32 * tiny.vocab
    # the chunked loss keeps the hidden states' gradient instead, and holds one chunk of logits (here the whole
    # batch: 128 tokens of a 1,024-word vocabulary are far below a chunk) and the log-sum-exp's temporary
    tokens = 4 * 32
    assert plain.saved_activations - lora.saved_activations == tokens * 4 * (tiny.vocab - tiny.hidden)
    assert lora.backward_extra == 2 * 4 * tokens * tiny.vocab
    # full fine-tuning's output layer trains: its weight's gradient is kept from forward, its input is not
    full_plain = planner.plan("tiny", "full", batch_size=4, max_length=32, chunked_loss=False)
    assert full.saved_activations - full_plain.saved_activations == \
        tiny.vocab * tiny.hidden * 4 + tokens * tiny.hidden * 4 - tokens * 4 * (tiny.vocab + tiny.hidden)
    gpt2 = planner.plan("gpt2", "lora", batch_size=4, max_length=256)  # gpt2's logits come in chunks of 166 tokens
    assert gpt2.backward_extra == 166 * 50257 * 2 * 4 and 166 == CHUNK_BYTES // (4 * 50257)
    assert planner.plan("tiny", "lora", batch_size=8, max_length=32).activations == pytest.approx(2 * lora.activations, rel=0.01)
    # bf16 autocast computes from the fp32 weights: the same weights, smaller activations
    bf16 = planner.plan("tiny", "lora", batch_size=16, max_length=64, dtype="bf16")
    assert bf16.weights == lora.weights
    assert bf16.saved_activations < planner.plan("tiny", "lora", batch_size=16, max_length=64).saved_activations
    # gpt2 trains with dropout (the tiny model has none): on a CPU its masks are float tensors and attention
    # dropout rules out the fused attention kernel.
    gpt2_cpu = planner.plan("gpt2", "lora", batch_size=4, max_length=32, device="cpu")
    assert gpt2_cpu.activations > planner.plan("gpt2", "lora", batch_size=4, max_length=32).activations


def test_bad_input_is_one_sentence():
    for kwargs, message in [({"method": "dora"}, "Unknown method"), ({"method": "full", "quantize": "4bit"}, "go with"),
                            ({"dtype": "fp16"}, "Unknown dtype"), ({"batch_size": 0}, "positive"),
                            ({"adapter": AdapterSpec(rank=0)}, "rank must be a positive"),
                            ({"adapter": AdapterSpec(targets=("q_proj",))}, "No linear layer"),
                            ({"adapter": AdapterSpec(dora=True)}, "does not model the memory of --dora"),
                            ({"device": "tpu"}, "Unknown device kind"),
                            ({"method": "qlora-8bit", "quantize": "4bit"}, "disagree; give one of them")]:
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


def test_lora_settings_with_full_fine_tuning_are_refused_not_ignored():
    with pytest.raises(UserError, match="--rank sets the LoRA adapter, which --method full has none of"):
        planner.main(["--preset", "tiny", "--method", "full", "--rank", "4"])


def test_command_line_says_whether_it_fits(capsys):
    planner.main(["--preset", "tiny", "--method", "full", "--local-batch-size", "4", "--max-length", "32", "--memory", "100MiB"])
    out = capsys.readouterr().out
    assert "does NOT fit 100MiB" in out  # the CUDA context alone is 600 MiB
    p = planner.main(["--preset", "tiny", "--method", "qlora", "--local-batch-size", "4", "--max-length", "32", "--device", "t4"])
    out = capsys.readouterr().out
    assert "fits T4" in out and "NOT" not in out and p.overhead == planner.CUDA_CONTEXT
    planner.main(["--preset", "tiny", "--local-batch-size", "4", "--max-length", "32", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["peak"] == pytest.approx(data["weights"] + data["gradients"] + data["ddp_buckets"] + data["optimizer"]
                                         + data["saved_activations"] + data["backward_extra"] + data["overhead"])
    assert data["activations"] == pytest.approx(data["saved_activations"] + data["backward_extra"])
    planner.main(["--preset", "tiny", "--local-batch-size", "4", "--max-length", "32", "--processes", "2"])
    out = capsys.readouterr().out
    assert all(part in out for part in ("saved activations", "backward transient", "DDP gradient buckets"))


def test_the_workflows_flag_names_plan_the_same_run():
    """A run's own flags (--mixed-precision, transformers 5's --activation-checkpointing) plan what --dtype and
    --gradient-checkpointing plan."""
    shape = ["--preset", "tiny", "--local-batch-size", "4", "--max-length", "32"]
    for workflow_flags, planner_flags in [(["--mixed-precision", "bf16", "--activation-checkpointing"],
                                           ["--dtype", "bf16", "--gradient-checkpointing"]),
                                          (["--mixed-precision", "no"], ["--dtype", "fp32"])]:
        as_run, as_planned = planner.main([*shape, *workflow_flags]), planner.main([*shape, *planner_flags])
        assert as_run == as_planned and (as_run.dtype, as_run.gradient_checkpointing) == (
            "bf16" if "bf16" in workflow_flags else "fp32", "--activation-checkpointing" in workflow_flags)
    with pytest.raises(SystemExit) as e:
        planner.main([*shape, "--mixed-precision", "fp16"])  # a GPU's precision the planner does not model
    assert e.value.code == 2


def test_a_run_is_planned_from_its_records():
    """The plan for a run comes from what it records: method, quantization, the adapter (run.json's peft config),
    mixed precision, processes, device, and each process's first batch; each measured part is set beside its planned
    one."""
    breakdown = {"weights": 1.0, "gradients": 2.0, "optimizer_states": 3.0, "saved_activations": 4.0}
    adapter = AdapterSpec(rank=4, targets=("c_attn",)).resolved(())
    config = {"method": "lora", "quantize": "8bit", "adapter": adapter.record()}
    summary = {"workflow": "lora", "preset": "tiny", "method": "lora", "world_size": 2,
               "quantization": {"bits": 8}, "mixed_precision": "bf16", "chunked_loss": True,
               "first_batches": [{"batch_size": 8, "seq_len": 40}, {"batch_size": 8, "seq_len": 31}],
               "memory": [{"end": {"device": "cpu"}, "breakdown": breakdown}] * 2}
    run = {"run": {"config": config}, "summary": summary}
    p = planner.plan_for_run(run, process=1)
    assert (p.method, p.rank, p.dtype, p.batch, p.seq, p.processes) == ("qlora-8bit", 4, "bf16", 8, 31, 2)
    assert p == planner.plan("tiny", "qlora", quantize="8bit", adapter=AdapterSpec(rank=4, targets=("c_attn",)),
                             batch_size=8, max_length=31, processes=2, dtype="bf16", device="cpu")
    assert planner.plan_for_run({**run, "summary": {**summary, "chunked_loss": False}}, 1).chunked_loss is False
    rows = planner.compare_with_run(run, process=1)
    assert [r.component for r in rows] == ["weights", "gradients", "optimizer states", "saved activations"]
    assert [r.measured for r in rows] == [1.0, 2.0, 3.0, 4.0]
    assert [r.predicted for r in rows] == [p.weights, p.gradients, p.optimizer, p.saved_activations]
    assert rows[0].ratio == p.weights  # predicted / measured
    full = planner.plan_for_run({"run": {"config": {"method": "full", "quantize": "none", "adapter": None}},
                                 "summary": {**summary, "method": "full", "quantization": None,
                                             "mixed_precision": "no"}})
    assert (full.method, full.dtype, full.seq) == ("full", "fp32", 40)
    old = planner.plan_for_run({"run": {"config": {**config, "adapter": {"rank": 4, "alpha": 8, "targets": ["c_attn"],
                                                                      "dropout": 0.0, "rslora": False,
                                                                      "dora": False}}},
                                "summary": {**summary, "method": "qlora-8bit"}}, 1)  # an older folder's records
    assert old == p
    with pytest.raises(UserError, match="LoRA-workflow run"):
        planner.plan_for_run({"run": {}, "summary": {"workflow": "ddp"}})


@pytest.mark.parametrize("preset, published", [("gpt2", 124_439_808), ("opt-350m", 331_196_416),
                                               ("roberta-large", None), ("smollm2-135m", 134_515_008)])
def test_real_presets_match_peft_on_the_meta_device(preset, published):
    """Built from the shipped config.json on the meta device (no download, no memory), the counts equal what
    peft reports for the same model, and the causal LMs have their published sizes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from my_utils.core.models import count_parameters
    from my_utils.core.presets import get_preset

    p = get_preset(preset)
    causal = p.causal_model is not None
    config = AutoConfig.from_pretrained(p.offline_config["causal" if causal else "classifier"])
    config.num_labels = 2
    with torch.device("meta"):
        model = (AutoModelForCausalLM if causal else AutoModelForSequenceClassification).from_config(config)
        full = count_parameters(model)
        adapted = count_parameters(lora(model, 8, p.lora_targets if causal else p.classifier_lora_targets,
                                        task_type="CAUSAL_LM" if causal else "SEQ_CLS"))
    assert planner.architecture(preset).total_params == full["total"] == (published or full["total"])
    plan = planner.plan(preset, "lora")
    assert (plan.trainable_params, plan.total_params) == (adapted["trainable"], adapted["total"])
    assert planner.plan(preset, "qlora").peak < plan.peak < planner.plan(preset, "full").peak


def test_smollm2_parts_follow_the_llama_layout():
    """SmolLM2-135M as the planner reads it (30 blocks, hidden 576, 9 query and 3 key/value heads of 64, a gated
    MLP of 1536, tied embeddings), and each part of its plans from that layout by hand: the adapters on the
    grouped-query projections, the quantized layers (the blocks' seven projections, not the tied output layer)
    and the layer-by-layer activations."""
    arch = planner.architecture("smollm2-135m")
    assert (arch.model_type, arch.layers, arch.hidden, arch.intermediate, arch.heads, arch.kv_heads, arch.vocab) == \
        ("llama", 30, 576, 1536, 9, 3, 49152)
    assert (arch.norm, arch.norm_first, arch.gated_mlp, arch.extra_norms, arch.fused_qkv) == ("rms", True, True, 1,
                                                                                              False)
    assert arch.total_params == 134_515_008  # the embedding counted once: the output layer shares it
    assert arch.linears["model.layers.0.self_attn.k_proj"][:2] == (576, 192)  # 3 key/value heads x 64
    assert planner.lora_parameters(arch, 8, ("q_proj", "v_proj")) == 30 * 8 * ((576 + 576) + (576 + 192))
    block = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    assert planner.lora_parameters(arch, 8, LLAMA_TARGETS) == 30 * 8 * (2 * 1152 + 2 * 768 + 3 * 2112)
    assert "lm_head" not in arch.quantizable and len(arch.quantizable) == 7 * 30
    quantized = sum(arch.linears[n][0] * arch.linears[n][1] for n in arch.quantizable)
    assert quantized == 30 * block
    qlora = planner.plan("smollm2-135m", "qlora")
    assert qlora.weights == pytest.approx(quantized * planner.NF4_BYTES + planner.NF4_LAYER_BYTES * 7 * 30
                                          + 4 * (arch.total_params - quantized) + 4 * qlora.trainable_params)
    # full fine-tuning in fp32 on a GPU, batch 2 x seq 16, each block by hand
    t, h, f, b, s = 32, 576, 1536, 2, 16
    norm = t * h * 4 + t * 4 + t * h * 4  # input, 1/rms per token, the normalised input (the weight trains)
    attention = 4 * (3 * t * h + t * h) + 4 * b * 9 * s + b * s * s * 4  # q, k, v (repeated), output, lse, mask
    mlp = 4 * 3 * t * f  # gate output, SiLU of it, up output
    projections = 4 * (t * h + t * h + t * f)  # the inputs of q/k/v, of gate/up (shared) and of down
    layer = 2 * norm + attention + mlp + projections
    full = planner.plan("smollm2-135m", "full", batch_size=b, max_length=s, chunked_loss=False)
    edges = norm + t * 49152 * 4 + t * h * 4  # the final norm, the log-probabilities, the output layer's input
    assert full.saved_activations == pytest.approx(30 * layer + edges)
    # the chunked loss: the final norm, the gradients of the hidden states and of the output layer's weight
    chunked = planner.plan("smollm2-135m", "full", batch_size=b, max_length=s)
    assert chunked.saved_activations == pytest.approx(30 * layer + norm + t * h * 4 + 49152 * h * 4)
    assert full.weights == full.gradients == 4 * arch.total_params and full.optimizer == 8 * arch.total_params
    assert all(value > 0 for _, value, _ in full.parts())


def test_an_architecture_the_planner_cannot_model_is_refused_in_one_sentence(monkeypatch):
    """An unknown model type, an unknown activation or an unknown block layout: one sentence, no number."""
    from transformers import AutoConfig

    def refused(config, match):
        with pytest.raises(UserError, match=match) as error:
            planner.architecture_from_config(config, "a model")
        message = str(error.value)
        assert message.startswith("The memory planner cannot model a model") and message.endswith(".")
        assert ". " not in message and "\n" not in message  # one sentence

    refused(AutoConfig.for_model("mistral", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=100), "not 'mistral'")
    refused(AutoConfig.for_model("gpt2", n_embd=64, n_layer=1, n_head=4, vocab_size=100, bos_token_id=0,
                                 eos_token_id=0, activation_function="swish"), "activation 'swish'")
    from my_utils.tools.planner import layout

    monkeypatch.setattr(layout, "MODELLED", (*layout.MODELLED, "gpt_neox"))  # pretend to know it: its layout
    refused(AutoConfig.for_model("gpt_neox", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                                 num_attention_heads=4, vocab_size=100), "linear layers .*query_key_value")


@pytest.fixture(scope="module")
def baselines():
    """The CPU process baseline, measured now on this machine, for unquantized and quantized runs."""
    return {q: planner.measure_baseline_rss(q) for q in ("none", "4bit")}


# Each configuration the lessons train, with the workflow's arguments and the number of processes.
MEASURED_RUNS = {
    "lora-fp32": (["--mixed-precision", "no"], 1),
    "lora-bf16": (["--mixed-precision", "bf16"], 1),
    "full-fp32": (["--method", "full", "--mixed-precision", "no"], 1),
    "full-bf16": (["--method", "full", "--mixed-precision", "bf16"], 1),
    "qlora-4bit": (["--quantize", "4bit"], 1),  # fp32 compute on a CPU
    "qlora-8bit": (["--quantize", "8bit"], 1),
    # bf16 autocast, as on a GPU: the 4-bit layers return their fp32 input's dtype, so the MLP's activations stay fp32
    "qlora-4bit-bf16": (["--quantize", "4bit", "--mixed-precision", "bf16"], 1),
    "lora-ddp-x2": (["--local-batch-size", "8"], 2),  # DDP, the preset's batch of 16 split over two processes
}


@pytest.mark.slow
@pytest.mark.parametrize("name", MEASURED_RUNS)
def test_plan_matches_a_measured_tiny_run_part_by_part(name, baselines, tmp_path, subprocess_env):
    """A fresh process (or two) trains the tiny model for 2 steps; on every rank the weights, gradients,
    optimizer states and saved activations it measured from its tensors are each within 15% of the plan for
    that run. Its peak RSS is within 25% of the plan plus the process baseline (Python, torch and the
    libraries, measured in a fresh process that imported them): RSS also holds temporaries and allocator slack."""
    from my_utils.core.memory import format_bytes, peak_bytes
    from my_utils.core.tables import text_table
    from my_utils.run.launch import accelerate_command
    from my_utils.run.results import load_run

    extra, processes = MEASURED_RUNS[name]
    out = tmp_path / "run"
    args = ["--preset", "tiny", "--max-steps", "2", "--eval-rows", "16", "--skip-generation-eval",
            "--output-dir", str(out), *extra]
    cmd = (accelerate_command("my_utils.workflows.lora", args, num_processes=processes) if processes > 1
           else [sys.executable, "-m", "my_utils.workflows.lora", *args])
    proc = subprocess.run(cmd, env=subprocess_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = load_run(out)
    summary = run["summary"]
    assert len(summary["memory"]) == processes
    for process in range(processes):
        rows = planner.compare_with_run(run, process)
        p = planner.with_runtime(planner.plan_for_run(run, process), "cpu",
                                 baselines["none" if summary["quantization"] is None else "4bit"])
        measured_peak = peak_bytes(summary["memory"][process]["end"])
        print(f"\n{name}, process {process}, {summary['mixed_precision']}, batch {p.batch} x {p.seq}\n" + text_table(
            ["part", "measured", "predicted", "ratio"],
            [[r.component, format_bytes(r.measured), format_bytes(r.predicted), f"{r.ratio:.3f}"] for r in rows]
            + [["peak RSS (baseline included)", format_bytes(measured_peak), format_bytes(p.peak),
                f"{p.peak / measured_peak:.2f}"]]))
        assert p.trainable_params == summary["trainable_params"] and p.processes == processes
        assert all(abs(r.ratio - 1) <= 0.15 for r in rows), rows
        assert 0.75 <= p.peak / measured_peak <= 1.25


def test_largest_batch_is_the_last_that_fits():
    from my_utils.tools.planner import largest_batch, plan, with_runtime

    memory = 3 * 2**30
    batch = largest_batch("gpt2", "lora", memory)
    assert batch > 0
    assert with_runtime(plan("gpt2", "lora", batch_size=batch)).peak <= memory
    assert with_runtime(plan("gpt2", "lora", batch_size=batch + 1)).peak > memory
    assert largest_batch("gpt2", "full", 2**20) == 0  # not even one example in 1 MiB


def test_tensor_parallel_plans_what_each_rank_of_a_split_model_holds():
    """Megatron's plan applied to the tiny Llama on 2 ranks simulated in this process (LocalTensor): each rank holds
    the parameters the planner's tensor_shard counts, tied or not, and splitting adds no parameter."""
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from my_utils.core.presets import get_preset
    from my_utils.workflows.parallel_2d import simulated_world
    from my_utils.core.splits import model_config
    from my_utils.workflows.tensor_parallel import parameter_split, split

    for tied in (False, True):
        config = model_config(get_preset("tiny"))
        config.tie_word_embeddings = tied
        arch = planner.architecture_from_config(config, "tiny llama")
        model = AutoModelForCausalLM.from_config(config)
        simulated_world(2)
        try:
            with LocalTensorMode(2):
                split(model, init_device_mesh("cpu", (2,)), sequence_parallel=False)
                held = parameter_split(model, 2)
        finally:
            dist.destroy_process_group()
        assert arch.tied_embeddings == tied
        assert planner.tensor_shard(arch, 2).total_params == held["local"], (tied, held)
        assert planner.tensor_shard(arch, 1) == arch


def test_pipeline_plans_hold_what_each_schedule_keeps_in_flight():
    """GPipe keeps every micro-batch on every stage, 1F1B S - s: the same micro-batch's activations, more or fewer
    times; the stages' parameters add up to the model's, with the untied output layer counted again."""
    arch = planner.architecture("tiny")
    shape = {"batch": 16, "seq": 64, "device": "cpu", "chunked_loss": False}
    micro = planner.estimate(arch, "full", **{**shape, "batch": 2})
    for schedule, held in (("gpipe", [8, 8, 8, 8]), ("1f1b", [4, 3, 2, 1])):
        stages = [planner.split_estimate(arch, "full", pp=4, microbatches=8, schedule=schedule, stage=s, **shape)
                  for s in range(4)]
        assert [p.in_flight for p in stages] == held
        per_block = micro.saved_in_blocks / arch.layers  # one block each: the blocks' part scales with what is held
        assert [p.saved_in_blocks for p in stages] == pytest.approx([n * per_block for n in held])
        output = arch.linears[arch.output_layer][0] * arch.linears[arch.output_layer][1]
        assert sum(p.total_params for p in stages) == arch.total_params + output * arch.tied_embeddings
        assert planner.split_estimate(arch, "full", pp=4, microbatches=8, schedule=schedule, **shape).peak == max(
            p.peak for p in stages), "the plan is the busiest stage's"


def test_the_planner_plans_the_model_each_split_workflow_trains_and_refuses_what_it_refuses():
    """Tensor parallel splits the tiny Llama (not the tiny GPT-2): the plan holds what each rank of the reference run
    held; a layout a workflow refuses, the planner refuses in the workflow's sentence."""
    from my_utils.run.results import read_json
    from my_utils.core.paths import REPO_ROOT
    from my_utils.workflows import pipeline_parallel, tensor_parallel

    measured = read_json(REPO_ROOT / "runs" / "reference" / "cpu_x2" / "09_tensor_parallel" / "tp" / "summary.json")
    assert planner.plan("tiny", "full", tp=2).total_params == measured["parameters_local"][0] == 1_009_344

    def refusal(call):
        with pytest.raises(UserError) as e:
            call()
        return str(e.value)

    for preset, processes, sequence_parallel, max_length in (("smollm2-135m", 2, False, 64), ("gpt2", 2, False, 64),
                                                             ("tiny", 2, True, 63)):
        said = refusal(lambda: tensor_parallel.validate(tensor_parallel.Config(
            preset=preset, num_processes=processes, sequence_parallel=sequence_parallel, max_length=max_length)))
        assert refusal(lambda: planner.plan(preset, "full", tp=processes, sequence_parallel=sequence_parallel,
                                            max_length=max_length)) == said
    for stages, batch, microbatches, schedule in ((5, 20, 5, "1f1b"), (2, 4, 1, "1f1b"), (2, 10, 4, "gpipe")):
        said = refusal(lambda: pipeline_parallel.validate(pipeline_parallel.Config(
            num_processes=stages, global_batch_size=batch, microbatches=microbatches, schedule=schedule)))
        assert refusal(lambda: planner.plan("tiny", "full", pp=stages, batch_size=batch, microbatches=microbatches,
                                            schedule=schedule)) == said
