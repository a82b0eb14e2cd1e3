"""A diverged run is a failed run: a loss or gradient that is not finite stops training before the optimizer update,
on every rank at the same step, so the weights (and the last checkpoint) stay those of the step before.

Every training loop calls ``check_finite`` between its backward pass and its optimizer update (a Trainer through
``StopNonFinite``); a ``Diverged`` ends the run like any refusal: one sentence, exit code 2, the run marked
failed with the sentence as its error.
"""

from __future__ import annotations

from pathlib import Path

from my_utils import UserError
from my_utils.run.callbacks import Callback
from my_utils.run.results import read_json


class Diverged(UserError):
    """Training reached a loss or gradient that is not finite and was stopped before that step's optimizer update."""


def diverged(folder: str | Path) -> bool:
    """Whether the results folder ``folder`` holds a run that ended ``Diverged`` (run.json's error says so)."""
    try:
        error = read_json(Path(folder) / "run.json").get("error") or ""
    except (OSError, ValueError):
        return False
    return error.startswith(f"{Diverged.__name__}: ")


_KINDS = ("finite", "inf", "nan")  # codes 0, 1, 2: the worst one wins the reduction over ranks


def _kind(tensor):
    """0 for a finite tensor, 1 when it holds an infinity (and no nan), 2 when it holds a nan; a 0-d int tensor."""
    import torch

    return torch.where(torch.isnan(tensor).any(), 2, torch.where(torch.isinf(tensor).any(), 1, 0))


def check_finite(step: int, loss, parameters, learning_rate: float) -> None:
    """Raise ``Diverged`` on every rank when ``loss`` (this rank's, or None where it has none, e.g. a pipeline's
    first stage) or a gradient of ``parameters`` (this rank's shard of it) is not finite on any rank.

    ``loss`` may be a tensor or a number; ``step`` is the optimizer step about to be taken (counted from 1). Every
    rank must call it at every step: the verdict is one reduction (MAX) over two small codes, so all ranks stop at the
    same step, with the same sentence.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.utils import get_total_norm  # the largest magnitude: nan or inf if any element is

    grads = [p.grad for p in parameters if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # a DTensor's shard on this rank
    loss = None if loss is None else torch.as_tensor(loss).detach()
    device = grads[0].device if grads else loss.device if loss is not None else torch.device("cpu")
    codes = torch.stack([_kind(loss).to(device) if loss is not None else torch.tensor(0, device=device),
                         _kind(get_total_norm(grads, float("inf"))) if grads else torch.tensor(0, device=device)])
    codes = codes.to(dtype=torch.int32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # c10d's own function: where a workflow counts its collectives (sharding), this flag is not among them
        dist.distributed_c10d.all_reduce(codes, op=dist.ReduceOp.MAX)
    loss_kind, grad_kind = (_KINDS[c] for c in codes.tolist())
    if loss_kind == grad_kind == "finite":
        return
    what = " and ".join(text for text in (f"the loss is {loss_kind}" if loss_kind != "finite" else "",
                                          f"a gradient is {grad_kind}" if grad_kind != "finite" else "") if text)
    raise Diverged(f"Training diverged at step {step}: {what}, so the step was stopped before its optimizer update "
                   f"(the weights stay as they were before it); lower --learning-rate (now {learning_rate:g}).")


class StopNonFinite(Callback):
    """A Trainer callback that calls ``check_finite`` before every optimizer update, with the step's training loss
    (the sum of its forward passes' losses, kept by a hook on the model) and the model's gradients."""

    loss = None
    hook = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.hook = model.register_forward_hook(self.keep_loss)

    def keep_loss(self, module, inputs, output):
        loss = getattr(output, "loss", None)
        if module.training and loss is not None:
            self.loss = loss.detach() if self.loss is None else self.loss + loss.detach()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        loss, self.loss = self.loss, None
        try:
            check_finite(state.global_step + 1, loss, model.parameters(), args.learning_rate)
        except Diverged:  # training ends here: the model keeps no hook of a finished Trainer
            self.hook.remove()
            raise

    def on_train_end(self, args, state, control, **kwargs):
        self.hook.remove()
