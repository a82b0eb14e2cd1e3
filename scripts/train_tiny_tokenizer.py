"""Train the byte-level BPE tokenizer of the ``tiny`` preset on all of its generated text.

Digits are split one per token so that the models can learn arithmetic digit by digit. The tokenizer is saved as
a ``PreTrainedTokenizerFast``, so ``AutoTokenizer.from_pretrained("assets/tiny/tokenizer")`` works offline. Its
special tokens follow RoBERTa: ``<s>`` (bos, cls) = 0, ``<pad>`` = 1, ``</s>`` (eos, sep) = 2, ``<unk>`` = 3,
``<mask>`` = 4. Like GPT-2's tokenizer it adds no special tokens when encoding; the encoder's copy
(written by ``scripts/pretrain_tiny.py``) adds ``<s> ... </s>`` around each text.

Run from the repository root, after ``scripts/make_tiny_data.py``::

    python scripts/train_tiny_tokenizer.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from my_utils.core.data import (  # noqa: E402
    CLASSIFICATION_COLUMNS,
    INSTRUCTION_COLUMNS,
    format_example,
    read_jsonl,
)

DEFAULT_DATA = ROOT / "assets" / "tiny" / "data"
DEFAULT_OUT = ROOT / "assets" / "tiny" / "tokenizer"
VOCAB_SIZE = 1024
SPECIAL_TOKENS = {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>", "mask_token": "<mask>"}
MAX_LENGTH = 256  # the causal LM's n_positions


def corpus(data_dir: Path) -> list[str]:
    """Every text the tiny models will see: formatted instruction rows and classification sentences."""
    texts = []
    for name in ("pretrain.jsonl", "instructions_train.jsonl", "instructions_eval.jsonl"):
        texts += [format_example(row) for row in read_jsonl(data_dir / name, INSTRUCTION_COLUMNS)]
    for name in ("classification_train.jsonl", "classification_eval.jsonl"):
        texts += [row["text"] for row in read_jsonl(data_dir / name, CLASSIFICATION_COLUMNS)]
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with single-digit tokens and the special tokens above."""
    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),  # ids 0..4 in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=MAX_LENGTH, **SPECIAL_TOKENS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with the generated data")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to save the tokenizer")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help=f"BPE vocabulary size (default {VOCAB_SIZE})")
    args = parser.parse_args()
    tokenizer = train_tokenizer(corpus(args.data), args.vocab_size)
    tokenizer.save_pretrained(args.out)
    print(f"Saved a {len(tokenizer)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
