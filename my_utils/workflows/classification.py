"""Sentence classification with full fine-tuning or LoRA, on one device, data parallel (DDP) or pipeline parallel.

    python -m my_utils.workflows.classification --preset tiny --method lora                 # one process
    accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.classification \\
        --preset tiny --method full --parallel ddp                                          # 2 processes, DDP
    accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.classification \\
        --preset tiny --method lora --parallel pipeline                                     # 2 pipeline stages
    accelerate launch --config_file configs/multi_gpu.yaml -m my_utils.workflows.classification \\
        --preset roberta-large --method full --parallel ddp                                 # GPUs

The three ways to run do the same arithmetic: every mode trains on the same global batches in the same order
(``--batch-size`` examples per optimizer step: split in halves over the DDP processes, cut into micro-batches
through the pipeline), and dropout is off, so they differ only in how the work and the memory are spread. Every
run writes a results folder: best and final eval accuracy, the accuracy curve, training time, samples/s, peak
memory on every process, trainable parameters.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, fields

from my_utils import UserError
from my_utils.run.results import RUNS_ROOT

METHODS = ("full", "lora")
PARALLEL = ("none", "ddp", "pipeline")
# Peak learning rates per preset: LoRA trains few, freshly initialised weights and takes a larger step than full
# fine-tuning, which moves every pretrained weight. The rate decays linearly to zero over the run.
LEARNING_RATES = {"tiny": {"full": 5e-4, "lora": 3e-3}, "roberta-large": {"full": 2e-5, "lora": 2e-4}}


@dataclass
class Config:
    preset: str = "tiny"
    method: str = "lora"  # "full" (every weight trains) or "lora" (adapters on the preset's classifier targets)
    parallel: str = "none"  # "none" (one process), "ddp" (one copy per process), "pipeline" (one stage per process)
    rank: int = 8
    alpha: float | None = None  # default 2 x rank
    batch_size: int | None = None  # examples per optimizer step, over all processes; default: the preset's
    microbatches: int = 4  # pipeline only
    learning_rate: float | None = None  # peak, decaying linearly to zero; default: LEARNING_RATES
    max_steps: int | None = None  # default: the preset's
    max_length: int | None = None  # tokens per sentence; default: the longest sentence, at most the preset's
    eval_rows: int = 300
    eval_every: int = 20
    seed: int = 0
    random_init: bool = False
    output_dir: str | None = None  # default: runs/classification/<preset>_<method>_<parallel>
    num_processes: int | None = None  # what the launch asked for; checked inside every worker


def validate(cfg: Config):
    from my_utils.core.models import check_lora_args
    from my_utils.core.presets import get_preset
    from my_utils.run.config import check_positive

    preset = get_preset(cfg.preset)
    preset.require("classifier")
    if cfg.method not in METHODS:
        raise UserError(f"Unknown method {cfg.method!r}; choose one of {', '.join(METHODS)}.")
    if cfg.parallel not in PARALLEL:
        raise UserError(f"Unknown parallel mode {cfg.parallel!r}; choose one of {', '.join(PARALLEL)}.")
    if cfg.method == "lora":
        check_lora_args(cfg.rank, cfg.alpha)
    for name in ("batch_size", "max_steps", "max_length", "learning_rate"):
        if getattr(cfg, name) is not None:
            check_positive(f"--{name.replace('_', '-')}", getattr(cfg, name), float if name == "learning_rate" else int)
    for name in ("microbatches", "eval_rows", "eval_every"):
        check_positive(f"--{name.replace('_', '-')}", getattr(cfg, name))
    return preset


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


def train(cfg: Config) -> dict:
    """Fine-tune and evaluate the classifier; returns the summary (on every rank; rank 0 also writes it)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from accelerate.utils import (
        set_seed,  # (transformers.set_seed would import peft and bitsandbytes: seconds)
    )

    from my_utils.core.data import check_enough_rows, load_classification
    from my_utils.core.devices import device_inventory, per_rank_device
    from my_utils.core.memory import peak_bytes, reset_peak, snapshot
    from my_utils.core.models import add_lora, build_classifier, count_parameters, load_tokenizer, set_threads
    from my_utils.core.printing import print0
    from my_utils.run.callbacks import (gather_to_rank0, gradient_bytes, memory_breakdown, model_weight_bytes,
                                        optimizer_state_bytes)
    from my_utils.run.launch import check_world_size
    from my_utils.run.lifecycle import open_run, recorded
    from my_utils.workflows.pipeline import disable_dropout, make_schedule, pipeline_stage

    preset = validate(cfg)
    world_size = check_world_size(cfg.num_processes)
    if cfg.parallel == "none" and world_size != 1:
        raise UserError(f"--parallel none runs on one process but {world_size} were launched; "
                        "use --parallel ddp or pipeline, or launch one process.")
    if cfg.parallel != "none" and world_size < 2:
        raise UserError(f"--parallel {cfg.parallel} needs 2 or more processes; launch with accelerate launch "
                        "--config_file configs/cpu_x2.yaml (or torchrun --nproc_per_node 2).")
    set_threads()
    set_seed(cfg.seed)
    rank = dist.get_rank() if world_size > 1 else 0
    device = per_rank_device()
    batch_size = cfg.batch_size or preset.batch_size
    split = world_size if cfg.parallel == "ddp" else cfg.microbatches if cfg.parallel == "pipeline" else 1
    if batch_size % split:
        raise UserError(f"A batch of {batch_size} does not split into {split} equal parts for --parallel "
                        f"{cfg.parallel}; choose a --batch-size that is a multiple of {split}.")
    steps = cfg.max_steps or preset.max_steps
    learning_rate = cfg.learning_rate or LEARNING_RATES.get(cfg.preset, {}).get(cfg.method, preset.learning_rate)

    tokenizer = load_tokenizer(preset, role="classifier")
    train_rows, eval_rows, labels = load_classification(preset.classification_data, eval_rows=cfg.eval_rows,
                                                        seed=cfg.seed)
    check_enough_rows(len(train_rows), batch_size)
    eval_rows = eval_rows[: len(eval_rows) // batch_size * batch_size]  # whole batches: every mode scores these rows
    if not eval_rows:
        raise UserError(f"Fewer eval rows than one batch of {batch_size}; raise --eval-rows or lower --batch-size.")
    longest = max(len(tokenizer(r["text"])["input_ids"]) for r in train_rows + eval_rows)
    length = min(longest, cfg.max_length or preset.max_length)
    train_set, eval_set = encode(train_rows, tokenizer, length), encode(eval_rows, tokenizer, length)
    batches = global_batches(len(train_rows), batch_size, steps, cfg.seed)

    default_dir = RUNS_ROOT / "classification" / f"{cfg.preset}_{cfg.method}_{cfg.parallel}"
    run, run_dir = open_run(cfg.output_dir, default_dir, asdict(cfg), world_size=world_size,
                            backend=dist.get_backend() if world_size > 1 else None, devices=device_inventory())
    with recorded(run):
        model = build_classifier(preset, len(labels), random_init=cfg.random_init)
        disable_dropout(model)
        if cfg.method == "lora":
            model = add_lora(model, cfg.rank, cfg.alpha, preset.classifier_lora_targets, task_type="SEQ_CLS")
        params = count_parameters(model)
        print0(f"{cfg.method}, {cfg.parallel}: {params['trainable']:,} of {params['total']:,} parameters train")
        history = []  # (step, loss) or (step, accuracy), kept by the process that knows them

        def columns(indices, part=slice(None)):
            return [train_set[k][indices][part].to(device) for k in ("input_ids", "attention_mask", "labels")]

        if cfg.parallel == "pipeline":
            micro = batch_size // cfg.microbatches
            example = (eval_set["input_ids"][:micro],), {"attention_mask": eval_set["attention_mask"][:micro]}
            # traced on the CPU; build_stage then moves this process's stage to its device
            stage, _ = pipeline_stage(model, world_size, rank, torch.device(device), *example)
            del model  # each process keeps only its stage's weights
            held = stage.submod  # the weights this process holds
            trainable = [p for p in held.parameters() if p.requires_grad]
            schedule = make_schedule("gpipe", stage, cfg.microbatches,
                                     loss_fn=lambda out, target: F.cross_entropy(_logits(out), target))

            def inputs(ids, mask):
                # the first stage takes the model's inputs; later stages receive activations from the one before
                return ((ids,), {"attention_mask": mask}) if stage.is_first else ((), {})

            def train_step(indices):
                ids, mask, y = columns(indices)
                args, kwargs = inputs(ids, mask)
                losses = []
                if stage.is_last:
                    kwargs.update(target=y, losses=losses)
                schedule.step(*args, **kwargs)
                return float(torch.stack(losses).detach().mean()) if stage.is_last else None

            def evaluate():
                correct = 0
                with torch.no_grad():
                    for start in range(0, len(eval_rows), batch_size):
                        rows = slice(start, start + batch_size)
                        ids, mask = (eval_set[k][rows].to(device) for k in ("input_ids", "attention_mask"))
                        args, kwargs = inputs(ids, mask)
                        y = eval_set["labels"][start : start + batch_size].to(device)
                        if stage.is_last:  # a schedule with a loss function wants targets, in eval too
                            kwargs.update(target=y, losses=[])
                        out = schedule.eval(*args, **kwargs)
                        if stage.is_last:
                            correct += int((_logits(out).argmax(-1) == y).sum())
                return correct / len(eval_rows) if stage.is_last else None
        else:
            from accelerate import Accelerator

            from my_utils.core.evaluation import accuracy
            from my_utils.run.launch import is_cpu_only

            accelerator = Accelerator(cpu=is_cpu_only())
            held = model.to(device)  # the weights this process holds: all of them
            trainable = [p for p in model.parameters() if p.requires_grad]
            model = accelerator.prepare(model)  # DDP wrapper under ddp; unchanged on one process
            part = batch_size // world_size
            mine = slice(rank * part, (rank + 1) * part)  # this process's share of every global batch

            def train_step(indices):
                ids, mask, y = columns(indices, mine)
                model.train()
                loss = F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, y)
                accelerator.backward(loss)
                return float(accelerator.reduce(loss.detach(), "mean"))

            def evaluate():
                score = None
                if rank == 0:  # the other processes wait; every copy holds the same weights
                    eval_batches = [{k: v[s : s + batch_size] for k, v in eval_set.items()}
                                    for s in range(0, len(eval_rows), batch_size)]
                    score = accuracy(accelerator.unwrap_model(model), eval_batches)
                accelerator.wait_for_everyone()
                return score

        optimizer = torch.optim.AdamW(trainable, lr=learning_rate)
        # linear decay to zero, as in the RoBERTa and LoRA papers' GLUE fine-tuning: the last steps settle, so the
        # final accuracy is where the run converged rather than where its last large step happened to land
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1 - done / steps)
        last = world_size - 1 if cfg.parallel == "pipeline" else 0  # the process that sees losses and accuracy
        accuracy_before = evaluate()
        if rank == last:
            history.append({"step": 0, "eval_accuracy": accuracy_before})
        reset_peak(device)
        begin = snapshot(device)
        train_time = 0.0
        for step, indices in enumerate(batches, start=1):
            started = time.perf_counter()
            loss = train_step(indices)
            if step == 1:
                gradients = gradient_bytes(held)  # held from backward until zero_grad
            optimizer.step()
            decay.step()
            if step == 1:
                optimizer_states = optimizer_state_bytes(optimizer)
            optimizer.zero_grad(set_to_none=True)
            train_time += time.perf_counter() - started
            if rank == last:
                history.append({"step": step, "loss": loss})
            if step % cfg.eval_every == 0 or step == steps:
                score = evaluate()
                if rank == last:
                    history.append({"step": step, "eval_accuracy": score})
        end = snapshot(device)
        mine = {"rank": rank, "world_size_seen": world_size, "begin": begin, "end": end, "history": history,
                "trainable": sum(p.numel() for p in trainable),
                "breakdown": memory_breakdown(model_weight_bytes(held), gradients, optimizer_states, begin, end)}
        reports = gather_to_rank0(mine)
        summary = None
        if run is not None:
            history = reports[last]["history"]
            for record in history:
                run.log_metrics(record)
            curve = [(h["step"], h["eval_accuracy"]) for h in history if "eval_accuracy" in h]
            losses = [h["loss"] for h in history if "loss" in h]
            per_rank_peak = [peak_bytes(r["end"]) for r in reports]
            summary = {
                "workflow": "classification",
                "preset": cfg.preset,
                "method": cfg.method,
                "parallel": cfg.parallel,
                "world_size": world_size,
                "world_sizes_seen": [r["world_size_seen"] for r in reports],
                "backend": dist.get_backend() if world_size > 1 else None,
                "batch_size": batch_size,
                "microbatches": cfg.microbatches if cfg.parallel == "pipeline" else None,
                "sequence_length": length,
                "steps": steps,
                "learning_rate": learning_rate,
                "eval_rows": len(eval_rows),
                "num_labels": len(labels),
                "accuracy_before": curve[0][1],
                "eval_curve": curve,
                "best_eval_accuracy": max(a for s, a in curve[1:]),
                "accuracy_after": curve[-1][1],  # after the last step, as exact_match_after
                "train_loss_first": losses[0],
                "train_loss_final": losses[-1],
                "runtime_s": train_time,
                "samples_per_s": steps * batch_size / train_time,
                # a pipeline splits the trainable weights over its stages; DDP holds them all on every process
                "trainable_params": params["trainable"],
                "trainable_params_per_rank": [r["trainable"] for r in reports],
                "total_params": params["total"],
                # per process: snapshots, and the peak split into weights, gradients, optimizer states, activations
                "memory": [{k: r[k] for k in ("rank", "begin", "end", "breakdown")} for r in reports],
                "peak_memory_per_rank": per_rank_peak,
                "model_state_per_rank": [sum(r["breakdown"][k] for k in ("weights", "gradients", "optimizer_states"))
                                         for r in reports],
                "peak_memory_bytes": max(per_rank_peak),
            }
            run.finish(summary)
            print0(f"best eval accuracy {summary['best_eval_accuracy']:.3f}; results folder: {run_dir}")
        if world_size > 1:
            dist.barrier()
    return summary


def _logits(output):
    """The traced classifier returns its logits, alone or first in a tuple."""
    return output[0] if isinstance(output, (tuple, list)) else output


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(
        prog="python -m my_utils.workflows.classification",
        description="Full fine-tuning or LoRA of a sentence classifier, on one process, with DDP or as a 2-stage "
        "pipeline. Launch DDP and pipeline runs with `accelerate launch --config_file configs/cpu_x2.yaml -m "
        "my_utils.workflows.classification ...`. Writes a results folder and prints its summary.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = Config()
    p.add_argument("--preset", default=d.preset, help="tiny (offline CPU) or roberta-large")
    p.add_argument("--method", default=d.method, choices=METHODS)
    p.add_argument("--parallel", default=d.parallel, choices=PARALLEL)
    p.add_argument("--rank", type=int, default=d.rank, help="LoRA rank r")
    p.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    p.add_argument("--batch-size", type=int, default=None, help="examples per optimizer step over all processes "
                   "(default: the preset's)")
    p.add_argument("--microbatches", type=int, default=d.microbatches, help="micro-batches per step (pipeline)")
    p.add_argument("--learning-rate", type=float, default=None, help="peak rate, decaying linearly to zero "
                   "(default: per preset and method)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    p.add_argument("--max-length", type=int, default=None, help="tokens per sentence (default: the longest)")
    p.add_argument("--eval-rows", type=int, default=d.eval_rows, help="held-out rows scored for accuracy")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between accuracy evaluations")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--random-init", action="store_true", help="random weights from the shipped config (offline)")
    p.add_argument("--output-dir", default=None, help="results folder (must not exist)")
    p.add_argument("--num-processes", type=int, default=None,
                   help="world size to expect inside each worker (default: WORLD_SIZE from the launcher)")
    args = p.parse_args(argv)
    names = {f.name for f in fields(Config)}
    return Config(**{k: v for k, v in vars(args).items() if k in names and v is not None})


def main(argv=None) -> dict:
    from my_utils.run.cli import run_main

    return run_main(lambda: train(parse_args(argv)), prefix="classification")


if __name__ == "__main__":
    from my_utils.run.cli import exit_skipping_teardown

    main()
    exit_skipping_teardown()
