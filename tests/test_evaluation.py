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


def test_held_out_loss_weights_tokens_and_not_the_evaluation_batch(tmp_path):
    """The same weights give the same held-out loss at 1 x 16 and 4 x 4 (the mean over every predicted token),
    where the Trainer's figure (the mean of per-batch means) moves with the batch: lesson 12's trap 1."""
    import torch
    from transformers import Trainer, TrainingArguments

    from my_utils.core.data import load_instructions, padding_collator, tokenize_instructions
    from my_utils.core.evaluation import held_out_loss
    from my_utils.core.models import build_causal_lm, load_tokenizer
    from my_utils.core.presets import get_preset

    preset = get_preset("tiny")
    tokenizer, model = load_tokenizer(preset), build_causal_lm(preset)
    _, rows = load_instructions("tiny", eval_rows=16)
    examples = tokenize_instructions(rows, tokenizer, 128)
    collator = padding_collator(tokenizer)
    whole, by_four = (held_out_loss(model, examples, collator, batch_size=b) for b in (16, 4))
    assert whole == pytest.approx(by_four, rel=1e-5)

    # The figure itself: every labelled token's loss, summed one example at a time, over the count of such tokens.
    total = count = 0
    with torch.no_grad():
        for example in examples:
            batch = collator([example])
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[0, :-1]
            labels = batch["labels"][0, 1:]
            total += float(torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
    assert whole == pytest.approx(total / count, rel=1e-5)

    def trainers_figure(batch_size):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=batch_size, report_to="none",
                                 use_cpu=True)
        return Trainer(model=model, args=args, eval_dataset=examples, data_collator=collator).evaluate()["eval_loss"]

    assert abs(trainers_figure(4) - trainers_figure(16)) > 1e-3  # the trap this loss avoids, present in the Trainer
