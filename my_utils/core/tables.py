"""Tables as text: aligned columns for a terminal or a notebook, and Markdown for the README.

    from my_utils.core.tables import text_table
    print(text_table(["run", "loss"], [["lora_x1", "1.21"], ["lora_x2", "1.10"]]))
"""

from __future__ import annotations

TERMINAL_WIDTH = 120  # the text tables fit it: their name columns are shortened in the middle when they would not
NARROWEST = 12  # a column is never shortened below this


def text_table(header: list[str], rows: list[list[str]], width: int = TERMINAL_WIDTH, names=(0,)) -> str:
    """Aligned columns, at most ``width`` characters a line where shortening the ``names`` columns (a run's name, a
    group's; the first by default) can make it so: while the table is too wide, the widest of them loses a
    character, down to ``NARROWEST``. A shortened cell keeps both of its ends; the other columns stay whole."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    while sum(widths) + 2 * (len(widths) - 1) > width and max(widths[i] for i in names) > NARROWEST:
        widest = max(names, key=lambda i: widths[i])
        widths[widest] -= 1
    header = [_shorten(h, w) for h, w in zip(header, widths)]
    rows = [[_shorten(c, w) for c, w in zip(r, widths)] for r in rows]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _shorten(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    escape = lambda c: c.replace("|", "\\|")  # noqa: E731
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(map(escape, r)) + " |" for r in rows)])
