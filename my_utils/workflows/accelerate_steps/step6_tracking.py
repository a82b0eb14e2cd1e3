"""Step 6 of 6, tracking: the Accelerator sends the config and per-step metrics to experiment trackers
(TensorBoard, W&B, MLflow... when installed, with ``--report-to``) and, here, always to the run's metrics.jsonl,
from the main process only. This is the complete loop: every earlier step's lines are still in it.

    python -m my_utils.workflows.accelerate_steps.step6_tracking --preset tiny
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.accelerate_steps.step6_tracking --preset tiny
    accelerate launch --config_file configs/fsdp.yaml -m my_utils.workflows.accelerate_steps.step6_tracking --preset gpt2
"""

from __future__ import annotations

from my_utils.workflows.accelerate_steps.common import Config, batches, build, command_line_of, run_step


def training_loop(cfg: Config, run_dir) -> dict:
    import time

    import torch

    # New Code # prepare
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    # New Code # checkpointing
    # New Code # tracking
    from my_utils.workflows.accelerate_steps.common import (checkpoint_dir, checkpoint_step, jsonl_tracker,
                                                            tracker_config)

    model, dataset = build(cfg)
    # New Code # prepare
    # The Accelerator knows this launch: how many processes, this process's device, the backend (gloo, nccl).
    # New Code # mixed precision
    # autocast the forward pass to bf16/fp16: less activation memory, faster matmuls on GPUs; fp16 also
    # scales the loss (a GradScaler) so that small gradients do not underflow
    accelerator = Accelerator(
        mixed_precision=cfg.mixed_precision,
        # New Code # gradient accumulation
        gradient_accumulation_steps=cfg.grad_accum,
        # New Code # tracking
        # trackers by name ("tensorboard", "wandb", ...) or as objects; project_dir is where local ones write
        log_with=[jsonl_tracker(run_dir), *cfg.report_to],
        project_dir=run_dir,
    )
    # New Code # tracking
    accelerator.init_trackers("accelerate_steps", config=tracker_config(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=0.0)
    dataloader = DataLoader(dataset, batch_size=cfg.local_batch_size, drop_last=True)
    # New Code # prepare
    # prepare() moves the model to this process's device (and wraps it in DDP when several processes run),
    # gives each process its own share of the batches (on its device) and wraps the optimizer.
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    # New Code # checkpointing
    # resume: load the states saved by save_state (after prepare, into the prepared objects)
    done = 0
    if cfg.resume_from:
        accelerator.load_state(cfg.resume_from)
        done = checkpoint_step(cfg.resume_from)

    losses = []
    model.train()
    started = time.perf_counter()
    # New Code # gradient accumulation
    # grad_accum batches per optimizer step
    # New Code # checkpointing
    # for the steps still to do, after the batches of the steps done before the checkpoint
    for batch in batches(dataloader, (cfg.max_steps - done) * cfg.grad_accum, skip=done * cfg.grad_accum):
        # New Code # gradient accumulation
        # accumulate() divides the loss by grad_accum in backward(), skips the gradient all-reduce (no_sync) on
        # all but the last batch of a step, and lets optimizer.step()/zero_grad() act on that last batch only
        with accelerator.accumulate(model):
            # New Code # prepare
            # (no .to(device): the prepared dataloader yields batches on this process's device)
            loss = model(**batch).loss
            # New Code # prepare
            # backward through the accelerator: it scales the loss when mixed precision or accumulation need it
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        # New Code # prepare
        # each process trained on its own batch: log the mean of every process's loss
        losses.append(accelerator.gather(loss.detach()).mean().item())
        # New Code # checkpointing
        # after an optimizer step (sync_gradients): save every save_steps steps and at the end; every process
        # takes part (each saves its own random states)
        if accelerator.sync_gradients:
            done += 1
            # New Code # tracking
            # one metrics line per optimizer step: the mean loss of its batches
            accelerator.log({"loss": sum(losses[-cfg.grad_accum:]) / cfg.grad_accum}, step=done)
            if done == cfg.max_steps or (cfg.save_steps and done % cfg.save_steps == 0):
                accelerator.save_state(checkpoint_dir(run_dir, done))
    # New Code # tracking
    accelerator.end_training()  # close the trackers (flush files, end the remote run)
    return {"losses": losses, "seconds": time.perf_counter() - started}


def train(cfg: Config) -> dict:
    """Run the training loop into a results folder; returns its summary."""
    # New Code # tracking
    # the loop hands --report-to to accelerate itself (log_with above), so the results folder does not as well
    return run_step(training_loop, cfg, loop_has_trackers=True)


parse_args, main = command_line_of(train, __name__)
