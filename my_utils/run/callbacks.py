"""Trainer callbacks and hooks: per-rank memory (gathered to rank 0) with a breakdown into weights,
gradients, optimizer states and activations; metrics written to the results folder; and a collator hook that
counts tokens and shows what each rank trains on.

The callbacks follow the Trainer's protocol without subclassing ``transformers.TrainerCallback`` (``Callback``),
so that importing this module does not import the Trainer.

    memory_cb, metrics_cb = make_callbacks(run, device)
    collator = TokenCounter(padding_collator(tokenizer), tokenizer=tokenizer, preview_batches=1)
    Trainer(..., data_collator=collator, callbacks=[memory_cb, metrics_cb])
    memory_cb.report        # on process 0: one entry per process, with its snapshots and breakdown
"""

from __future__ import annotations

import time

from my_utils.core.memory import peak_bytes, reset_peak, snapshot
from my_utils.core.models import weights_bytes
from my_utils.core.printing import get_rank, get_world_size, rank_print


def gather_to_rank0(obj) -> list | None:
    """Collect one picklable object per rank; rank 0 gets the list (ordered by rank), others get None.
    Works without a process group too (returns ``[obj]``). Must be called on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def preview_batch(batch, tokenizer, n_chars: int = 60) -> dict:
    """Print, with the rank prefix, the start of the first example of a batch (each rank sees other data);
    returns what was printed as a record: the process index, batch size, padded length, text, and a fingerprint of
    the whole batch's tokens (two batches whose first examples start alike still differ by it)."""
    import hashlib

    ids = batch["input_ids"][0]
    text = tokenizer.decode(ids[batch["attention_mask"][0].bool()], skip_special_tokens=True)[:n_chars]
    size, length = batch["input_ids"].shape
    rank_print(f"batch of {size} x {length} tokens on rank {get_rank()}/{get_world_size()}: {text!r}")
    fingerprint = hashlib.sha256(batch["input_ids"].cpu().numpy().tobytes()).hexdigest()[:16]
    return {"process": get_rank(), "batch_size": size, "seq_len": length, "text": text, "fingerprint": fingerprint}


class TokenCounter:
    """Wraps a collator: counts the real (non-padding) and padded tokens this rank trains on, and previews
    its first ``preview_batches`` batches (``preview_batch``), keeping the records in ``.previews``."""

    def __init__(self, collator, tokenizer=None, preview_batches: int = 0):
        if preview_batches and tokenizer is None:
            raise ValueError("previewing batches needs the tokenizer to decode them")
        self.collator = collator
        self.tokenizer = tokenizer
        self.preview_batches = preview_batches
        self.previews = []
        self.tokens = 0
        self.padded_tokens = 0

    def __call__(self, features):
        batch = self.collator(features)
        self.tokens += int(batch["attention_mask"].sum())
        self.padded_tokens += batch["attention_mask"].numel()
        if len(self.previews) < self.preview_batches:
            self.previews.append(preview_batch(batch, self.tokenizer))
        if "position_ids" in batch:  # packed rows (packed_collator): transformers reads positions that restart as
            del batch["attention_mask"]  # one causal mask per example only when no attention mask is given
        return batch


def tensor_bytes(tensors) -> int:
    """Bytes held by the given tensors, as stored."""
    return sum(t.numel() * t.element_size() for t in tensors)


def quantization_constant_bytes(model) -> int:
    """Bytes of bitsandbytes' quantization constants, which live beside the weights rather than in parameters
    or buffers: 4-bit block scales (themselves quantized with double quantization) and 8-bit row scales."""
    tensors = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        while state is not None:  # a 4-bit QuantState, then its nested state2 under double quantization
            tensors += [t for t in (state.absmax, state.code, state.offset) if t is not None]
            state = state.state2
        if getattr(weight, "SCB", None) is not None:
            tensors.append(weight.SCB)
    # a tensor reached twice (a code table shared by layers, a LoRA wrapper's base weight) counts once
    return tensor_bytes({t.data_ptr(): t for t in tensors}.values())


def model_weight_bytes(model) -> int:
    """The weights' footprint: parameters and buffers as stored, plus quantization constants."""
    return weights_bytes(model) + quantization_constant_bytes(model)


def gradient_bytes(model) -> int:
    """Bytes of the gradients the model holds now (between backward and ``zero_grad``)."""
    return tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the optimizer's state tensors (AdamW: two moments per trainable parameter, and a step count)."""
    import torch

    return tensor_bytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def _stored(tensor) -> list:
    """The plain tensors that hold ``tensor``'s data on this process: a wrapper subclass (a DTensor's local shard,
    a pending collective's result) is unwrapped, any other tensor is itself."""
    import torch
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    inner = (getattr(tensor, name) for name in tensor.__tensor_flatten__()[0])
    return [t for x in inner if torch.is_tensor(x) for t in _stored(x)]


class SavedActivations:
    """Counts the bytes autograd keeps for backward (the activations) during one forward pass, parameters
    excluded; each storage counts once, and counting stops when backward starts::

        with SavedActivations(model) as saved:
            loss = model(**batch).loss
        loss.backward(); saved.bytes

    Most tensors are seen as autograd saves them. A custom autograd Function may instead keep a tensor on its
    context (bitsandbytes' 8-bit matmul keeps its input as ``ctx.A``): no hook sees that, so when ``model``'s
    forward returns, the graph it built is walked once for such tensors.
    Inside a (non-reentrant) checkpointed region autograd keeps nothing (it recomputes instead), so nothing
    there is counted.
    """

    def __init__(self, model):
        import torch

        self.model = model
        self.parameter_storages = {t.untyped_storage().data_ptr() for p in model.parameters() for t in _stored(p)}
        self.seen = set()
        self.bytes = 0
        self.backward_started = False
        self.graph_walked = False
        self.active = False
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._forward_hook = None

    def _count(self, tensor):
        for storage in (t.untyped_storage() for t in _stored(tensor)):
            if storage.data_ptr() not in self.seen and storage.data_ptr() not in self.parameter_storages:
                self.seen.add(storage.data_ptr())
                self.bytes += storage.nbytes()

    def _pack(self, tensor):
        if not self.backward_started:
            self._count(tensor)
        return tensor

    def _unpack(self, tensor):
        self.backward_started = True
        return tensor

    def _walk_graph(self, module, args, output):
        """Count the tensors custom Functions of the graph behind ``output`` keep on their contexts."""
        import torch

        if self.backward_started or self.graph_walked:
            return
        self.graph_walked = True
        values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) \
            else (output,)
        todo, visited = [v.grad_fn for v in values if torch.is_tensor(v) and v.grad_fn is not None], set()
        while todo:
            node = todo.pop()
            if node is None or node in visited:
                continue
            visited.add(node)
            if isinstance(node, torch.autograd.function.BackwardCFunction):  # the node is the Function's ctx
                for value in vars(node).values():
                    for t in value if isinstance(value, (tuple, list)) else (value,):
                        if torch.is_tensor(t):
                            self._count(t)
            todo += [child for child, _ in node.next_functions]

    def start(self):
        self._hooks.__enter__()
        self._forward_hook = self.model.register_forward_hook(self._walk_graph)
        self.active = True
        return self

    def stop(self):
        if self.active:
            self._hooks.__exit__(None, None, None)
            self._forward_hook.remove()
            self.active = False

    __enter__ = start

    def __exit__(self, *exc):
        self.stop()


def memory_breakdown(weights: int, gradients: int, optimizer_states: int, begin: dict, end: dict,
                     saved_activations: int | None = None) -> dict:
    """Split a training peak (bytes) into weights, gradients, optimizer states, the activations autograd saved, and
    the rest of the peak.

    Weights, gradients and optimizer states are measured from their tensors, and ``saved_activations`` (from
    ``SavedActivations``) is what autograd kept for the backward pass of the first step: the course's one
    activations figure. ``rest_of_peak`` is what the peak adds beyond the state: the growth of memory in use from the
    start of training (weights already loaded) to the peak, minus the gradients and optimizer states created
    meanwhile, so the saved activations plus the backward pass's temporaries and (on a CPU) the allocator's slack.
    On a CUDA device "in use" is allocated memory; on a CPU, the process RSS.
    """
    in_use_at_begin = begin["allocated"] if begin.get("allocated") is not None else begin["rss"]
    peak = peak_bytes(end)
    return {
        "weights": weights,
        "gradients": gradients,
        "optimizer_states": optimizer_states,
        "rest_of_peak": max(0, peak - in_use_at_begin - gradients - optimizer_states),
        "saved_activations": saved_activations,
        "peak": peak,
    }


class Callback:
    """A Trainer callback by the Trainer's own protocol (it calls ``callback.on_<event>(args, state, control,
    **kwargs)`` for every event) without transformers' ``TrainerCallback`` base, whose import pulls in peft and
    bitsandbytes: an event a subclass does not define does nothing."""

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


class MemoryCallback(Callback):
    """Resets the peak counters when training begins and snapshots memory (allocated, reserved, peak, process RSS)
    then, after the first optimizer step and at the end, on every process; during the first step it also measures
    the activations saved for backward, the gradients and the optimizer states, from their tensors. At the end each
    process's figures, with their ``memory_breakdown`` and the CPU seconds it spent training (``cpu_s``), are
    gathered to process 0: ``.report``, a list ordered by process index (None on the others)."""

    def __init__(self, device="cpu"):
        self.device = device
        self.begin = self.first_step = self.report = self.saved = None
        self.gradients = self.optimizer_states = 0

    def on_train_begin(self, args, state, control, **kwargs):
        reset_peak(self.device)
        self.begin = snapshot(self.device)
        self.cpu_started = time.process_time()

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.saved is None:
            self.saved = SavedActivations(model).start()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.saved is not None:
            self.saved.stop()

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        # After the step and before zero_grad: gradients are still there and the states exist.
        if self.first_step is None:
            self.gradients = gradient_bytes(model)
            self.optimizer_states = optimizer_state_bytes(optimizer)

    def on_step_end(self, args, state, control, **kwargs):
        if self.first_step is None:
            self.first_step = snapshot(self.device)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.saved is not None:
            self.saved.stop()
        end = snapshot(self.device)
        mine = {
            "process": get_rank(),
            # CPU seconds of this process (all its threads) while training: on a shared machine they tell the
            # work done apart from time spent waiting for a core, so speedups estimated from them are steadier.
            "cpu_s": time.process_time() - self.cpu_started,
            "begin": self.begin,
            "first_step": self.first_step,
            "end": end,
            "breakdown": memory_breakdown(model_weight_bytes(model), self.gradients, self.optimizer_states,
                                          self.begin, end, self.saved and self.saved.bytes),
        }
        self.report = gather_to_rank0(mine)


class MetricsWriter(Callback):
    """Appends each log of the Trainer (loss, learning rate, grad norm...) to ``run``'s metrics.jsonl, on process
    0."""

    def __init__(self, run):
        self.run = run

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self.run.log_metrics({"step": state.global_step, "epoch": state.epoch, "time": time.time(), **logs})


def make_callbacks(run=None, device="cpu"):
    """The course's callbacks: (MemoryCallback, MetricsWriter or None without a ``run``)."""
    return MemoryCallback(device), (MetricsWriter(run) if run is not None else None)
