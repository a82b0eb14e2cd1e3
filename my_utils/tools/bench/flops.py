"""Model FLOPs: what a training step of a model must compute, per token, whatever the hardware does with it (the
numerator of MFU; ``mfu.py`` measures the denominator).

Per token of a sequence of length s, with N the weights of every matrix multiplication (linear layers and the output
layer; embedding lookups cost nothing), N_a the LoRA adapters' weights (A and B), L layers of width d:

    forward                    2 N (+ 2 N_a)     a multiply and an add per weight
    backward, input gradients  2 N (+ 2 N_a)     needed by every trainable weight below
    backward, weight gradients 2 N  for full fine-tuning; 2 N_a only for LoRA (the base weights are frozen)
    attention (no weights)     12 L d s          QK^T and AV: 4 L d s forward, twice that backward (PaLM's count,
                                                 no discount for the causal mask)

so full fine-tuning is 6 N + 12 L d s and LoRA 4 N + 6 N_a + 12 L d s; counting LoRA as 6 N adds 2 N that never
run. Autograd also skips the input gradient of the lowest adapted layer when nothing below it trains; that is
under 1/L of N and is not subtracted.
"""

from __future__ import annotations


def model_flops_per_token(model, seq_len: int, method: str) -> dict:
    """Training FLOPs per token (see the module's docstring): full 6 N + 12 L d s, LoRA 4 N + 6 N_a + 12 L d s."""
    n, n_adapters = matmul_weights(model)
    config = model.config
    attention = 12 * config.num_hidden_layers * config.hidden_size * seq_len
    if method == "full":
        per_token = 6 * n + attention
    else:
        per_token = 4 * n + 6 * n_adapters + attention
    return {"matmul_weights": n, "adapter_weights": n_adapters, "flops_per_token": per_token,
            "flops_per_token_as_6n": 6 * (n + n_adapters) + attention}


def matmul_weights(model) -> tuple[int, int]:
    """(N, N_a): weights of the matrix multiplications a token goes through (linear layers, GPT-2's Conv1D, the
    output layer, counted once even when tied to the embedding), and those of LoRA adapters among them."""
    import torch
    from transformers.pytorch_utils import Conv1D

    n = n_adapters = 0
    seen = set()
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.Linear, Conv1D)) or id(module.weight) in seen:
            continue
        seen.add(id(module.weight))
        if ".lora_A." in name or ".lora_B." in name:
            n_adapters += module.weight.numel()
        else:
            n += module.weight.numel()
    return n, n_adapters
