"""Step 2 of 6, prepare: the Accelerator takes over device placement and data sharding, so the same loop runs
on one CPU, one GPU, or many processes on many machines, unchanged.

    python -m my_utils.workflows.accelerate_steps.step2_prepare --preset tiny
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.accelerate_steps.step2_prepare --preset tiny
"""

from __future__ import annotations

from my_utils.workflows.accelerate_steps.common import Config, batches, build, command_line_of, run_step


def training_loop(cfg: Config, run_dir) -> dict:
    import time

    import torch

    # New Code # prepare
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    model, dataset = build(cfg)
    # New Code # prepare
    # The Accelerator knows this launch: how many processes, this process's device, the backend (gloo, nccl).
    accelerator = Accelerator()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=0.0)
    dataloader = DataLoader(dataset, batch_size=cfg.local_batch_size, drop_last=True)
    # New Code # prepare
    # prepare() moves the model to this process's device (and wraps it in DDP when several processes run),
    # gives each process its own share of the batches (on its device) and wraps the optimizer.
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)

    losses = []
    model.train()
    started = time.perf_counter()
    for batch in batches(dataloader, cfg.max_steps):
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
    return {"losses": losses, "seconds": time.perf_counter() - started}


def train(cfg: Config) -> dict:
    """Run the training loop into a results folder; returns its summary."""
    return run_step(training_loop, cfg)


parse_args, main = command_line_of(train, __name__)
