"""Rebuild every asset of the ``tiny`` preset from scratch, offline, in about twenty minutes on a CPU.

Run from the repository root::

    python scripts/build_tiny_assets.py

It runs, in order and stopping at the first failure:

1. ``scripts/make_tiny_data.py``       -> assets/tiny/data/      (synthetic instruction and classification data)
2. ``scripts/train_tiny_tokenizer.py`` -> assets/tiny/tokenizer/ (byte-level BPE tokenizer)
3. ``scripts/pretrain_tiny.py``        -> assets/tiny/causal_lm/ and assets/tiny/encoder/ (pretrained models)

Every step is deterministic, so a rebuild reproduces the committed data and tokenizer exactly and the models up to
floating-point differences between machines.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
STEPS = ["make_tiny_data.py", "train_tiny_tokenizer.py", "pretrain_tiny.py"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Steps: " + ", ".join(STEPS))
    parser.parse_args()
    for number, script in enumerate(STEPS, start=1):
        print(f"[{number}/{len(STEPS)}] python scripts/{script}", flush=True)
        subprocess.run([sys.executable, str(SCRIPTS / script)], check=True, cwd=SCRIPTS.parent)


if __name__ == "__main__":
    main()
