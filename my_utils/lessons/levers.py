"""Lesson 15's plumbing: a preset's LoRA model trained in this process, a few steps at a time, with each lever
(bf16 autocast, activation checkpointing, ``torch.compile``), and what each lever keeps for backward, costs, and
compiles. The lesson shows the lever itself (one line each); the loops that measure it live here."""

from __future__ import annotations

import time

from my_utils.core.adapters import AdapterSpec
from my_utils.core.chunked_loss import use_chunked_loss
from my_utils.core.data import padding_collator
from my_utils.core.devices import layer_stack, per_rank_device
from my_utils.core.models import add_adapter, build_causal_lm
from my_utils.run.callbacks import SavedActivations


def lora_model(preset, *, seed: int = 0, checkpointing: bool = False, chunked_loss: bool = True):
    """The preset's model with a LoRA adapter (rank 8 on its targets, drawn from ``seed``), in training mode on this
    process's device, with the course's chunked loss (transformers' own with ``chunked_loss=False``: the chunked
    loss swaps the model's forward, which ``torch.compile`` cannot trace); its blocks checkpointed (non-reentrant)
    if asked."""
    import torch

    torch.manual_seed(seed)
    model = build_causal_lm(preset)
    model.config.use_cache = False  # training needs no cache, which would keep a copy of every key and value
    if checkpointing:  # lever 2; reentrant checkpointing over a frozen base trains nothing (lesson 12)
        model.activation_checkpointing_enable({"use_reentrant": False})
    model = add_adapter(model, AdapterSpec().resolved(preset.lora_targets))
    if chunked_loss:
        use_chunked_loss(model)
    return model.to(per_rank_device()).train()


def batches(examples: list[dict], tokenizer, size: int, *, pad_to: int | None = None, seed: int = 0) -> list[dict]:
    """``examples`` (tokenized) in an order drawn from ``seed``, in batches of ``size`` on this process's device,
    each padded to its own longest example or, given ``pad_to``, to that many tokens."""
    import torch

    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    collate = padding_collator(tokenizer, pad_to=pad_to)
    device = per_rank_device()
    return [{k: v.to(device) for k, v in collate([examples[i] for i in order[start:start + size]]).items()}
            for start in range(0, len(order) - size + 1, size)]


def autocast(bf16: bool):
    """bf16 autocast on this process's device when ``bf16`` (lever 1), else nothing: the weights stay float32."""
    import torch

    return torch.autocast(per_rank_device().split(":")[0], dtype=torch.bfloat16, enabled=bf16)


def train(model, steps: list[dict], *, bf16: bool = False, forward=None, lr: float = 1e-3) -> dict:
    """One AdamW step on each batch of ``steps`` through ``forward`` (default: ``model``; a compiled model, say):
    the losses, and each step's wall-clock seconds."""
    import torch

    forward = model if forward is None else forward  # a compiled module has no truth value
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses, seconds = [], []
    for batch in steps:
        started = time.perf_counter()
        with autocast(bf16):
            loss = forward(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the step, on a GPU too
        seconds.append(time.perf_counter() - started)
    return {"losses": losses, "seconds": seconds}


def saved_bytes(model, batch: dict, *, bf16: bool = False) -> int:
    """The bytes autograd keeps for backward in one forward pass of ``batch`` (``SavedActivations``), gradients
    cleared afterwards."""
    with autocast(bf16), SavedActivations(model) as saved:
        loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return saved.bytes


def block_forwards(model, batch: dict) -> int:
    """How many times the blocks' computation runs in one training step on ``batch``: once per block, and once more
    for each block that activation checkpointing recomputes during backward. Counted at each block's first layer:
    transformers checkpoints a block's ``forward``, inside the block's own hooks, which so run once."""
    calls = []
    _, blocks = layer_stack(model)
    hooks = [next(block.children()).register_forward_hook(lambda *_: calls.append(1)) for block in blocks]
    try:
        model(**batch).loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)
    return len(calls)


def compiled_train(model, steps: list[dict], **train_kwargs) -> dict:
    """``train`` through ``torch.compile(model)`` (Inductor, the default backend), with the number of graphs it
    compiled (``graphs``), counted by torch's own counter."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    result = train(model, steps, forward=torch.compile(model), **train_kwargs)
    return {**result, "graphs": counters["stats"]["unique_graphs"]}


def graphs_compiled(model, steps: list[dict], *, mark_dynamic: bool = False) -> int:
    """How many graphs ``torch.compile`` builds for ``model``'s forward over ``steps``: each new shape it cannot
    reuse a graph for is one more. The ``aot_eager`` backend traces as inductor does (same graphs, same guards, same
    recompiles) but generates no code, so counting costs seconds. ``mark_dynamic`` marks the sequence dimension as
    varying before the first step, so that one graph serves every length."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    forward = torch.compile(model, backend="aot_eager")
    for batch in steps:
        if mark_dynamic:
            for tensor in batch.values():
                torch._dynamo.mark_dynamic(tensor, 1)
        forward(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return graphs
