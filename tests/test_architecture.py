"""docs/architecture.md names every module of the package, layer by layer, and only modules that exist: its layout
is a tree (two spaces per level under ``my_utils/``), each line a module or a folder (``name/``) and what it holds."""

import pkgutil
import re
from pathlib import Path

import my_utils

PAGE = Path(my_utils.__file__).parent.parent / "docs" / "architecture.md"
NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}


def package_tree() -> str:
    """The layout's lines from ``my_utils/`` to the next top-level folder of the repository."""
    layout = PAGE.read_text(encoding="utf-8").split("```", 2)[1]
    lines = layout[layout.index("\nmy_utils/") + 1:].splitlines()
    return "\n".join(lines[:next(i for i, line in enumerate(lines[1:], 1) if line[:1].strip())])


def documented_modules(tree: str) -> set[str]:
    """The dotted names the tree shows: a line indented by 2 x depth spaces names an entry of the folder above it;
    deeper indents continue a description."""
    names, path = set(), []
    for line in tree.splitlines()[1:]:
        match = re.match(r"( +)(\w+)(/?)(?:  |$)", line)
        if match is None or len(match.group(1)) % 2:
            continue
        depth = len(match.group(1)) // 2
        if depth > len(path) + 1:
            continue  # a description's continuation line
        path = path[:depth - 1] + [match.group(2)]
        names.add(".".join(["my_utils", *path]))
    return names


def package_modules() -> set[str]:
    return {m.name for m in pkgutil.walk_packages(my_utils.__path__, "my_utils.") if not m.name.endswith(".__main__")}


def test_the_page_names_every_module_and_only_those():
    documented, actual = documented_modules(package_tree()), package_modules()
    assert not actual - documented, f"modules missing from docs/architecture.md: {sorted(actual - documented)}"
    assert not documented - actual, f"docs/architecture.md names modules that do not exist: {sorted(documented - actual)}"


def test_the_page_counts_its_layers():
    layers = [name for name in documented_modules(package_tree()) if name.count(".") == 1
              and (Path(my_utils.__file__).parent / name.split(".")[1] / "__init__.py").is_file()]
    assert f"in {NUMBERS[len(layers)]} layers" in package_tree()


def test_the_parser_sees_a_missing_and_an_invented_module():
    tree = package_tree()
    without = "\n".join(line for line in tree.splitlines() if not line.startswith("    locks "))
    assert "my_utils.run.locks" in documented_modules(tree) and "my_utils.run.locks" not in documented_modules(without)
    invented = tree.replace("\n    locks ", "\n    lockz  nothing\n    locks ", 1)
    assert "my_utils.run.lockz" in documented_modules(invented) - package_modules()
