"""Test settings: offline before anything imports the hub client, and fixtures shared by the tests."""

import os
import sys
from pathlib import Path

# Read at import time by huggingface_hub and datasets, so it must be set before any test imports them.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("MPLBACKEND", "Agg")

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import pytest  # noqa: E402


@pytest.fixture
def subprocess_env(tmp_path):
    """Environment for a launched job: the repo importable, offline, one thread per process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["HF_HOME"] = str(tmp_path / "hf_home")  # no stray user accelerate config
    return env
