"""Verifiable rewards for generated answers (GRPO), against the reference answer of each instruction row: no
model judges them, a formula does. Each takes what trl's ``GRPOTrainer`` passes to a reward function (the
completions, and the dataset's other columns by name: here ``output``, the reference) and returns one float per
completion."""

from __future__ import annotations

from my_utils import UserError
from my_utils.core.evaluation import chrf


def exact_match(completions: list[str], output: list[str], **_) -> list[float]:
    """1.0 where the completion, stripped, is the reference answer, else 0.0."""
    return [float(c.strip() == o.strip()) for c, o in zip(completions, output, strict=True)]


def similarity(completions: list[str], output: list[str], **_) -> list[float]:
    """chrF of each completion against its reference (``evaluation.chrf``, in [0, 1]): partial credit."""
    return [chrf(c.strip(), o.strip()) for c, o in zip(completions, output, strict=True)]


REWARDS = {"exact_match": exact_match, "similarity": similarity}


def reward_function(name: str):
    """The reward called ``name``; one sentence listing the others if there is none."""
    if name not in REWARDS:
        raise UserError(f"There is no reward called {name!r}; choose one of {', '.join(REWARDS)}.")
    return REWARDS[name]
