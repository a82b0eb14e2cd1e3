"""The chunked linear cross-entropy: the same loss and gradients as transformers' plain causal-LM loss, for the
bare function and for a model whose forward uses it (full fine-tuning and LoRA, float32 and bf16 autocast), while
evaluation and forwards without labels keep the logits; and GPT-2's activation computed by one kernel."""

import copy

import pytest
import torch

from my_utils.core.adapters import AdapterSpec
from my_utils.core.chunked_loss import linear_cross_entropy, use_chunked_loss
from my_utils.core.models import add_adapter, build_causal_lm
from my_utils.core.presets import get_preset


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_items_in_batch", [None, 20])
def test_loss_and_gradients_equal_the_plain_loss(bias, num_items_in_batch):
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    vocab = 50
    hidden = torch.randn(3, 17, 8, requires_grad=True)
    weight = torch.randn(vocab, 8, requires_grad=True)
    b = torch.randn(vocab, requires_grad=True) if bias else None
    labels = torch.randint(0, vocab, (3, 17))
    labels[0, :5] = -100  # ignored tokens (a prompt, padding)
    inputs = [t for t in (hidden, weight, b) if t is not None]
    plain = ForCausalLMLoss(torch.nn.functional.linear(hidden, weight, b), labels, vocab,
                            num_items_in_batch=num_items_in_batch)
    chunked = linear_cross_entropy(hidden, weight, b, labels, num_items_in_batch=num_items_in_batch,
                                   chunk_bytes=4 * vocab * 7)  # 7 tokens a chunk: 8 chunks, the last one short
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    # a factor on the loss (a loss scale, an accumulation divisor) reaches the gradients kept from forward
    for got, want in zip(torch.autograd.grad(1.7 * chunked, inputs), torch.autograd.grad(1.7 * plain, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _tiny(lora: bool):
    preset = get_preset("tiny")
    torch.manual_seed(0)
    model = build_causal_lm(preset, random_init=True)
    return add_adapter(model, AdapterSpec(rank=8).resolved(preset.lora_targets)) if lora else model


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("bf16", [False, True])
def test_a_model_trains_with_the_same_loss_and_gradients(lora, bf16):
    plain = _tiny(lora)
    chunked = copy.deepcopy(plain)
    assert use_chunked_loss(chunked)
    ids = torch.randint(0, plain.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 50:] = 0  # a padded row
    results = []
    for model in (plain, chunked):
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
        results.append((out, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (plain_out, plain_grads), (chunked_out, chunked_grads) = results
    assert chunked_out.logits is None and plain_out.logits is not None  # the whole logits were never made
    assert chunked_out.loss.item() == pytest.approx(plain_out.loss.item(), rel=1e-6)
    assert chunked_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        # bf16 keeps 8 bits: the chunks' products round apart and add in float32, and a gradient one rounding
        # step apart at the output moves the ones before it by a few steps (a wrong gradient is off by its size)
        tolerance = 2**-6 if bf16 else 1e-6
        assert (chunked_grads[name] - grad).abs().max() <= tolerance * grad.abs().max(), name


def test_evaluation_keeps_the_logits_and_a_copy_runs_its_own_weights():
    model = _tiny(lora=True)
    use_chunked_loss(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
        assert out.logits.shape == (2, 16, model.config.vocab_size) and out.loss is not None
        copied = copy.deepcopy(model)
        for p in copied.parameters():
            p.zero_()
        assert copied(input_ids=ids).logits.abs().max() == 0  # not the original's forward
        assert torch.equal(model(input_ids=ids).logits, out.logits)


def test_an_adapted_output_layer_keeps_the_plain_loss():
    preset = get_preset("tiny")
    model = add_adapter(build_causal_lm(preset, random_init=True), AdapterSpec(rank=4).resolved(("c_attn", "lm_head")))
    assert use_chunked_loss(model) is False
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    out = model(input_ids=ids, labels=ids)
    # the plain loss: the mean cross entropy of each token's logits against the next token
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(out.loss, expected)


def test_gpt2_activation_is_one_kernel_and_the_same_function():
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.activations import ACT2CLS

    preset = get_preset("tiny")
    model = build_causal_lm(preset, random_init=True)
    kinds = {type(m) for m in model.modules()}
    assert ACT2CLS["gelu_pytorch_tanh"] in kinds and ACT2CLS["gelu_new"] not in kinds
    stock = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(preset.offline_config["causal"]))
    stock.load_state_dict(model.state_dict())
    assert ACT2CLS["gelu_new"] in {type(m) for m in stock.modules()}
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_loss_matches_and_the_planner_holds_against_cudas_counters(monkeypatch):
    """CUDA's kernels give the same loss and gradients; one gpt2 step's tensors, with the chunked loss and
    without, are each within 15% of the plan, and chunking lowers the peak torch.cuda.max_memory_allocated saw."""
    from my_utils.tools.bench.memory import measured_step, planner_ratios

    plain = _tiny(lora=True).cuda()
    chunked = copy.deepcopy(plain)
    use_chunked_loss(chunked)
    ids = torch.randint(0, plain.config.vocab_size, (4, 64), device="cuda")
    losses = []
    for model in (plain, chunked):
        model.train()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    steps = {chunk: measured_step("gpt2", "lora", 4, 256, False, chunked_loss=chunk) for chunk in (True, False)}
    for step in steps.values():
        assert step["peak_what"] == "peak allocated"
        assert all(abs(r - 1) <= 0.15 for r in planner_ratios(step).values()), planner_ratios(step)
    assert steps[True]["peak_bytes"] < steps[False]["peak_bytes"]
