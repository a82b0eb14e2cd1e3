"""``import my_utils`` (and every helper module) must not import the launch-unsafe libraries or touch CUDA:
otherwise notebook_launcher refuses to start several processes after a plain helper import."""

import pkgutil
import subprocess
import sys

import pytest

import my_utils

MODULES = sorted(m.name for m in pkgutil.walk_packages(my_utils.__path__, "my_utils.") if not m.name.endswith(".__main__"))
FORBIDDEN = ("peft", "trl", "bitsandbytes", "transformers.trainer", "datasets")


def test_every_module_is_listed():
    assert {"my_utils.core.printing", "my_utils.run.results", "my_utils.workflows.lora", "my_utils.run.launch"} <= set(MODULES)


@pytest.mark.slow
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


def documented_layers() -> list[str]:
    """The package's layers in the order docs/architecture.md lists them (its layout: ``  core/  ...`` under
    ``my_utils/``), the order its import rule speaks of: a layer imports only the layers listed before it."""
    import re
    from pathlib import Path

    page = (Path(my_utils.__file__).parent.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    layout = page.split("```", 2)[1]
    assert "a layer imports only the layers listed before it" in layout
    return re.findall(r"^  (\w+)/ ", layout, re.M)


def test_the_documented_layers_are_the_packages():
    from pathlib import Path

    root = Path(my_utils.__file__).parent
    assert sorted(documented_layers()) == sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file())


def test_layers_import_only_downwards():
    """Each layer imports none of the layers docs/architecture.md lists after it (core nothing of run, workflows or
    tools, and so on; a docstring may name them)."""
    import ast
    from pathlib import Path

    root = Path(my_utils.__file__).parent
    layers = documented_layers()
    above = {layer: tuple(f"my_utils.{later}" for later in layers[i + 1:]) for i, layer in enumerate(layers)}
    for layer, forbidden in above.items():
        if not forbidden:
            continue
        for path in (root / layer).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                         else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                for name in names:
                    assert not name.startswith(forbidden), f"{layer}/{path.name} imports {name}, a layer above it"


def test_no_import_cycle_inside_a_layer():
    """Within each layer, no module imports (at the top or inside a function) a module that leads back to it: each
    layer reads in one direction too."""
    import ast
    from pathlib import Path

    root = Path(my_utils.__file__).parent
    for layer in documented_layers():
        prefix = f"my_utils.{layer}."
        imports = {}
        for path in (root / layer).rglob("*.py"):
            names = set()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(prefix):
                    names.add(node.module)
                elif isinstance(node, ast.Import):
                    names |= {a.name for a in node.names if a.name.startswith(prefix)}
            module = prefix + ".".join(path.relative_to(root / layer).with_suffix("").parts)
            imports[module.removesuffix(".__init__")] = names - {module}

        def reaches(start, seen):  # every module reachable from start
            for name in imports.get(start, ()):
                if name not in seen:
                    seen.add(name)
                    reaches(name, seen)
            return seen

        cycles = [m for m in imports if m in reaches(m, set())]
        assert not cycles, f"{layer}: these modules import their way back to themselves: {sorted(cycles)}"
