"""The command line of ``python -m my_utils sweep``: grids or a spec file, read into a spec (the command itself, run
then report, is ``my_utils.lessons.rank_sweep.main``)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from my_utils import UserError
from my_utils.core.paths import RUNS_ROOT
from my_utils.run.config import OneLineParser
from my_utils.tools.sweep.spec import DEFAULT_ARGS, SweepSpec


def parse_grid(items: list[str]) -> dict:
    """One ``--grid``: ``["rank=4,16", "targets=c_attn,c_attn+c_fc"]`` is
    ``{"rank": [4, 16], "targets": ["c_attn", ["c_attn", "c_fc"]]}``. Values split at commas, a value with ``+`` is a
    list, the rest read as JSON where they can be (numbers, true/false) and as text otherwise; ``SweepSpec`` then
    reads each as the workflow does."""
    grid = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise UserError(f"--grid takes OPTION=VALUE,VALUE...; got {item!r}.")
        grid[key.replace("-", "_")] = [v.split("+") if "+" in v else _literal(v) for v in values.split(",")]
    return grid


def _literal(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def read_spec(path: Path) -> dict:
    """The JSON object of a ``--spec`` file, its keys checked: one sentence for a file that is missing, not JSON,
    or not a sweep spec."""
    try:
        spec = json.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise UserError(f"Sweep spec {path} does not exist; check the path given to --spec.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"Sweep spec {path} cannot be read ({getattr(e, 'strerror', None) or e}); give a UTF-8 "
                        "JSON file to --spec.") from None
    except json.JSONDecodeError as e:
        raise UserError(f"Sweep spec {path} is not valid JSON (line {e.lineno}: {e.msg}); fix it.") from None
    keys = [f.name for f in fields(SweepSpec)]
    if not isinstance(spec, dict):
        raise UserError(f"Sweep spec {path} holds {type(spec).__name__}, not an object with {', '.join(keys)}.")
    unknown = [key for key in spec if key not in keys]
    if unknown:
        raise UserError(f"Sweep spec {path} has an unknown key {unknown[0]!r}; use {', '.join(keys)}.")
    for key, kind, example in (("preset", str, '"tiny"'), ("args", dict, '{"max_steps": 30}'),
                               ("grids", list, '[{"rank": [4, 16]}]'), ("num_processes", int, "2")):
        if key in spec and (not isinstance(spec[key], kind) or isinstance(spec[key], bool)):
            raise UserError(f"Sweep spec {path} gives {key} as {type(spec[key]).__name__} {json.dumps(spec[key])[:40]};"
                            f" it takes a {kind.__name__}, like {example}.")
    return spec


def parse_args(argv=None) -> tuple[SweepSpec, Path, int]:
    import argparse

    p = OneLineParser(prog="python -m my_utils sweep", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", type=Path, help="a JSON file with preset, grids, args (the options below override it)")
    p.add_argument("--preset", help="tiny (CPU, offline), gpt2, opt-350m (default: tiny)")
    p.add_argument("--grid", nargs="+", action="append", metavar="OPTION=V1,V2",
                   help="one grid of workflow options and their values (repeat --grid for several); default: "
                   "rank=1,4,16,64 alpha=32 on tiny, rank=8,128,256 alpha=16 otherwise")
    p.add_argument("--ranks", type=int, nargs="+", help="the grid rank=R1,R2,... (alpha: the workflow's 2 x rank)")
    p.add_argument("--output-dir", dest="out", type=Path,
                   help="the sweep folder (default: runs/sweeps/<preset>); reuse it to resume")
    p.add_argument("--jobs", type=int, default=1,
                   help="one-process cells trained side by side on a CPU (default 1: one at a time)")
    p.add_argument("--num-processes", type=int, help="processes per cell's run (accelerate launch when > 1)")
    shared = {"max-steps": (int, "optimizer steps per cell"), "local-batch-size": (int, "per process"),
              "eval-rows": (int, "held-out rows for the loss and exact match"), "max-length": (int, "tokens"),
              "learning-rate": (float, "the workflow's learning rate")}
    for name, (kind, text) in shared.items():
        p.add_argument(f"--{name}", type=kind, help=text)
    p.add_argument("--random-init", action="store_true", help="random weights (offline; no quality)")
    a = p.parse_args(argv)
    spec = read_spec(a.spec) if a.spec else {}
    preset = a.preset or spec.get("preset", "tiny")
    args = {**DEFAULT_ARGS.get(preset, {}), **spec.get("args", {})}
    args.update({k: v for k, v in vars(a).items() if k in {n.replace("-", "_") for n in shared} and v is not None})
    if a.random_init:
        args["random_init"] = True
    grids = [parse_grid(items) for items in a.grid or []] + ([{"rank": a.ranks}] if a.ranks else [])
    spec = SweepSpec(preset=preset, grids=grids or spec.get("grids", []), args=args,
                     num_processes=a.num_processes or spec.get("num_processes", 1))
    return spec, a.out or RUNS_ROOT / "sweeps" / preset, a.jobs
