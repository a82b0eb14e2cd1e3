import pytest

from my_utils.core.evaluation import SIMILARITY_SCORER, chrf, score_answers


def test_chrf_identical_disjoint_and_partial():
    assert chrf("def add(a, b): return a + b", "def add(a, b): return a + b") == 1.0
    assert chrf("xyz", "abc") == 0.0
    assert chrf("", "abc") == 0.0
    partial = chrf("hello wrld", "hello world")
    assert 0.5 < partial < 1.0
    # closer answers score higher
    assert chrf("12345", "12346") > chrf("12999", "12346") > chrf("99999", "12346")


def test_chrf_ignores_whitespace_and_weights_recall():
    assert chrf("a b  c", "abc") == 1.0
    reference = "the quick brown fox"
    # a prefix of the reference (precise, incomplete) scores lower than a complete answer with extras,
    # since recall counts beta=2 times as much as precision
    assert chrf("the quick brown fox jumps", reference) > chrf("the quick", reference)


def test_chrf_known_value():
    # "ab" vs "ac": 1-grams overlap 1 of 2 (p = r = 1/2), 2-grams 0 of 1 (p = r = 0): mean p = r = 1/4
    assert chrf("ab", "ac") == pytest.approx(0.25)


def test_score_answers_exact_match_and_similarity():
    rows = [{"instruction": "Add.", "input": "2 3", "output": "5"},
            {"instruction": "Reverse.", "input": "abc", "output": " cba "}]
    scores = score_answers(["5", "cbx"], rows)
    assert scores["exact_match"] == 0.5
    assert scores["similarity"] == pytest.approx((1.0 + chrf("cbx", "cba")) / 2)
    assert scores["similarity_scorer"] == SIMILARITY_SCORER and scores["n"] == 2
    assert scores["examples"][1]["got"] == "cbx"
    with pytest.raises(ValueError):
        score_answers([], [])


def test_held_out_loss_is_what_the_trainer_reports(tmp_path):
    """The loss the workflow takes before training (without Trainer.evaluate, which would keep DDP from
    wrapping the model) is the figure evaluate() reports after training: batch by batch, uneven last batch too."""
    from transformers import Trainer, TrainingArguments

    from my_utils.core.data import load_instructions, padding_collator, tokenize_instructions
    from my_utils.core.evaluation import held_out_loss
    from my_utils.core.models import build_causal_lm, load_tokenizer
    from my_utils.core.presets import get_preset

    preset = get_preset("tiny")
    tokenizer, model = load_tokenizer(preset), build_causal_lm(preset)
    _, rows = load_instructions("tiny", eval_rows=20)
    examples = tokenize_instructions(rows, tokenizer, 128)
    ours = held_out_loss(model, examples, padding_collator(tokenizer), batch_size=8)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=8, report_to="none", use_cpu=True)
    theirs = Trainer(model=model, args=args, eval_dataset=examples,
                     data_collator=padding_collator(tokenizer)).evaluate()["eval_loss"]
    assert ours == pytest.approx(theirs, rel=1e-5)
