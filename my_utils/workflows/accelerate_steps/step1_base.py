"""Step 1 of 6, the starting point: a plain PyTorch training loop on one device. Nothing distributed yet.

    python -m my_utils.workflows.accelerate_steps.step1_base --preset tiny

The next steps turn it into an accelerate loop one feature at a time; ``diff`` two neighbouring files (or read
``my_utils.workflows.accelerate_steps.step_diff``) to see exactly what each feature costs.
"""

from __future__ import annotations

from my_utils.workflows.accelerate_steps.common import Config, batches, build, command_line_of, run_step


def training_loop(cfg: Config, run_dir) -> dict:
    import time

    import torch
    from torch.utils.data import DataLoader

    model, dataset = build(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=0.0)
    dataloader = DataLoader(dataset, batch_size=cfg.local_batch_size, drop_last=True)

    losses = []
    model.train()
    started = time.perf_counter()
    for batch in batches(dataloader, cfg.max_steps):
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "seconds": time.perf_counter() - started}


def train(cfg: Config) -> dict:
    """Run the training loop into a results folder; returns its summary."""
    return run_step(training_loop, cfg)


parse_args, main = command_line_of(train, __name__)
