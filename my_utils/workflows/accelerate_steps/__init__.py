"""A plain PyTorch loop turned into an accelerate loop, one feature per step (lesson 03).

| step | file                      | adds                                                               |
| ---- | ------------------------- | ------------------------------------------------------------------ |
| 1    | step1_base.py             | a plain loop on one device                                         |
| 2    | step2_prepare.py          | ``Accelerator``, ``prepare``, ``backward``, ``gather``             |
| 3    | step3_mixed_precision.py  | ``mixed_precision=`` (autocast)                                    |
| 4    | step4_accumulate.py       | ``gradient_accumulation_steps=`` and ``accelerator.accumulate``    |
| 5    | step5_checkpoint.py       | ``save_state`` / ``load_state`` and skipping seen batches          |
| 6    | step6_tracking.py         | ``log_with=``, ``init_trackers``, ``log``, ``end_training``        |

Each file has the same functions; the lines a step adds or changes sit under a ``# New Code # <feature>`` marker,
so that ``diff`` between two neighbouring steps shows that feature and nothing else (tests check it). Print the
diffs with::

    python -c "from my_utils.workflows.accelerate_steps import step_diff; print(step_diff('step2_prepare'))"

Every step runs alone or launched on several processes::

    python -m my_utils.workflows.accelerate_steps.step1_base --preset tiny
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.accelerate_steps.step6_tracking --preset tiny
"""

from __future__ import annotations

import ast
import difflib
from pathlib import Path

# (module name, the feature tag its markers carry)
STEPS = (
    ("step1_base", None),
    ("step2_prepare", "prepare"),
    ("step3_mixed_precision", "mixed precision"),
    ("step4_accumulate", "gradient accumulation"),
    ("step5_checkpoint", "checkpointing"),
    ("step6_tracking", "tracking"),
)
MARKER = "# New Code #"
HERE = Path(__file__).resolve().parent


def step_names() -> list[str]:
    return [name for name, _ in STEPS]


def step_code(name: str) -> list[str]:
    """The lines of a step's file after its module docstring (the docstring describes the step, so it differs)."""
    text = (HERE / f"{name}.py").read_text(encoding="utf-8")
    first = ast.parse(text).body[0]
    start = first.end_lineno if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else 0
    return text.splitlines()[start:]


def previous_step(name: str) -> str:
    names = step_names()
    index = names.index(name)
    if index == 0:
        raise ValueError(f"{name} is the first step; it has no previous step.")
    return names[index - 1]


def step_diff(name: str, context: int = 2) -> str:
    """The unified diff from the previous step to ``name`` (code only)."""
    before = previous_step(name)
    return "\n".join(difflib.unified_diff(step_code(before), step_code(name), f"{before}.py", f"{name}.py",
                                          n=context, lineterm=""))


def marker_tag(line: str) -> str | None:
    """The feature named by a ``# New Code # <feature>`` line, or None for any other line."""
    stripped = line.strip()
    return stripped[len(MARKER):].strip() if stripped.startswith(MARKER) else None


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def owners(lines: list[str]) -> list[set[str]]:
    """For each line, the features whose marked block contains it. A block starts at a marker and runs until the
    first blank line or the first line indented less than the marker; blocks nest."""
    owned = [set() for _ in lines]
    for i, line in enumerate(lines):
        tag = marker_tag(line)
        if tag is None:
            continue
        owned[i].add(tag)
        for j in range(i + 1, len(lines)):
            if not lines[j].strip() or _indent(lines[j]) < _indent(line):
                break
            owned[j].add(tag)
    return owned


def unmarked_changes(before: list[str], after: list[str], tag: str) -> list[str]:
    """Problems with ``after`` as the step after ``before``: every changed region must consist of lines inside a
    block marked ``# New Code # <tag>`` (a removal must be replaced by such lines), and the step must add at least
    one marker of its own. Returns one sentence per problem (empty when the step is clean)."""
    problems = []
    if any(marker_tag(line) == tag for line in before):
        problems.append(f"the previous step already has '{MARKER} {tag}' markers")
    if not any(marker_tag(line) == tag for line in after):
        problems.append(f"no '{MARKER} {tag}' marker")
    owned = owners(after)
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        changed = [j for j in range(j1, j2) if after[j].strip()]
        if not changed:
            problems.append(f"lines {i1 + 1}-{i2} of the previous step are removed without a marked replacement")
        for j in changed:
            if tag not in owned[j]:
                problems.append(f"line {j + 1} {after[j].strip()!r} is changed outside a '{MARKER} {tag}' block")
    return problems
