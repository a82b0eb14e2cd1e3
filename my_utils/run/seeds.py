"""Several seeds of one experiment, each a fresh process (side by side where the cores allow), so that a lesson
measures its noise instead of assuming it (``my_utils.core.stats`` turns their figures into intervals).

    from my_utils.core.stats import mean_interval
    runs = run_seeds(lambda seed, out: [sys.executable, "-m", "my_utils.workflows.lora", "--preset", "tiny",
                                        "--seed", str(seed), "--output-dir", str(out)], LESSON / "x1")
    mean_interval([r["summary"]["eval_loss"] for r in runs])
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from my_utils.core.devices import usable_cores
from my_utils.run.launch import clean_env, run_logged
from my_utils.run.results import load_run, shown_path

SEEDS = (0, 1, 2)  # three seeds: the fewest that give a spread and an interval


def run_seeds(command, folder: str | Path, seeds=SEEDS, *, jobs: int | None = None, env: dict | None = None,
              threads: int = 1):
    """Run ``command(seed, out)`` (a command line) for each seed into ``folder/seed_<seed>``, its output in
    ``folder/seed_<seed>.log``, ``jobs`` at a time (default: one per usable core; 1 for commands that start several
    processes themselves), each process with ``threads`` threads. Prints one line when all are done; returns the
    runs (``load_run``) in seed order.

    ``command`` may also be a dict of such functions, one per setting: every setting's seeds then share one pool
    (no core idles while the last seed of one setting runs alone), each into ``folder/<setting>/seed_<seed>``, and
    the result is a dict of run lists by setting."""
    folder = Path(folder)
    settings = command if isinstance(command, dict) else {None: command}
    where = {name: folder / name if name is not None else folder for name in settings}
    env = {**(env or clean_env()), "OMP_NUM_THREADS": str(threads)}
    jobs = jobs or max(1, usable_cores() // threads)
    started = time.perf_counter()
    runs = [(name, seed) for name in settings for seed in seeds]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(lambda job: run_logged(settings[job[0]](job[1], where[job[0]] / f"seed_{job[1]}"),
                                             where[job[0]] / f"seed_{job[1]}.log", env), runs))
    shown = f"{shown_path(folder)}/" + ("*/" if len(settings) > 1 or None not in settings else "")
    print(f"{len(runs)} run{'s' if len(runs) > 1 else ''} (seeds {', '.join(map(str, seeds))}) done in "
          f"{time.perf_counter() - started:.0f} s, {jobs} at a time; their output: {shown}seed_*.log", flush=True)
    found = {name: [load_run(where[name] / f"seed_{seed}") for seed in seeds] for name in settings}
    return found if isinstance(command, dict) else found[None]
