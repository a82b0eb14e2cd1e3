"""The verifiable rewards GRPO trains on: full credit for the reference answer only, partial credit by chrF, and a
reward that does not exist refused in one sentence."""

import json

import pytest

from my_utils import UserError
from my_utils.core.paths import ASSETS
from my_utils.core.rewards import REWARDS, reward_function


def test_the_reference_answer_earns_full_credit_and_a_corruption_less():
    pairs = [json.loads(line) for line in (ASSETS / "tiny" / "data" / "preferences_eval.jsonl").read_text()
             .splitlines()]
    chosen, rejected, reference = ([p[k] for p in pairs] for k in ("chosen", "rejected", "chosen"))
    assert reward_function("exact_match")([f" {c}\n" for c in chosen], output=reference) == [1.0] * len(pairs)
    assert reward_function("exact_match")(rejected, output=reference) == [0.0] * len(pairs)
    partial = reward_function("similarity")(rejected, output=reference, prompts=["ignored"] * len(pairs))
    assert reward_function("similarity")(chosen, output=reference) == [1.0] * len(pairs)
    assert all(0.0 <= r < 1.0 for r in partial) and max(partial) > 0.5  # a near miss earns some credit


def test_a_reward_that_does_not_exist_is_one_sentence():
    with pytest.raises(UserError) as e:
        reward_function("bleu")
    assert str(e.value) == f"There is no reward called 'bleu'; choose one of {', '.join(REWARDS)}."
    with pytest.raises(ValueError):  # a completion without its reference is a bug, not a zero
        reward_function("exact_match")(["4", "5"], output=["4"])
