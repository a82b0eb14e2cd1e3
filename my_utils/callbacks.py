"""Trainer callbacks: per-rank memory (gathered to rank 0), metrics written to the results folder, and a
preview of what each rank trains on.

``transformers.TrainerCallback`` is imported lazily (see ``make_callbacks``) so that importing this module
does not import the Trainer.
"""

from __future__ import annotations

import time

from my_utils.memory import reset_peak, snapshot
from my_utils.printing import get_rank, get_world_size, rank_print


def gather_to_rank0(obj) -> list | None:
    """Collect one picklable object per rank; rank 0 gets the list (ordered by rank), others get None.
    Works without a process group too (returns ``[obj]``). Must be called on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


class TokenCounter:
    """Wraps a collator and counts the real (non-padding) and padded tokens this rank trains on."""

    def __init__(self, collator):
        self.collator = collator
        self.tokens = 0
        self.padded_tokens = 0

    def __call__(self, features):
        batch = self.collator(features)
        self.tokens += int(batch["attention_mask"].sum())
        self.padded_tokens += batch["attention_mask"].numel()
        return batch


def make_callbacks(run=None, device="cpu", preview_batches: int = 0, tokenizer=None):
    """The course's callbacks: (MemoryCallback, MetricsWriter or None).

    MemoryCallback resets peak counters when training begins, snapshots memory after the first optimizer
    step and at the end on every rank, and gathers the snapshots to rank 0 (``.report``).
    MetricsWriter appends each log (loss, learning rate, grad norm...) to ``run``'s metrics.jsonl on rank 0.
    """
    from transformers import TrainerCallback

    class MemoryCallback(TrainerCallback):
        def __init__(self):
            self.first_step = None
            self.report = None

        def on_train_begin(self, args, state, control, **kwargs):
            reset_peak(device)
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.first_step is None:
                self.first_step = snapshot(device)

        def on_train_end(self, args, state, control, **kwargs):
            mine = {"rank": get_rank(), "first_step": self.first_step, "end": snapshot(device)}
            self.report = gather_to_rank0(mine)

    class MetricsWriter(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs:
                run.log_metrics({"step": state.global_step, "epoch": state.epoch, "time": time.time(), **logs})

    return MemoryCallback(), (MetricsWriter() if run is not None else None)


def preview_batch(batch, tokenizer, n_chars: int = 60) -> None:
    """Print, with the rank prefix, the start of the first example of a batch: each rank sees other data."""
    ids = batch["input_ids"][0]
    text = tokenizer.decode(ids[batch["attention_mask"][0].bool()], skip_special_tokens=True)
    rank_print(f"batch of {len(batch['input_ids'])} on rank {get_rank()}/{get_world_size()}: {text[:n_chars]!r}")
