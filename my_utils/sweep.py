"""A LoRA rank sweep: one fresh process per rank, each writing its own results folder, then a table, plots and
trade-off sentences computed from those folders.

    python -m my_utils.sweep --preset tiny --ranks 1 2 4 8 --out runs/sweeps/tiny
    python -m my_utils.sweep --preset opt-350m --ranks 8 128 256 --out runs/sweeps/opt-350m   # a GPU
    python -m my_utils.sweep --spec sweep.json --out runs/sweeps/mine

A sweep is declarative: a spec (preset, ranks, the workflow's other arguments) saved as ``sweep.json`` in the
sweep folder, and one folder ``rank_<r>/`` per rank. Every rank runs ``python -m my_utils.workflows.lora ...
--rank r`` in a new process, so that no memory (allocator caches, a peak counter) carries over from one rank
to the next. Running the sweep again skips every rank whose folder says ``complete``; a folder left by a
failed or interrupted rank is renamed (``rank_8.failed``) and that rank runs again.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from my_utils import UserError
from my_utils.runs import RUNS_ROOT, atomic_write_json, load_run, read_json, unique_dir

WORKFLOW = "my_utils.workflows.lora"
# Ranks to try when none are given: a dense range on the tiny model, the classic assignment's on real models.
DEFAULT_RANKS = {"tiny": (1, 2, 4, 8, 16, 32)}
REAL_MODEL_RANKS = (8, 128, 256)
# The workflow's other arguments when none are given: few steps on the tiny model, so that a sweep takes a minute.
DEFAULT_ARGS = {"tiny": {"max_steps": 20, "eval_rows": 40, "logging_steps": 2}}
# Environment for a process whose peak resident memory is compared with another's. glibc raises its mmap
# threshold each time a large block is freed, so later large blocks come from a heap that keeps freed memory:
# the peak then depends on the order of frees and moves by 20 MiB between identical runs. A fixed threshold
# returns every large block to the system when freed (identical runs then agree within 1 MiB).
STEADY_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


@dataclass
class SweepSpec:
    """What a sweep runs: ``args`` are the workflow's command-line options without dashes
    (``{"max_steps": 30}`` becomes ``--max-steps 30``; ``{"random_init": True}`` becomes ``--random-init``)."""

    preset: str = "tiny"
    ranks: tuple[int, ...] = ()
    args: dict = field(default_factory=dict)
    num_processes: int = 1

    def __post_init__(self):
        from my_utils.models import check_lora_args
        from my_utils.presets import get_preset

        get_preset(self.preset)
        self.ranks = tuple(sorted(set(self.ranks or DEFAULT_RANKS.get(self.preset, REAL_MODEL_RANKS))))
        for rank in self.ranks:
            check_lora_args(rank)
        reserved = {"preset", "rank", "output_dir", "method", "num_processes"} & set(self.args)
        if reserved:
            raise UserError(f"The sweep sets --{sorted(reserved)[0].replace('_', '-')} itself; remove it from args.")


def rank_dir(out: str | Path, rank: int) -> Path:
    return Path(out) / f"rank_{rank}"


def _flags(args: dict) -> list[str]:
    flags = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value not in (False, None):
            flags += [flag, *map(str, value)] if isinstance(value, (list, tuple)) else [flag, str(value)]
    return flags


def rank_command(spec: SweepSpec, rank: int, folder: Path) -> list[str]:
    """The command that trains one rank in a new process (``accelerate launch`` for several processes)."""
    from my_utils.launch import accelerate_command

    args = ["--preset", spec.preset, "--method", "lora", "--rank", str(rank), "--output-dir", str(folder),
            *_flags(spec.args)]
    if spec.num_processes > 1:
        return accelerate_command(WORKFLOW, [*args, "--num-processes", str(spec.num_processes)],
                                  num_processes=spec.num_processes)
    return [sys.executable, "-m", WORKFLOW, *args]


def _status(folder: Path) -> str | None:
    try:
        return read_json(folder / "run.json").get("status")
    except (OSError, ValueError):
        return "unreadable" if folder.exists() else None


def _check_same_experiment(spec: SweepSpec, out: Path) -> None:
    """A sweep folder holds one experiment: the same preset, arguments and process count for every rank."""
    saved_file = out / "sweep.json"
    if not saved_file.is_file():
        return
    saved = read_json(saved_file)
    mine = asdict(spec)
    different = [k for k in ("preset", "args", "num_processes") if saved.get(k) != json.loads(json.dumps(mine[k]))]
    if different:
        raise UserError(
            f"The sweep in {out} was run with another {different[0]} ({saved.get(different[0])!r}); "
            "use another --out for a different experiment."
        )


def run_sweep(spec: SweepSpec, out: str | Path) -> list[dict]:
    """Train every rank of ``spec`` not yet complete in ``out``, each in its own process; returns ``load_sweep``."""
    from tqdm.auto import tqdm

    from my_utils.launch import check_process_count, clean_env, run_command

    out = Path(out)
    check_process_count(spec.num_processes)
    _check_same_experiment(spec, out)
    out.mkdir(parents=True, exist_ok=True)
    saved = read_json(out / "sweep.json")["ranks"] if (out / "sweep.json").is_file() else []
    atomic_write_json(out / "sweep.json", {**asdict(spec), "ranks": sorted(set(saved) | set(spec.ranks))})
    bar = tqdm(spec.ranks, desc="rank sweep", unit="rank", file=sys.stdout)
    for rank in bar:
        folder = rank_dir(out, rank)
        status = _status(folder)
        if status == "complete":
            bar.write(f"rank {rank}: complete in {folder}, skipped")
            continue
        if status is not None:
            moved = unique_dir(folder.with_name(f"{folder.name}.{status}"))
            folder.rename(moved)
            bar.write(f"rank {rank}: the earlier run was {status}; kept as {moved.name}, running it again")
        bar.set_postfix(rank=rank)
        # The child's own progress bars would interleave with the sweep's, so they are switched off.
        run_command(rank_command(spec, rank, folder), env=clean_env(TQDM_DISABLE=1, **STEADY_MEMORY_ENV))
    return load_sweep(out)


def load_sweep(out: str | Path) -> list[dict]:
    """One row per complete rank folder of the sweep in ``out``, ordered by rank: the figures a sweep compares."""
    rows = []
    for folder in Path(out).glob("rank_*"):
        if not folder.name.removeprefix("rank_").isdigit() or _status(folder) != "complete":
            continue
        run = load_run(folder)
        s = run["summary"]
        rows.append({
            "rank": s["rank"],
            "path": str(folder),
            "pid": run["run"].get("pid"),
            "ppid": run["run"].get("ppid"),
            "runtime_s": s["runtime_s"],
            "samples_per_s": s["samples_per_s"],
            "peak_memory_bytes": s["peak_memory_bytes"],
            "trainable_params": s["trainable_params"],
            "adapter_bytes": s["adapter_bytes"],
            "exact_match_before": s.get("exact_match_before"),
            "exact_match": s.get("exact_match_after"),
            "train_loss_final": s.get("train_loss_final"),
            "loss_curve": [(m["step"], m["loss"]) for m in run["metrics"] if "loss" in m and "step" in m],
        })
    return sorted(rows, key=lambda r: r["rank"])


def sweep_table(rows: list[dict]) -> str:
    from my_utils.compare import text_table
    from my_utils.memory import format_bytes

    def number(value, fmt):
        return "-" if value is None else fmt.format(value)

    header = ["rank", "trainable", "adapter", "peak memory", "runtime", "samples/s", "final loss", "exact match"]
    table = [[str(r["rank"]), f"{r['trainable_params']:,}", format_bytes(r["adapter_bytes"]),
              format_bytes(r["peak_memory_bytes"]), f"{r['runtime_s']:.1f} s", f"{r['samples_per_s']:.1f}",
              number(r["train_loss_final"], "{:.3f}"), number(r["exact_match"], "{:.2f}")] for r in rows]
    return text_table(header, table)


def plot_sweep(rows: list[dict], out: str | Path) -> list[Path]:
    """Two figures in ``out``: the loss curve of every rank, and each measured figure against the rank."""
    from my_utils.memory import MiB
    from my_utils.plots import new_figure, save

    out = Path(out)
    fig = new_figure(7, 4)
    ax = fig.add_subplot()
    for r in rows:
        if r["loss_curve"]:
            ax.plot(*zip(*r["loss_curve"]), marker=".", label=f"rank {r['rank']}")
    ax.set(xlabel="optimizer step", ylabel="training loss", title="loss curve per LoRA rank")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    paths = [save(fig, out / "loss_curves.png")]

    fig = new_figure(10, 6)
    # (summary key, title, unit, log scale): parameters and adapter size grow linearly with the rank, a straight
    # line of slope 1 on log-log axes
    panels = [("trainable_params", "trainable parameters", 1, True), ("adapter_bytes", "adapter file (MiB)", MiB, True),
              ("peak_memory_bytes", "peak memory (MiB)", MiB, False), ("runtime_s", "training time (s)", 1, False),
              ("samples_per_s", "samples/s", 1, False), ("exact_match", "exact match after training", 1, False)]
    ranks = [r["rank"] for r in rows]
    for ax, (key, title, unit, log) in zip(fig.subplots(2, 3).flat, panels):
        ax.plot(ranks, [r[key] / unit if r[key] is not None else float("nan") for r in rows], marker="o")
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xticks(ranks, [str(k) for k in ranks])
        ax.set(xlabel="LoRA rank", title=title)
        ax.grid(alpha=0.3)
    paths.append(save(fig, out / "rank_tradeoffs.png"))
    return paths


def tradeoffs(rows: list[dict]) -> list[str]:
    """Pros and cons of small and large ranks, each sentence computed from the measured rows."""
    from my_utils.memory import format_bytes

    if len(rows) < 2:
        return ["Only one rank finished; a trade-off needs at least two."]
    small, large = rows[0], rows[-1]
    a, b = f"rank {small['rank']}", f"rank {large['rank']}"
    sentence = (f"{b} trains {large['trainable_params'] / small['trainable_params']:.1f}x more parameters than {a} "
                f"({large['trainable_params']:,} vs {small['trainable_params']:,})")
    if small["exact_match"] is not None and large["exact_match"] is not None:
        sentence += (f" for {large['exact_match'] - small['exact_match']:+.2f} exact match "
                     f"({small['exact_match']:.2f} -> {large['exact_match']:.2f})")
    sentences = [sentence + "."]
    if small["train_loss_final"] is not None and large["train_loss_final"] is not None:
        faster = large["train_loss_final"] < small["train_loss_final"]
        sentences.append(
            f"After the same number of steps the training loss is {large['train_loss_final']:.3f} at {b} and "
            f"{small['train_loss_final']:.3f} at {a}: the larger rank "
            f"{'fitted the training data faster' if faster else 'did not fit the training data faster'}."
        )
    sentences += [
        f"The adapter file of {b} is {large['adapter_bytes'] / small['adapter_bytes']:.1f}x larger "
        f"({format_bytes(large['adapter_bytes'])} vs {format_bytes(small['adapter_bytes'])}): the cost of storing "
        "and shipping one adapter per task.",
        f"Peak memory {'grows' if large['peak_memory_bytes'] >= small['peak_memory_bytes'] else 'changes'} by "
        f"{format_bytes(large['peak_memory_bytes'] - small['peak_memory_bytes'])} "
        f"({100 * (large['peak_memory_bytes'] / small['peak_memory_bytes'] - 1):+.1f}%) from {a} to {b}: the "
        "adapter's weights, gradients and optimizer states; the frozen base model and activations dominate.",
        f"Training took {large['runtime_s'] / small['runtime_s']:.2f}x as long at {b} as at {a} "
        f"({large['runtime_s']:.1f} s vs {small['runtime_s']:.1f} s, {large['samples_per_s']:.1f} vs "
        f"{small['samples_per_s']:.1f} samples/s).",
    ]
    scored = [r for r in rows if r["exact_match"] is not None]
    if scored:
        best = max(scored, key=lambda r: (r["exact_match"], -r["rank"]))
        # the smallest rank whose quality is within 0.02 of the best: beyond it, extra rank buys little
        enough = min((r for r in scored if r["exact_match"] >= best["exact_match"] - 0.02), key=lambda r: r["rank"])
        if enough is best:
            sentences.append(f"Best exact match: rank {best['rank']} ({best['exact_match']:.2f}); no smaller rank "
                             "comes within 0.02 of it.")
        else:
            share = enough["trainable_params"] / best["trainable_params"]
            sentences.append(
                f"Best exact match: rank {best['rank']} ({best['exact_match']:.2f}); rank {enough['rank']} comes "
                f"within 0.02 of it ({enough['exact_match']:.2f}) with {share:.2f}x its trainable parameters."
            )
    return sentences


def report(out: str | Path) -> str:
    """The sweep's table and trade-off sentences as text (also written to ``out/report.md``); draws the plots."""
    rows = load_sweep(out)
    if not rows:
        raise UserError(f"No complete rank folder in {out}; run the sweep first.")
    plot_sweep(rows, out)
    text = sweep_table(rows) + "\n\n" + "\n".join(f"- {s}" for s in tradeoffs(rows))
    (Path(out) / "report.md").write_text(text + "\n", encoding="utf-8")
    return text


def parse_args(argv=None) -> tuple[SweepSpec, Path]:
    import argparse

    p = argparse.ArgumentParser(prog="python -m my_utils.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", type=Path, help="a JSON file with preset, ranks and args (the options below override it)")
    p.add_argument("--preset", help="tiny (CPU, offline), gpt2, opt-350m (default: tiny)")
    p.add_argument("--ranks", type=int, nargs="+",
                   help=f"LoRA ranks (default: {' '.join(map(str, DEFAULT_RANKS['tiny']))} on tiny, "
                   f"{' '.join(map(str, REAL_MODEL_RANKS))} otherwise)")
    p.add_argument("--out", type=Path, help="the sweep folder (default: runs/sweeps/<preset>); reuse it to resume")
    p.add_argument("--num-processes", type=int, help="processes per rank's run (accelerate launch when > 1)")
    for name, kind, text in (("max-steps", int, "optimizer steps per rank"), ("batch-size", int, "per process"),
                             ("eval-rows", int, "held-out rows for exact match"), ("max-length", int, "tokens"),
                             ("learning-rate", float, "the workflow's learning rate")):
        p.add_argument(f"--{name}", type=kind, help=text)
    p.add_argument("--random-init", action="store_true", help="random weights (offline; no quality)")
    a = p.parse_args(argv)
    spec = json.loads(a.spec.read_text(encoding="utf-8")) if a.spec else {}
    preset = a.preset or spec.get("preset", "tiny")
    args = {**DEFAULT_ARGS.get(preset, {}), **spec.get("args", {})}
    args.update({k: v for k, v in vars(a).items()
                 if k in ("max_steps", "batch_size", "eval_rows", "max_length", "learning_rate") and v is not None})
    if a.random_init:
        args["random_init"] = True
    spec = SweepSpec(preset=preset, ranks=tuple(a.ranks or spec.get("ranks", ())), args=args,
                     num_processes=a.num_processes or spec.get("num_processes", 1))
    return spec, a.out or RUNS_ROOT / "sweeps" / preset


def main(argv=None) -> None:
    spec, out = parse_args(argv)
    run_sweep(spec, out)
    print("\n" + report(out))
    print(f"\nsweep folder: {out}")


if __name__ == "__main__":
    from my_utils.cli import run_main

    run_main(main, prefix="sweep")
