"""Quality measures: exact match by greedy generation, eval loss and perplexity, classification accuracy.

Exact match is the tiny tasks' measure: the model's greedy answer to ``format_prompt(row)``, cut at the end
of sequence and stripped, must equal ``row["output"]``.
"""

from __future__ import annotations

import math

from my_utils.data import format_prompt


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
    """Fraction of rows whose greedy answer equals the reference output exactly (after stripping)."""
    answers = generate_answers(model, tokenizer, rows, **kwargs)
    hits = [a == r["output"].strip() for a, r in zip(answers, rows)]
    return {
        "exact_match": sum(hits) / len(hits),
        "n": len(hits),
        "examples": [{"input": format_prompt(r), "expected": r["output"], "got": a} for r, a in zip(rows[:3], answers[:3])],
    }


def eval_loss(model, batches) -> dict:
    """Mean token-level loss (and its perplexity) over batches that carry ``labels``."""
    import torch

    model.eval()
    total = tokens = 0.0
    device = next(model.parameters()).device
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            n = int((batch["labels"][:, 1:] != -100).sum())
            total += float(model(**batch).loss) * n
            tokens += n
    loss = total / max(tokens, 1)
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50))}


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
