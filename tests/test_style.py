"""The code, tests, scripts and lessons pass ruff with the project's configuration (pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

from my_utils.core.paths import REPO_ROOT


def test_ruff_passes():
    ruff = Path(sys.executable).with_name("ruff")  # the linter's own program, installed beside this Python
    proc = subprocess.run([str(ruff), "check", "."], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
