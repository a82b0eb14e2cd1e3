"""Quality measures: exact match and a similarity score by greedy generation, held-out loss, classification
accuracy.

Exact match is the tiny tasks' measure: the model's greedy answer to ``format_prompt(row)``, cut at the end
of sequence and stripped, must equal ``row["output"]``. The similarity score gives partial credit: a
character n-gram F-score (chrF) of the answer against the reference. It is computed by one fixed, frozen
scorer (a formula, no model), so every model and every run is scored by the same judge; scoring a model's
answers with that model itself (or with a scorer that changes between runs) would make scores incomparable.

    from my_utils.core.evaluation import answer_quality, chrf
    chrf("12 + 3 = 15", "12 + 3 = 15")   # 1.0
    answer_quality(model, tokenizer, rows)  # {"exact_match": ..., "similarity": ..., ...}
"""

from __future__ import annotations

from collections import Counter

from my_utils.core.data import format_prompt

# Recorded in every summary next to the score, so that a comparison can check that the judge was the same.
SIMILARITY_SCORER = "chrF: character 1- to 6-gram F-score, beta 2, whitespace ignored"


def generate_answers(model, tokenizer, rows, *, max_new_tokens: int = 16, batch_size: int = 32) -> list[str]:
    """Greedy answers for Alpaca-style rows (prompts left-padded so that generation continues each one)."""
    import torch

    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    answers = []
    try:
        device = next(model.parameters()).device
        for start in range(0, len(rows), batch_size):
            prompts = [format_prompt(r) for r in rows[start : start + batch_size]]
            batch = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
            with torch.no_grad():
                out = model.generate(
                    **batch,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            new_tokens = out[:, batch["input_ids"].shape[1] :]
            answers += [t.strip() for t in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]
    finally:
        tokenizer.padding_side = side
    return answers


def exact_match(model, tokenizer, rows, **kwargs) -> dict:
    """Fraction of rows whose greedy answer equals the reference output exactly (after stripping); the
    similarity score of the same answers comes with it (see ``score_answers``)."""
    return answer_quality(model, tokenizer, rows, **kwargs)


def chrf(hypothesis: str, reference: str, max_n: int = 6, beta: float = 2.0) -> float:
    """Character n-gram F-score in [0, 1] (Popovic, 2015): the mean precision and recall of the character
    1- to ``max_n``-grams of ``hypothesis`` against ``reference``, combined with recall weighted ``beta``
    times as much as precision. Whitespace is ignored. Deterministic: a formula, no model."""
    hyp, ref = "".join(hypothesis.split()), "".join(reference.split())
    if hyp == ref:
        return 1.0
    precisions, recalls = [], []
    for n in range(1, max_n + 1):
        hyp_grams = Counter(hyp[i : i + n] for i in range(len(hyp) - n + 1))
        ref_grams = Counter(ref[i : i + n] for i in range(len(ref) - n + 1))
        if not hyp_grams or not ref_grams:  # a string shorter than n has no n-grams: this order is skipped
            continue
        overlap = sum((hyp_grams & ref_grams).values())
        precisions.append(overlap / sum(hyp_grams.values()))
        recalls.append(overlap / sum(ref_grams.values()))
    if not precisions:
        return 0.0
    p, r = sum(precisions) / len(precisions), sum(recalls) / len(recalls)
    return 0.0 if p + r == 0 else (1 + beta**2) * p * r / (beta**2 * p + r)


def score_answers(answers: list[str], rows) -> dict:
    """Exact match and mean chrF similarity of ``answers`` against the rows' reference outputs."""
    if not rows:
        raise ValueError("no rows to score")
    references = [r["output"].strip() for r in rows]
    hits = [a == ref for a, ref in zip(answers, references)]
    return {
        "exact_match": sum(hits) / len(hits),
        "similarity": sum(chrf(a, ref) for a, ref in zip(answers, references)) / len(references),
        "similarity_scorer": SIMILARITY_SCORER,
        "n": len(hits),
        "examples": [{"input": format_prompt(r), "expected": r["output"], "got": a} for r, a in zip(rows[:3], answers[:3])],
    }


def answer_quality(model, tokenizer, rows, **kwargs) -> dict:
    """Greedy answers for ``rows`` scored by ``score_answers`` (exact match and similarity)."""
    return score_answers(generate_answers(model, tokenizer, rows, **kwargs), rows)


def held_out_loss(model, examples, collator, batch_size: int, autocast_dtype=None) -> float:
    """The mean loss per predicted token on held-out ``examples``: every batch's summed token loss over the number
    of tokens that carry a label, so the figure does not depend on ``batch_size`` (averaging each batch's mean, as
    ``Trainer.evaluate()`` does, weighs a token of a short batch more than one of a long batch: lesson 12's trap 1,
    in evaluation). Under autocast to ``autocast_dtype`` if given.

    It runs in this process alone (no collective), so it can measure a model before training. (Calling
    ``Trainer.evaluate()`` before ``Trainer.train()`` in a distributed run leaves the model marked as prepared by
    accelerate, which then trains it without DistributedDataParallel: every process on its own.)"""
    import torch

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = tokens = 0.0
    with torch.no_grad(), torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        for start in range(0, len(examples), batch_size):
            batch = collator([examples[i] for i in range(start, min(start + batch_size, len(examples)))])
            batch = {k: v.to(device) for k, v in batch.items()}
            # A causal LM predicts token t + 1 from tokens up to t, and averages over the labels that are not -100.
            predicted = int((batch["labels"][:, 1:] != -100).sum())
            total += float(model(**batch).loss) * predicted
            tokens += predicted
    model.train(was_training)
    return total / tokens


def accuracy(model, batches) -> float:
    """Classification accuracy over batches with ``labels``."""
    import torch

    model.eval()
    correct = seen = 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            labels = batch.pop("labels")
            predictions = model(**batch).logits.argmax(-1)
            correct += int((predictions == labels).sum())
            seen += len(labels)
    return correct / max(seen, 1)
