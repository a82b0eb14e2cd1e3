"""Step 3 of 6, mixed precision: forward passes run under autocast in bf16 (or fp16 on a GPU) while the weights
and the optimizer stay in fp32. One argument; prepare() wraps the model's forward in autocast.

    python -m my_utils.workflows.accelerate_steps.step3_mixed_precision --preset tiny --mixed-precision bf16
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.accelerate_steps.step3_mixed_precision \\
        --preset tiny --mixed-precision bf16
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
    # New Code # mixed precision
    # autocast the forward pass to bf16/fp16: less activation memory, faster matmuls on GPUs; fp16 also
    # scales the loss (a GradScaler) so that small gradients do not underflow
    accelerator = Accelerator(
        mixed_precision=cfg.mixed_precision,
    )
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
