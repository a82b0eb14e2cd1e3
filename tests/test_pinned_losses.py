"""The tiny model's losses, pinned (as torchtune pins its tiny checkpoints'): a change to the shipped weights, the
data packing, the loss or LoRA's initialisation that moves a number shows here first, not as a lesson's claim
drifting. If a change is meant (the tiny assets rebuilt, say), re-pin these from the failure's message."""

import pytest
import torch

PRETRAINED = 5.817418  # the shipped tiny model on the first 4 packed blocks of 64 tokens
LORA_STEPS = [5.817418, 5.411787, 4.817884]  # LoRA r=8 on its preset targets, seed 0, AdamW at 1e-2, same batch


def test_the_tiny_models_losses_are_pinned():
    from my_utils.core.adapters import AdapterSpec
    from my_utils.core.models import add_adapter, build_causal_lm
    from my_utils.core.presets import get_preset
    from my_utils.core.blocks import block_dataset

    preset = get_preset("tiny")
    blocks = block_dataset(preset, 64)[:4]
    batch = {key: torch.stack([torch.as_tensor(b[key]) for b in blocks]) for key in ("input_ids", "labels")}
    model = build_causal_lm(preset).eval()  # no dropout: the numbers depend on nothing random but the seed below
    with torch.no_grad():
        assert model(**batch).loss.item() == pytest.approx(PRETRAINED, rel=1e-5)
    torch.manual_seed(0)
    lora = add_adapter(model, AdapterSpec(rank=8).resolved(preset.lora_targets))
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in LORA_STEPS:
        loss = lora(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses == pytest.approx(LORA_STEPS, rel=1e-4)
