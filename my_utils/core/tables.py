"""Tables as text: aligned columns for a terminal or a notebook, and Markdown for the README.

    from my_utils.core.tables import text_table
    print(text_table(["run", "loss"], [["lora_x1", "1.21"], ["lora_x2", "1.10"]]))
"""

from __future__ import annotations

TERMINAL_WIDTH = 160  # the text tables fit it: the run column is shortened in the middle when they would not


def text_table(header: list[str], rows: list[list[str]], width: int = TERMINAL_WIDTH) -> str:
    """Aligned columns, at most ``width`` characters a line: a first column (the run) too long for that is
    shortened in the middle, keeping both ends of each name."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    room = width - (sum(widths[1:]) + 2 * (len(widths) - 1))
    if widths[0] > room:
        widths[0] = max(room, len(header[0]), 12)
        rows = [[_shorten(r[0], widths[0]), *r[1:]] for r in rows]
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
