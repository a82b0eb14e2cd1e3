"""Step 5 of 6, checkpointing: ``accelerator.save_state`` writes the model, optimizer and random states of every
process; ``accelerator.load_state`` brings them back, and the resumed run skips the batches already trained on,
so that it ends exactly where an uninterrupted run would.

    python -m my_utils.workflows.accelerate_steps.step5_checkpoint --preset tiny --max-steps 4 --save-steps 2
    python -m my_utils.workflows.accelerate_steps.step5_checkpoint --preset tiny --max-steps 4 \\
        --resume-from runs/accelerate_steps/step5_checkpoint_tiny_x1/checkpoints/step_2
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
    from my_utils.workflows.accelerate_steps.common import checkpoint_dir, checkpoint_step

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
    )
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
            if done == cfg.max_steps or (cfg.save_steps and done % cfg.save_steps == 0):
                accelerator.save_state(checkpoint_dir(run_dir, done))
    return {"losses": losses, "seconds": time.perf_counter() - started}


def train(cfg: Config) -> dict:
    """Run the training loop into a results folder; returns its summary."""
    return run_step(training_loop, cfg)


parse_args, main = command_line_of(train, __name__)
