"""Code a lesson shows from a module, by marked region, so rewording a comment never breaks a lesson::

    # region: the training step
    ...
    # endregion

    from my_utils.core.source import show_region
    show_region("my_utils.workflows.ddp", "the training step")   # prints those lines, dedented

``tests/test_notebooks.py`` checks that every region a notebook names exists.
"""

from __future__ import annotations

import importlib.util
import re
import textwrap

from my_utils import UserError

START = re.compile(r"^\s*# region: (.+?)\s*$")
END = re.compile(r"^\s*# endregion\s*$")


def _lines(module: str) -> list[str]:
    spec = importlib.util.find_spec(module)  # the file only: showing code must not import (and run) the module
    if spec is None or not spec.origin:
        raise UserError(f"There is no module {module!r}; check the name.")
    with open(spec.origin, encoding="utf-8") as f:
        return f.read().splitlines()


def regions(module: str) -> dict[str, str]:
    """Every marked region of ``module``: its name -> its lines (markers left out, dedented)."""
    found, name, body = {}, None, []
    for line in _lines(module):
        if name is None and (start := START.match(line)):
            name, body = start.group(1), []
        elif name is not None and END.match(line):
            found[name] = textwrap.dedent("\n".join(body))
            name = None
        elif name is not None:
            body.append(line)
    return found


def region(module: str, name: str) -> str:
    """The lines of the region ``name`` in ``module``."""
    found = regions(module)
    if name not in found:
        raise UserError(f"{module} has no region {name!r}; it has: {', '.join(found) or 'none'}.")
    return found[name]


def show_region(module: str, name: str) -> None:
    """Print the region ``name`` of ``module``, as a lesson shows code."""
    print(region(module, name))
