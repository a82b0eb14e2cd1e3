"""Cells of a sweep trained one after another in one process, for ``run_sweep(..., fresh_processes=False)``.

Importing torch, transformers and peft takes seconds, as long as a short cell on the tiny model trains. A worker
imports them once and then runs each cell as a cell's own process would, ``python -m my_utils.workflows.lora
<options>``: the same results folder, the same figures (a test holds the two ways to the same losses), the output
in ``<sweep>/<cell>.log``, moved into the cell's folder as ``output.log``. What a worker cannot give is a cell's
own process: its peak memory is that of the worker so far.

    python -m my_utils.tools.sweep_worker '["<cell folder>", ["--preset", "tiny", ...]]' ...
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from pathlib import Path

from my_utils.run.divergence import diverged
from my_utils.workflows import lora


def run_cell(folder: Path, args: list[str]) -> int:
    """Train one cell as ``python -m my_utils.workflows.lora <args>`` would; returns its exit code."""
    log = folder.with_name(f"{folder.name}.log")
    with open(log, "w", encoding="utf-8") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        print("$ python -m my_utils.workflows.lora " + " ".join(args), flush=True)
        try:
            lora.main(args)
            code = 0
        except SystemExit as e:  # the workflow's one-line refusal (2) or failure (1), already printed
            code = e.code if isinstance(e.code, int) else 1
        except Exception:  # a bug in one cell: its traceback in its log, and the next cell runs
            traceback.print_exc()
            code = 1
    if folder.is_dir():
        log.replace(folder / "output.log")
    return code


def main(argv=None) -> int:
    """Run each ``[folder, options]`` cell given; stop at a cell that refuses its settings (exit 2: the sweep's
    other cells would be refused too), else go on past failures, a diverged cell's among them (the sweep reads each
    folder's status)."""
    for item in sys.argv[1:] if argv is None else argv:
        folder, args = json.loads(item)
        if run_cell(Path(folder), args) == 2 and not diverged(folder):
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
