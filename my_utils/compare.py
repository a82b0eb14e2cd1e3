"""Compare results folders: tables (text and markdown) built only from complete runs.

    python -m my_utils compare runs/run_1_cpu_x2

Folders whose status is not 'complete' are listed as such and never enter a table.
"""

from __future__ import annotations

from pathlib import Path

from my_utils.memory import format_bytes
from my_utils.runs import find_run_dirs, load_run

# (column title, summary key, formatter)
COLUMNS = (
    ("run", None, str),
    ("method", "method", str),
    ("procs", "world_size", str),
    ("steps", "steps", str),
    ("loss", "train_loss_final", lambda v: f"{v:.3f}"),
    ("exact match", None, str),
    ("runtime", "runtime_s", lambda v: f"{v:.1f} s"),
    ("samples/s", "samples_per_s", lambda v: f"{v:.1f}"),
    ("peak mem", "peak_memory_bytes", format_bytes),
    ("trainable", "trainable_params", lambda v: f"{v:,}"),
)


def load_runs(*paths) -> tuple[list[dict], list[dict]]:
    """(complete runs, other runs) found at or below ``paths``."""
    complete, other = [], []
    for d in find_run_dirs(*paths):
        run = load_run(d)
        (complete if run["run"].get("status") == "complete" and run["summary"] else other).append(run)
    return complete, other


def summary_rows(runs: list[dict], root: Path | None = None) -> list[list[str]]:
    rows = []
    for run in runs:
        s = run["summary"]
        name = str(Path(run["path"]).relative_to(root)) if root else run["path"]
        row = []
        for title, key, fmt in COLUMNS:
            if title == "run":
                row.append(name)
            elif title == "exact match":
                b, a = s.get("exact_match_before"), s.get("exact_match_after")
                row.append(f"{b:.2f} -> {a:.2f}" if b is not None and a is not None else "-")
            else:
                value = s.get(key)
                row.append("-" if value is None else fmt(value))
        rows.append(row)
    return rows


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(r) + " |" for r in rows)])


def overview(*paths, root: Path | None = None, markdown: bool = False) -> str:
    """The table of every complete run under ``paths``, and a list of the incomplete ones."""
    complete, other = load_runs(*paths)
    header = [c[0] for c in COLUMNS]
    table = (markdown_table if markdown else text_table)(header, summary_rows(complete, root))
    notes = [f"not compared ({r['run'].get('status')}): {r['path']}" for r in other]
    return "\n".join([table, *notes])


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m my_utils compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="results folders, or folders that contain them")
    p.add_argument("--markdown", action="store_true", help="print markdown tables (for the README)")
    args = p.parse_args(argv)
    missing = [x for x in args.paths if not Path(x).exists()]
    if missing:
        from my_utils import UserError

        raise UserError(f"{missing[0]} does not exist; pass results folders such as runs/run_1_cpu_x2.")
    print(overview(*args.paths, markdown=args.markdown))
