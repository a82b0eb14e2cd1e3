"""A workflow's settings: one dataclass, from which the command line and its one-sentence errors are made."""

from __future__ import annotations

import math

from my_utils import UserError


def check_positive(name: str, value, kind=int) -> None:
    """One sentence for a count or size that is not a positive (finite) number."""
    number_types = (int, float) if kind is float else int
    if (isinstance(value, bool) or not isinstance(value, number_types) or not math.isfinite(value)
            or value <= 0):
        raise UserError(f"{name} must be a positive {'number' if kind is float else 'integer'}, got {value!r}.")


