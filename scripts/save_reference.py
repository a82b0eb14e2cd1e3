"""Copy a results folder into ``runs/reference/`` to be committed: its records, never its weights.

    python scripts/save_reference.py runs/run_1_cpu_x2 cpu_x2     # -> runs/reference/cpu_x2/
    python scripts/save_reference.py runs/bench cpu_bench         # -> runs/reference/cpu_bench/

Kept: run.json, summary.json, metrics.jsonl, logs, tables, plots and executed notebooks (the files a comparison or a
reader needs). Left out: checkpoints and weights (``*.safetensors``, ``*.bin``, ``*.pt``) and the tokenizer copied beside each
adapter, which anyone can regenerate and which would bloat the repository. Absolute paths of the machine that ran the folder are made relative to the
repository (and the Python installation, seen in warnings, becomes ``<python>``), so the committed records name only
the project's own files; the folder's own path (``runs/run_1_cpu_x2``, printed by the lessons and kept in each
run's settings) becomes the path it is saved to, so that every path a record names exists in the repository. The
destination must not exist.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
REFERENCE = REPO_ROOT / "runs" / "reference"
KEEP = {".json", ".jsonl", ".md", ".txt", ".log", ".csv", ".png", ".svg", ".ipynb", ".yaml"}
TEXT = KEEP - {".png"}
SKIP_DIRS = ("checkpoint", "checkpoints")  # prefixes of folder names holding resumable training state
# the tokenizer saved beside each adapter: a copy of the preset's, not a record of the run
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"}
MAX_BYTES = 2 << 20  # a larger record is almost surely not one (an embedded model, a data dump)


def kept_files(source: Path) -> list[Path]:
    return sorted(p for p in source.rglob("*") if p.is_file() and p.suffix in KEEP and p.stat().st_size <= MAX_BYTES
                  and not any(part.startswith(SKIP_DIRS) for part in p.relative_to(source).parts[:-1])
                  and not (p.parent.name == "adapter" and p.name in TOKENIZER_FILES))


def save(source: Path, name: str) -> Path:
    source = source.resolve()
    if not source.is_dir():
        raise SystemExit(f"{source} is not a folder; pass a results folder such as runs/run_1_cpu_x2.")
    destination = REFERENCE / name
    if destination.exists():
        raise SystemExit(f"runs/reference/{name} exists already; choose another name or remove it first.")
    # The checkout that wrote the folder: its root prefixes the absolute paths recorded inside.
    origin = next((p for p in source.parents if (p / "my_utils").is_dir()), REPO_ROOT)
    # runs/run_1_cpu_x2 (not runs/run_1_cpu_x20) -> runs/reference/cpu_x2
    own_path = re.compile(re.escape(source.relative_to(origin).as_posix()) + r"(?![\w.-])")
    staging = REFERENCE / f".{name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for path in kept_files(source):
        target = staging / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix in TEXT:
            text = path.read_text(encoding="utf-8", errors="replace")
            for machine_path, shown in ((f"{origin}/", ""), (str(origin), "."), (sys.base_prefix, "<python>")):
                text = text.replace(machine_path, shown)
            text = own_path.sub(f"runs/reference/{name}", text)
            target.write_text(text, encoding="utf-8")
        else:
            shutil.copyfile(path, target)
    staging.rename(destination)  # all or nothing
    return destination


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, help="the results folder to copy")
    p.add_argument("name", help="its name under runs/reference/")
    args = p.parse_args()
    destination = save(args.source, args.name)
    files = sum(1 for f in destination.rglob("*") if f.is_file())
    size = sum(f.stat().st_size for f in destination.rglob("*") if f.is_file())
    print(f"{files} files, {size / 2**20:.1f} MiB -> {destination.relative_to(REPO_ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
