"""A causal LM's training loss computed a chunk of tokens at a time, so that the logits are never held whole.

The plain loss projects every token onto the vocabulary at once: batch x tokens x vocabulary logits, upcast to
float32, then their log-softmax and, in backward, their gradient, each as large again. For gpt2 at batch 4 x 256
each of those is 4 x 256 x 50,257 x 4 bytes = 206 MB, as much as LoRA saves by not keeping gradients and AdamW
states. Here each chunk's logits live only while that chunk's loss and gradients are computed, in forward (the
fused linear cross-entropy of Liger-Kernel and Cut Cross-Entropy, in plain torch so that it runs on CPUs too): the
arithmetic is the plain loss's, the backward only scales the gradients kept, and nothing is computed twice.

    from my_utils.core.chunked_loss import use_chunked_loss
    use_chunked_loss(model)   # before or after peft's get_peft_model; training forwards with labels use it

Evaluation (``model.eval()``) and forwards without labels keep the plain path and return logits.
"""

from __future__ import annotations

import functools
import types

CHUNK_BYTES = 32 * 2**20  # float32 logits per chunk: about 170 tokens of gpt2's 50,257-word vocabulary
# Architectures whose logits are the output layer's and nothing more (no soft-capping or scaling after it).
PLAIN_OUTPUT_LAYER = frozenset({"gpt2", "opt", "llama", "mistral", "qwen2", "qwen3", "phi3"})


def linear_cross_entropy(hidden, weight, bias, labels, *, num_items_in_batch=None, shift_labels=None,
                         ignore_index: int = -100, chunk_bytes: int = CHUNK_BYTES):
    """transformers' ``ForCausalLMLoss`` of ``F.linear(hidden, weight, bias)``, without holding those logits:
    labels shifted by one token (or ``shift_labels`` as given), ``ignore_index`` skipped, the sum over tokens
    divided by ``num_items_in_batch`` if given, else by the number of tokens counted (the mean)."""
    import torch
    import torch.nn.functional as F

    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    denominator = (targets != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
    rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    wants = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    return _autograd_function().apply(hidden, weight, bias, targets, torch.as_tensor(denominator), rows,
                                      ignore_index, wants)


def _chunk_loss_and_gradients(hidden, weight, bias, targets, denominator, rows, ignore_index, wants):
    """The loss, and the gradients of hidden, weight and bias that ``wants`` asks for, a chunk of rows at a time.
    The gradient of the loss with respect to a chunk's logits is (softmax - one-hot) / denominator, computed in
    place of the logits. The products run in autocast's precision where it is on, as in the plain forward and
    backward, from one copy of the weight cast once (autocast would cast it again for every product)."""
    import torch
    import torch.nn.functional as F

    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if wants[0] else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants[1] else None
    grad_bias = torch.zeros_like(bias, dtype=torch.float32) if wants[2] else None
    with torch.autocast(device, enabled=False):
        for start in range(0, hidden.shape[0], rows):
            h, t = hidden[start:start + rows].to(dtype), targets[start:start + rows]
            logits = F.linear(h, w, b).float()
            log_total = torch.logsumexp(logits, dim=-1)
            counted = t != ignore_index
            safe = t.masked_fill(~counted, 0)
            total += ((log_total - logits.gather(1, safe[:, None]).squeeze(1)) * counted).sum()
            if not any(wants):
                continue
            grad = logits.sub_(log_total[:, None]).exp_()  # softmax, in place of the logits
            grad[torch.arange(len(t), device=t.device), safe] -= 1
            grad = grad.mul_((counted / denominator)[:, None]).to(dtype)
            if grad_hidden is not None:
                grad_hidden[start:start + rows] = grad @ w
            if grad_weight is not None:
                grad_weight += grad.T @ h
            if grad_bias is not None:
                grad_bias += grad.sum(0)
    return total / denominator, (grad_hidden, grad_weight, grad_bias)


@functools.cache  # defined on first use: torch is imported only then
def _autograd_function():
    import torch

    class LinearCrossEntropy(torch.autograd.Function):
        """Forward computes the loss and its gradients; backward scales them by the incoming gradient."""

        @staticmethod
        def forward(ctx, hidden, weight, bias, targets, denominator, rows, ignore_index, wants):
            loss, grads = _chunk_loss_and_gradients(hidden, weight, bias, targets, denominator, rows, ignore_index,
                                                    wants)
            ctx.save_for_backward(*grads)
            ctx.dtypes = [t.dtype if t is not None else None for t in (hidden, weight, bias)]
            return loss

        @staticmethod
        def backward(ctx, grad_loss):
            # in place: no second copy of the output layer's gradient (a loss scale or an accumulation divisor
            # makes grad_loss other than 1)
            scaled = [None if g is None else g.mul_(grad_loss).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
            return (*scaled, None, None, None, None, None)

    return LinearCrossEntropy


def use_chunked_loss(model) -> bool:
    """Compute ``model``'s training loss with ``linear_cross_entropy`` (a transformers causal LM, or a peft model
    around one); returns whether it does: False where the output layer is not a plain ``nn.Linear`` (a LoRA
    adapter on it, an architecture that scales its logits), and the plain loss stays."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear or base.config.model_type not in PLAIN_OUTPUT_LAYER:
        return False
    if getattr(base, "_forward_with_logits", None) is None:
        base._forward_with_logits = base.forward  # the forward as it was (accelerate's hooks included)
        # bound to the instance: a deep copy of the model calls its own copy
        base.forward = types.MethodType(_forward(type(base).forward), base)
    return True


def _forward(plain_forward):
    """The model's forward, with the chunked loss for training forwards given labels."""

    @functools.wraps(plain_forward)  # the same signature: the Trainer reads the inputs the model takes from it
    def forward(self, *args, labels=None, **kwargs):
        if labels is None or not self.training:
            return self._forward_with_logits(*args, labels=labels, **kwargs)
        head = self.get_output_embeddings()
        replaced = head.__dict__.get("forward")
        head.forward = _unchanged  # the "logits" come out as the hidden states the output layer would project
        try:
            out = self._forward_with_logits(*args, **kwargs)
        finally:
            if replaced is None:
                del head.forward
            else:
                head.forward = replaced
        loss = linear_cross_entropy(out.logits, head.weight, head.bias, labels,
                                    num_items_in_batch=kwargs.get("num_items_in_batch"),
                                    shift_labels=kwargs.get("shift_labels"))
        return type(out)(loss=loss, **{k: v for k, v in out.items() if k not in ("loss", "logits")})

    return forward


def _unchanged(hidden):
    return hidden
