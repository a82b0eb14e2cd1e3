"""Where the repository keeps things: its root, the assets (the tiny preset, real presets' configs) and the results
folders."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ASSETS = REPO_ROOT / "assets"
RUNS_ROOT = REPO_ROOT / "runs"
