"""``import my_utils`` (and every helper module) must not import the launch-unsafe libraries or touch CUDA:
otherwise notebook_launcher refuses to start several processes after a plain helper import."""

import pkgutil
import subprocess
import sys

import my_utils

MODULES = sorted(m.name for m in pkgutil.walk_packages(my_utils.__path__, "my_utils.") if m.name != "my_utils.__main__")
FORBIDDEN = ("peft", "trl", "bitsandbytes", "transformers.trainer", "datasets")


def test_every_module_is_listed():
    assert {"my_utils.core.printing", "my_utils.run.results", "my_utils.workflows.lora", "my_utils.run.launch"} <= set(MODULES)


def test_importing_helpers_imports_nothing_heavy(subprocess_env):
    code = (
        "import sys, importlib\n"
        f"for name in {MODULES!r}: importlib.import_module(name)\n"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
        "torch = sys.modules.get('torch')\n"
        "cuda = bool(torch and torch.cuda.is_initialized())\n"
        "print(bad, cuda)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] False", out.stdout + out.stderr
