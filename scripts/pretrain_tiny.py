"""Pretrain the two tiny models of the ``tiny`` preset on CPU, from scratch, in a few minutes.

* ``assets/tiny/causal_lm/``: a 4-layer GPT-2 (``GPT2LMHeadModel``) trained with next-token prediction on the rows
  of ``pretrain.jsonl``, each formatted with ``my_utils.core.data.format_example(row, eos_token)``. It never sees the
  held-out families of ``instructions_*.jsonl``; the fine-tuning lessons teach it those.
* ``assets/tiny/encoder/``: a small RoBERTa trained on the same instruction text plus the classification training
  sentences (never their labels) with two objectives: masked-language modelling, and a bag of words at ``<s>``: the
  output at the first token predicts which words its text contains, rare words weighted up. A classification head
  reads that output, so pretraining makes it summarise the sentence, as a large pretrained encoder's does; with
  masked-language modelling alone it stays uninformative and LoRA cannot learn the classification lesson's task in
  its step budget. Only the encoder ships (``RobertaModel``): the pretraining head is dropped, so loading it as a
  classifier reports just the new classification head.

Each folder holds ``config.json``, ``model.safetensors`` (fp32), ``generation_config.json`` for the causal LM, the
tokenizer files (the encoder's copy wraps each text in ``<s> ... </s>``, the causal LM's adds nothing) and
``pretrain_log.json`` (the command, seed, hyper-parameters, loss curve, final loss, wall time, parameter count).
Training is deterministic for a given seed and thread count; the shipped models were trained with one thread, the
default (about three minutes for the encoder, sixteen for the causal LM).

Run from the repository root, after ``scripts/make_tiny_data.py`` and ``scripts/train_tiny_tokenizer.py``::

    python scripts/pretrain_tiny.py                  # both models, as shipped
    python scripts/pretrain_tiny.py --only encoder   # one of them
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, RobertaConfig, RobertaForMaskedLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from my_utils.core.data import (  # noqa: E402
    CLASSIFICATION_COLUMNS,
    INSTRUCTION_COLUMNS,
    format_example,
    read_jsonl,
)

TINY = ROOT / "assets" / "tiny"
SEED = 0
LOG_EVERY = 25  # steps per point of the recorded loss curve
GROUP = 50  # batches per length-sorted group

CAUSAL = {  # GPT-2 architecture and training recipe
    # No dropout: the models see each text only a few times, so it would only slow learning (here and when fine-tuned).
    "config": {"n_layer": 4, "n_head": 4, "n_embd": 192, "n_positions": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
               "attn_pdrop": 0.0},
    "steps": 2400,
    "batch_size": 32,
    "lr": 2e-3,
    "warmup": 100,
}
ENCODER = {  # RoBERTa architecture and masked-LM + bag-of-words recipe
    # RoBERTa's default dropout (0.1) is kept for pretraining; the classification lesson turns it off.
    "config": {"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 128, "intermediate_size": 512},
    "max_length": 128,
    "steps": 1000,
    "batch_size": 32,
    "lr": 1e-3,
    "warmup": 100,
    "mask_probability": 0.15,
    "classification_repeats": 4,  # the 2,000 classification sentences are short: show each one this many times
    # The bag of words at <s>: its loss is added with this weight, and each word counts idf**power (its inverse
    # document frequency, raised), so the rare words that tell texts apart, such as a sentence's topic words,
    # dominate and words in every text (<s>, </s>) count for nothing. Measured on lesson 11's task after 150 steps:
    # with weight 1 and plain idf, <s> stays as uninformative as with masked-LM alone and LoRA stays at chance; with
    # these values LoRA ends about 0.03 below full fine-tuning.
    "bag_of_words_weight": 3.0,
    "bag_of_words_idf_power": 4,
}


def lr_lambda(warmup: int, steps: int):
    """Linear warm-up, then cosine decay to 10% of the peak learning rate."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def batches(lengths: list[int], batch_size: int, steps: int, generator: torch.Generator):
    """``steps`` batches of example indices, grouped by length so that little padding is computed.

    Each epoch is shuffled and cut into runs of GROUP batches; a run is sorted by length, cut into batches, and
    its batches are served in random order (the idea of ``group_by_length`` in transformers' Trainer).
    """
    served = 0
    while True:
        order = torch.randperm(len(lengths), generator=generator).tolist()
        for start in range(0, len(order), batch_size * GROUP):
            run = sorted(order[start : start + batch_size * GROUP], key=lengths.__getitem__)
            group = [run[i : i + batch_size] for i in range(0, len(run), batch_size)]
            for j in torch.randperm(len(group), generator=generator).tolist():
                if served == steps:
                    return
                served += 1
                yield group[j]


def pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token id lists into (input_ids, attention_mask)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def mask_tokens(ids: torch.Tensor, attention: torch.Tensor, tokenizer, probability: float, generator: torch.Generator):
    """BERT masking: pick ``probability`` of the real tokens; 80% become <mask>, 10% random, 10% unchanged."""
    special = torch.tensor(tokenizer.all_special_ids)
    candidates = attention.bool() & ~torch.isin(ids, special)
    chosen = candidates & (torch.rand(ids.shape, generator=generator) < probability)
    labels = torch.where(chosen, ids, -100)
    roll = torch.rand(ids.shape, generator=generator)
    inputs = ids.clone()
    inputs[chosen & (roll < 0.8)] = tokenizer.mask_token_id
    random_tokens = torch.randint(len(special), len(tokenizer), ids.shape, generator=generator)
    replace = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[replace] = random_tokens[replace]
    return inputs, labels


def bag_of_words_loss(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Cross-entropy between the vocabulary distribution ``logits`` (one row per text) and the text's own tokens
    ``ids``, each occurrence counted with its weight (``weights``, the same shape as ``ids``)."""
    counts = torch.zeros_like(logits).scatter_add_(1, ids, weights)
    target = counts / counts.sum(1, keepdim=True)
    return -(target * logits.log_softmax(-1)).sum(-1).mean()


def train(model, batch_loss, lengths: list[int], recipe: dict, desc: str) -> dict:
    """Run AdamW with warm-up + cosine decay on ``batch_loss(indices, generator)``; return the loss curve, final
    loss and wall time."""
    generator = torch.Generator().manual_seed(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=0.01, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(recipe["warmup"], recipe["steps"]))
    model.train()
    curve, window = [], []
    start = time.perf_counter()
    progress = tqdm(batches(lengths, recipe["batch_size"], recipe["steps"], generator), total=recipe["steps"], desc=desc)
    for step, batch in enumerate(progress, start=1):
        loss = batch_loss(batch, generator)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window.append(loss.item())
        if step % LOG_EVERY == 0 or step == recipe["steps"]:
            curve.append({"step": step, "loss": round(sum(window) / len(window), 4)})
            progress.set_postfix(loss=f"{curve[-1]['loss']:.3f}")
            window = []
    return {"final_loss": curve[-1]["loss"], "wall_time_s": round(time.perf_counter() - start, 1), "loss_curve": curve}


def save(model, tokenizer, folder: Path, recipe: dict, result: dict, n_texts: int) -> None:
    """Save weights (safetensors), tokenizer and the training log into ``folder``."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    log = {
        "command": " ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "model_class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seed": SEED,
        "training_texts": n_texts,
        "recipe": recipe,
        "final_loss": result["final_loss"],
        "wall_time_s": result["wall_time_s"],
        "threads": torch.get_num_threads(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__},
        "loss_curve": result["loss_curve"],
    }
    (folder / "pretrain_log.json").write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
    print(f"{folder.name}: {log['parameters']:,} parameters, final loss {log['final_loss']}, {log['wall_time_s']} s")


def pretrain_causal(data: Path, tokenizer_dir: Path, out: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = read_jsonl(data / "pretrain.jsonl", INSTRUCTION_COLUMNS)
    cfg = CAUSAL["config"]
    texts = [format_example(row, tokenizer.eos_token) for row in rows]
    encoded = tokenizer(texts, truncation=True, max_length=cfg["n_positions"])["input_ids"]
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tokenizer), **cfg,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))

    def batch_loss(batch, generator):
        ids, mask = pad([encoded[i] for i in batch], tokenizer.pad_token_id)
        return model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss

    result = train(model, batch_loss, [len(ids) for ids in encoded], CAUSAL, "causal LM")
    save(model, tokenizer, out, CAUSAL, result, len(texts))


def pretrain_encoder(data: Path, tokenizer_dir: Path, out: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(
        tokenizer_dir, add_bos_token=True, add_eos_token=True, model_max_length=ENCODER["max_length"],
        cls_token="<s>", sep_token="</s>",  # RoBERTa convention: the sentence is wrapped in <s> ... </s>
    )
    rows = read_jsonl(data / "pretrain.jsonl", INSTRUCTION_COLUMNS)
    sentences = [row["text"] for row in read_jsonl(data / "classification_train.jsonl", CLASSIFICATION_COLUMNS)]
    texts = [format_example(row) for row in rows] + sentences * ENCODER["classification_repeats"]
    encoded = tokenizer(texts, truncation=True, max_length=ENCODER["max_length"])["input_ids"]
    torch.manual_seed(SEED)
    model = RobertaForMaskedLM(RobertaConfig(
        vocab_size=len(tokenizer), **ENCODER["config"],
        max_position_embeddings=ENCODER["max_length"] + tokenizer.pad_token_id + 1,  # RoBERTa positions start after pad
        type_vocab_size=1,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))

    documents = torch.zeros(len(tokenizer))  # texts that contain each token
    for ids in encoded:
        documents[list(set(ids))] += 1
    word_weight = torch.log(len(encoded) / documents.clamp(min=1)) ** ENCODER["bag_of_words_idf_power"]

    def batch_loss(batch, generator):
        ids, mask = pad([encoded[i] for i in batch], tokenizer.pad_token_id)
        inputs, labels = mask_tokens(ids, mask, tokenizer, ENCODER["mask_probability"], generator)
        out = model(input_ids=inputs, attention_mask=mask, labels=labels, output_hidden_states=True)
        bag = bag_of_words_loss(model.lm_head(out.hidden_states[-1][:, 0]), ids, word_weight[ids] * mask)
        return out.loss + ENCODER["bag_of_words_weight"] * bag

    result = train(model, batch_loss, [len(ids) for ids in encoded], ENCODER, "encoder MLM + bag of words")
    save(model.roberta, tokenizer, out, ENCODER, result, len(texts))  # the encoder, without the pretraining head


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0]
        + " Trains a GPT-2 causal LM on the pretraining instruction families and a RoBERTa encoder with masked-LM"
        " and a bag of words at <s>,"
        " then saves each with its tokenizer and a pretrain_log.json.",
    )
    parser.add_argument("--only", choices=["causal", "encoder"], help="train just one of the two models")
    parser.add_argument("--data", type=Path, default=TINY / "data", help="folder with the generated data")
    parser.add_argument("--tokenizer", type=Path, default=TINY / "tokenizer", help="folder with the trained tokenizer")
    parser.add_argument("--out", type=Path, default=TINY, help="parent folder of causal_lm/ and encoder/")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (results depend on it; the shipped models were trained with 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.only in (None, "causal"):
        pretrain_causal(args.data, args.tokenizer, args.out / "causal_lm")
    if args.only in (None, "encoder"):
        pretrain_encoder(args.data, args.tokenizer, args.out / "encoder")


if __name__ == "__main__":
    main()
