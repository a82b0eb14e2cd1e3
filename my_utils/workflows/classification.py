"""Sentence classification with full fine-tuning or LoRA, on one device, data parallel (DDP) or pipeline parallel.

    python -m my_utils.workflows.classification --preset tiny --method lora                 # one process
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.classification \\
        --preset tiny --method full --parallel ddp --local-batch-size 8                     # 2 processes, DDP
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.classification \\
        --preset tiny --method lora --parallel pipeline                                     # 2 pipeline stages
    accelerate launch --config_file configs/multi_gpu.yaml -m my_utils.workflows.classification \\
        --preset roberta-large --method full --parallel ddp                                 # GPUs

``--local-batch-size`` is what one model replica takes per step: one DDP process (the global batch is local x
processes), or the whole 2-stage pipeline (one replica, its batch cut into ``--microbatches``). Given the same
global batch, the three ways to run do the same arithmetic: the same global batches in the same order, the same
initial weights, and dropout off, so they differ only in how the work and the memory are spread. Every run writes a
results folder: best and final eval accuracy, the accuracy curve, training time, samples/s, peak memory on every
process, trainable parameters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar
from typing import NamedTuple

from my_utils import UserError
from my_utils.core.adapters import AdapterSpec
from my_utils.core.data import check_enough_rows, load_classification
from my_utils.core.devices import per_rank_device
from my_utils.core.evaluation import accuracy
from my_utils.core.memory import peak_bytes, reset_peak, snapshot
from my_utils.core.models import add_adapter, build_classifier, count_parameters, load_tokenizer
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.pipeline import make_schedule, pipeline_stage
from my_utils.core.printing import print0
from my_utils.run.callbacks import gradient_bytes, memory_breakdown, model_weight_bytes, optimizer_state_bytes
from my_utils.run.cli import command_line
from my_utils.run.config import LocalBatchSettings, check_choice, check_positive, setting
from my_utils.run.divergence import check_finite
from my_utils.run.launch import is_cpu_only
from my_utils.run.lifecycle import join_world, process_group_backend, run_lifecycle
from my_utils.workflows.pipeline_parallel import disable_dropout

METHODS = ("full", "lora")
PARALLEL = ("none", "ddp", "pipeline")


DESCRIPTION = ("Full fine-tuning or LoRA of a sentence classifier, on one process, with DDP or as a 2-stage pipeline. "
               "Launch DDP and pipeline runs with `ACCELERATE_USE_CPU=1 accelerate launch --config_file "
               "configs/cpu_x2.yaml -m my_utils.workflows.classification ...`. Writes a results folder and prints its "
               "summary.")


@dataclass
class Config(LocalBatchSettings):
    SETTING_HELP: ClassVar[dict] = {
        "local_batch_size": "examples per model replica per step: a DDP process, or the whole pipeline (one replica) "
                            "(default: the preset's batch, shared by the DDP processes)",
        "learning_rate": "peak rate, decaying linearly to zero (default: the preset's classifier rate for the method)",
        "max_length": "tokens per sentence (default: the longest sentence, at most the preset's max_length)"}
    method: str = setting("lora", "full (every weight trains) or lora (adapters on the preset's classifier targets)",
                          choices=METHODS)
    parallel: str = setting("none", "none (one process), ddp (a whole copy per process) or pipeline (one stage per "
                            "process)", choices=PARALLEL)
    adapter: AdapterSpec = setting(AdapterSpec, "the LoRA adapter (--method lora); default targets: the preset's "
                                   "classifier_lora_targets")
    ROLE: ClassVar[str] = "classifier"
    microbatches: int = setting(4, "micro-batches per step (pipeline)")
    eval_rows: int = setting(300, "held-out rows scored for accuracy")
    eval_steps: int = setting(20, "steps between accuracy evaluations")


def validate(cfg: Config):
    """Check the config before anything starts; returns the preset."""
    preset = cfg.check_common()
    preset.require("classifier")
    check_choice("method", cfg.method, METHODS)
    check_choice("parallel mode", cfg.parallel, PARALLEL)
    if cfg.method == "lora":
        cfg.adapter.check_lora_only("classification")
    for name in ("microbatches", "eval_rows", "eval_steps"):
        check_positive(f"--{name.replace('_', '-')}", getattr(cfg, name))
    return preset


class Sentences(NamedTuple):
    tokenizer: object
    train: list[dict]
    eval: list[dict]
    labels: list[str]


def load_sentences(cfg: Config, preset) -> Sentences:
    """The classifier's tokenizer, the training and held-out rows (``text``, ``label``) and the label names."""
    train_rows, eval_rows, labels = load_classification(preset.classification_data, eval_rows=cfg.eval_rows,
                                                        seed=cfg.seed)
    return Sentences(load_tokenizer(preset, role="classifier"), train_rows, eval_rows, labels)


def global_batch(cfg: Config, world_size: int) -> int:
    """Examples per optimizer step over all processes: DDP has one model replica per process, a pipeline one."""
    return cfg.global_batch(world_size if cfg.parallel == "ddp" else 1)


def whole_batches(rows: list, batch: int) -> list:
    """The rows that fill whole batches: every mode scores these."""
    return rows[: len(rows) // batch * batch]


def check_world(cfg: Config, world_size: int) -> None:
    """The processes launched fit the parallel mode."""
    if cfg.parallel == "none" and world_size != 1:
        raise UserError(f"--parallel none runs on one process but {world_size} were launched; "
                        "use --parallel ddp or pipeline, or launch one process.")
    if cfg.parallel != "none" and world_size < 2:
        raise UserError(f"--parallel {cfg.parallel} needs 2 or more processes; launch with accelerate launch "
                        "--config_file configs/cpu_x2.yaml (or torchrun --nproc_per_node 2).")


def resolve(cfg: Config, preset, world_size: int, sentences: Sentences) -> Config:
    """Every default settled, as run.json records it: the batch size, the learning rate, the steps, the sentence
    length (the longest sentence, at most the preset's) and the adapter; refuses what cannot split evenly."""
    check_world(cfg, world_size)
    replicas = world_size if cfg.parallel == "ddp" else 1
    if cfg.local_batch_size is None and preset.batch_size % replicas:
        raise UserError(f"The preset's batch of {preset.batch_size} does not split over {replicas} processes; "
                        "give --local-batch-size (examples per process).")
    cfg = replace(cfg, local_batch_size=cfg.local_batch_size or preset.batch_size // replicas, num_processes=world_size)
    if cfg.parallel == "pipeline" and cfg.local_batch_size % cfg.microbatches:
        raise UserError(f"A batch of {cfg.local_batch_size} does not split into {cfg.microbatches} equal "
                        "micro-batches; choose a --local-batch-size that is a multiple of --microbatches.")
    batch = global_batch(cfg, world_size)
    check_enough_rows(len(sentences.train), batch)
    scored = whole_batches(sentences.eval, batch)
    if not scored:
        raise UserError(f"Fewer eval rows than one batch of {batch}; raise --eval-rows or lower --local-batch-size.")
    longest = max(len(sentences.tokenizer(r["text"])["input_ids"]) for r in sentences.train + scored)
    settled = cfg.settled(preset, cfg.method)
    return replace(cfg, max_steps=settled["max_steps"], max_length=min(longest, settled["max_length"]),
                   learning_rate=settled["learning_rate"],
                   adapter=cfg.adapter.resolved(preset.classifier_lora_targets))


def encode(rows, tokenizer, length: int) -> dict:
    """Token ids, attention masks and labels of ``rows``, every sentence padded (or cut) to ``length`` tokens:
    a traced pipeline needs one fixed shape, and the other modes use the same so that all do the same work."""
    import torch

    enc = tokenizer([r["text"] for r in rows], padding="max_length", truncation=True, max_length=length,
                    return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "labels": torch.tensor([r["label"] for r in rows])}


def global_batches(n_rows: int, batch_size: int, steps: int, seed: int) -> list:
    """``steps`` batches of row indices, from reshuffled epochs: the same sequence in every parallel mode."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    order, batches = torch.empty(0, dtype=torch.long), []
    for _ in range(steps):
        if len(order) < batch_size:
            order = torch.cat([order, torch.randperm(n_rows, generator=generator)])
        batches.append(order[:batch_size])
        order = order[batch_size:]
    return batches


def _logits(output):
    """The traced classifier returns its logits, alone or first in a tuple."""
    return output[0] if isinstance(output, (tuple, list)) else output


class Replicated:
    """One device, or DDP: every process holds the whole model and computes its own slice of each global batch."""

    def __init__(self, model, cfg: Config, world_size: int, rank: int, device: str, eval_set: dict):
        from accelerate import Accelerator

        self.device, self.eval_set, self.eval_batch = device, eval_set, global_batch(cfg, world_size)
        self.last = 0  # the process that reports losses and accuracy
        # region: data parallel
        self.accelerator = Accelerator(cpu=is_cpu_only())
        self.held = model.to(device)  # the weights this process holds: all of them
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.model = self.accelerator.prepare(model)  # DDP wrapper under ddp; unchanged on one process
        # this process's share of a batch
        self.mine = slice(rank * cfg.local_batch_size, (rank + 1) * cfg.local_batch_size)
        # endregion
        self.rank = rank

    def train_step(self, train_set: dict, indices) -> float:
        import torch.nn.functional as F

        ids, mask, y = (train_set[k][indices][self.mine].to(self.device)
                        for k in ("input_ids", "attention_mask", "labels"))
        self.model.train()
        loss = F.cross_entropy(self.model(input_ids=ids, attention_mask=mask).logits, y)
        self.accelerator.backward(loss)  # under DDP, the gradients are averaged over the processes here
        return float(self.accelerator.reduce(loss.detach(), "mean"))

    def evaluate(self) -> float | None:
        score = None
        if self.rank == 0:  # the other processes wait; every copy holds the same weights
            n, size = len(self.eval_set["labels"]), self.eval_batch
            score = accuracy(self.accelerator.unwrap_model(self.model),
                             [{k: v[s : s + size] for k, v in self.eval_set.items()} for s in range(0, n, size)])
        self.accelerator.wait_for_everyone()
        return score


class Staged:
    """A 2-stage (or deeper) pipeline: every process holds one stage and sees every example, micro-batch by
    micro-batch (GPipe)."""

    def __init__(self, model, cfg: Config, world_size: int, rank: int, device: str, eval_set: dict):
        import torch
        import torch.nn.functional as F

        self.device, self.eval_set, self.eval_batch = device, eval_set, cfg.local_batch_size
        self.last = world_size - 1  # the last stage computes the loss and the predictions
        # region: pipeline parallel
        micro = cfg.local_batch_size // cfg.microbatches
        example = (eval_set["input_ids"][:micro],), {"attention_mask": eval_set["attention_mask"][:micro]}
        # traced on the CPU; build_stage then moves this process's stage to its device
        self.stage, _ = pipeline_stage(model, world_size, rank, torch.device(device), *example)
        self.held = self.stage.submod  # the weights this process holds: its stage's
        self.trainable = [p for p in self.held.parameters() if p.requires_grad]
        self.schedule = make_schedule("gpipe", self.stage, cfg.microbatches,
                                      loss_fn=lambda out, target: F.cross_entropy(_logits(out), target))
        # endregion

    def _inputs(self, ids, mask):
        # the first stage takes the model's inputs; later stages receive activations from the one before
        return ((ids.to(self.device),), {"attention_mask": mask.to(self.device)}) if self.stage.is_first else ((), {})

    def train_step(self, train_set: dict, indices) -> float | None:
        import torch

        args, kwargs = self._inputs(train_set["input_ids"][indices], train_set["attention_mask"][indices])
        losses = []
        if self.stage.is_last:
            kwargs.update(target=train_set["labels"][indices].to(self.device), losses=losses)
        self.schedule.step(*args, **kwargs)
        return float(torch.stack(losses).detach().mean()) if self.stage.is_last else None

    def evaluate(self) -> float | None:
        import torch

        correct, n, size = 0, len(self.eval_set["labels"]), self.eval_batch
        with torch.no_grad():
            for start in range(0, n, size):
                rows = slice(start, start + size)
                args, kwargs = self._inputs(self.eval_set["input_ids"][rows], self.eval_set["attention_mask"][rows])
                y = self.eval_set["labels"][rows].to(self.device)
                if self.stage.is_last:  # a schedule with a loss function wants targets, in eval too
                    kwargs.update(target=y, losses=[])
                out = self.schedule.eval(*args, **kwargs)
                if self.stage.is_last:
                    correct += int((_logits(out).argmax(-1) == y).sum())
        return correct / n if self.stage.is_last else None


def train(cfg: Config) -> dict:
    """Fine-tune and evaluate the classifier; returns the summary (on every rank; rank 0 also writes it)."""
    import torch
    import torch.distributed as dist
    from accelerate.utils import set_seed  # (transformers.set_seed would import peft and bitsandbytes: seconds)

    preset = validate(cfg)
    world_size = join_world(cfg.num_processes, cfg.timeout_s)
    set_seed(cfg.seed)
    rank = dist.get_rank() if world_size > 1 else 0
    device = per_rank_device()
    sentences = load_sentences(cfg, preset)
    cfg = resolve(cfg, preset, world_size, sentences)
    eval_rows = whole_batches(sentences.eval, global_batch(cfg, world_size))
    train_set = encode(sentences.train, sentences.tokenizer, cfg.max_length)
    eval_set = encode(eval_rows, sentences.tokenizer, cfg.max_length)
    batches = global_batches(len(sentences.train), global_batch(cfg, world_size), cfg.max_steps, cfg.seed)

    default_dir = RUNS_ROOT / "classification" / f"{cfg.preset}_{cfg.method}_{cfg.parallel}"
    with run_lifecycle(cfg, world_size, default_dir=default_dir, workflow="classification") as life:
        # region: full or LoRA
        model = build_classifier(preset, len(sentences.labels), random_init=cfg.random_init)
        disable_dropout(model)  # so that every parallel mode computes the same numbers
        if cfg.method == "lora":  # adapters on cfg.adapter.targets; peft keeps the new head fully trainable
            model = add_adapter(model, cfg.adapter, task_type="SEQ_CLS")
        # endregion
        params = count_parameters(model)
        print0(f"{cfg.method}, {cfg.parallel}: {params['trainable']:,} of {params['total']:,} parameters train")
        runner = (Staged if cfg.parallel == "pipeline" else Replicated)(model, cfg, world_size, rank, device, eval_set)
        del model  # a pipeline process keeps only its stage's weights

        optimizer = torch.optim.AdamW(runner.trainable, lr=cfg.learning_rate)
        # linear decay to zero, as in the RoBERTa and LoRA papers' GLUE fine-tuning: the last steps settle, so the
        # final accuracy is where the run converged rather than where its last large step happened to land
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1 - done / cfg.max_steps)
        history = [{"step": 0, "eval_accuracy": runner.evaluate()}]  # kept by every process; runner.last's is right
        reset_peak(device)
        begin = snapshot(device)
        train_time = 0.0
        for step, indices in enumerate(batches, start=1):
            started = time.perf_counter()
            history.append({"step": step, "loss": runner.train_step(train_set, indices)})
            if step == 1:
                gradients = gradient_bytes(runner.held)  # held from backward until zero_grad
            check_finite(step, history[-1]["loss"], runner.trainable, cfg.learning_rate)
            optimizer.step()
            decay.step()
            if step == 1:
                optimizer_states = optimizer_state_bytes(optimizer)
            optimizer.zero_grad(set_to_none=True)
            train_time += time.perf_counter() - started
            if step % cfg.eval_steps == 0 or step == cfg.max_steps:
                history.append({"step": step, "eval_accuracy": runner.evaluate()})
        end = snapshot(device)
        reports = life.gather({
            "process": rank, "world_size_seen": world_size, "begin": begin, "end": end, "history": history,
            "trainable": sum(p.numel() for p in runner.trainable),
            "breakdown": memory_breakdown(model_weight_bytes(runner.held), gradients, optimizer_states, begin, end)})
        if life.is_main:
            for record in reports[runner.last]["history"]:
                life.log(record)
        life.finish(summarize(cfg, world_size, reports, reports[runner.last]["history"], params,
                              num_labels=len(sentences.labels), eval_rows=len(eval_rows), train_time=train_time)
                    if life.is_main else None)
        print0(f"best eval accuracy {life.summary['best_eval_accuracy']:.3f}")
    return life.summary


def summarize(cfg: Config, world_size: int, reports: list, history: list, params: dict, *, num_labels: int,
              eval_rows: int, train_time: float) -> dict:
    """summary.json: accuracy curve, losses, speed, and what every process held."""
    curve = [(h["step"], h["eval_accuracy"]) for h in history if "eval_accuracy" in h]
    losses = [h["loss"] for h in history if "loss" in h]
    per_rank_peak = [peak_bytes(r["end"]) for r in reports]
    batch = global_batch(cfg, world_size)
    return {
        "workflow": "classification", "preset": cfg.preset, "method": cfg.method, "parallel": cfg.parallel,
        "world_size": world_size, "world_sizes_seen": [r["world_size_seen"] for r in reports],
        "backend": process_group_backend(),
        "local_batch_size": cfg.local_batch_size,  # per process (DDP), or the whole pipeline's
        "global_batch_size": batch,
        "microbatches": cfg.microbatches if cfg.parallel == "pipeline" else None,
        "max_length": cfg.max_length, "steps": cfg.max_steps, "learning_rate": cfg.learning_rate,
        "eval_rows": eval_rows, "num_labels": num_labels,
        "accuracy_before": curve[0][1], "eval_curve": curve,
        "best_eval_accuracy": max(a for s, a in curve[1:]),
        "accuracy_after": curve[-1][1],  # after the last step, as exact_match_after
        "train_loss_first": losses[0], "train_loss_final": losses[-1],
        "runtime_s": train_time, "samples_per_s": cfg.max_steps * batch / train_time,
        # a pipeline splits the trainable weights over its stages; DDP holds them all on every process
        "trainable_params": params["trainable"],
        "trainable_params_per_rank": [r["trainable"] for r in reports],
        "total_params": params["total"],
        # per process: snapshots, and the peak split into weights, gradients, optimizer states, activations
        "memory": [{k: r[k] for k in ("process", "begin", "end", "breakdown")} for r in reports],
        "peak_memory_per_rank": per_rank_peak,
        "model_state_per_rank": [sum(r["breakdown"][k] for k in ("weights", "gradients", "optimizer_states"))
                                 for r in reports],
        "peak_memory_bytes": max(per_rank_peak),
    }


parse_args, main = command_line(Config, train, __name__, DESCRIPTION)
