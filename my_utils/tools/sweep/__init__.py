"""A LoRA sweep over a grid of settings: one fresh process per cell, each writing its own results folder, and the
rows read back from those folders (lesson 07's tables, plots and sentences about them: ``my_utils.lessons.rank_sweep``).

    python -m my_utils sweep --preset tiny --grid rank=1,4,16,64 alpha=32 --output-dir runs/sweeps/tiny
    python -m my_utils sweep --preset tiny --grid rank=4,64 alpha=32 learning_rate=2e-3,8e-3 \\
        --grid method=full learning_rate=2e-4,8e-4 --jobs 2 --output-dir runs/sweeps/tiny_lr
    python -m my_utils sweep --preset opt-350m --ranks 8 128 256 --output-dir runs/sweeps/opt-350m   # a GPU
    python -m my_utils sweep --spec sweep.json --output-dir runs/sweeps/mine

A sweep is declarative: a spec (a preset, the workflow options every cell shares, and grids) saved as
``sweep.json`` in the sweep folder. A grid maps workflow options to the values they take, and its cells are every
combination (``rank=4,64 learning_rate=2e-3,8e-3`` is four cells); the sweep's cells are those of all its grids,
a cell that two grids share counted once. ``--ranks 8 128 256`` is the grid ``rank=8,128,256`` with the workflow's
default alpha, 2 x rank: the update's scale (alpha / rank) then stays 2, so a larger rank also takes larger steps
and the sweep measures both (notebook 07 takes them apart); ``--grid rank=8,128,256 alpha=16`` holds alpha fixed.

Every cell runs ``python -m my_utils.workflows.lora ...`` in a new process with its own folder (its name says the
cell: ``rank16_alpha32_lr0.004``), so that no memory (allocator caches, a peak counter) carries over from one
cell to the next. Running the sweep again skips every cell whose folder says ``complete``; a folder left by a
failed or interrupted cell is renamed (``rank16_alpha32_lr0.004.failed``) and that cell runs again. With
``--jobs 2`` two one-process cells train at a time on a CPU, each with half of the cores: quicker, and each
cell's peak memory is still its own process's, but a cell's runtime then depends on its neighbour, so compare
runtimes only between cells that ran under the same conditions.
"""

from my_utils.tools.sweep.cli import parse_args, parse_grid, read_spec
from my_utils.tools.sweep.results import (ADAPTER_SETTINGS, SETTINGS, load_sweep, seed_means, seed_noise, select,
                                          sweep_table, update_scale)
from my_utils.tools.sweep.running import STEADY_MEMORY_ENV, run_sweep
from my_utils.tools.sweep.spec import LONGEST_NAME, SweepSpec, cell_command, cell_name, workflow_options

__all__ = [
    "parse_args",
    "parse_grid",
    "read_spec",
    "ADAPTER_SETTINGS",
    "SETTINGS",
    "load_sweep",
    "seed_means",
    "seed_noise",
    "select",
    "sweep_table",
    "update_scale",
    "STEADY_MEMORY_ENV",
    "run_sweep",
    "LONGEST_NAME",
    "SweepSpec",
    "cell_command",
    "cell_name",
    "workflow_options",
]
