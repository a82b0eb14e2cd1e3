"""The block dataset of the data-parallel lessons: the preset's instruction set, formatted as prompt + response + eos
and packed end to end into blocks of exactly ``max_length`` tokens (no padding).

Every example then predicts the same number of tokens, so the mean loss over a batch of 2b is exactly the average of
the mean losses over its two halves of b: that is why DDP over two processes with batch b equals one process with
batch 2b, and why tokens/s is simply samples/s x max_length.

    python -m my_utils.core.blocks        # how many blocks the tiny preset makes, and the first one
"""

from __future__ import annotations

import functools

from my_utils import UserError
from my_utils.core.data import format_example, load_instructions
from my_utils.core.models import load_tokenizer
from my_utils.core.presets import get_preset


def pack_blocks(rows, tokenizer, block_length: int):
    """Token ids of every row (prompt + response + eos) concatenated and cut into blocks of ``block_length``
    (the tail that does not fill a block is dropped). Returns a LongTensor [n_blocks, block_length]."""
    import torch

    texts = [format_example(row, tokenizer.eos_token) for row in rows]
    ids = [i for row_ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in row_ids]
    n_blocks = len(ids) // block_length
    if n_blocks == 0:
        raise UserError(f"The data has {len(ids)} tokens, fewer than one block of {block_length}; lower --max-length.")
    return torch.tensor(ids[: n_blocks * block_length]).view(n_blocks, block_length)


def block_dataset(preset, max_length: int) -> list[dict]:
    """The preset's instruction training rows as packed blocks: a list of {"input_ids", "labels"} (labels are the
    inputs; the model shifts them by one), usable by a DataLoader and by the Trainer. Cached per preset and
    length: treat it as read-only."""
    return _block_dataset(preset.name, max_length)


@functools.lru_cache(maxsize=4)
def _block_dataset(preset_name: str, max_length: int) -> list[dict]:
    preset = get_preset(preset_name)
    tokenizer = load_tokenizer(preset)
    limit = getattr(tokenizer, "model_max_length", None)
    if limit and limit < 10**9 and max_length > limit:
        raise UserError(f"--max-length {max_length} is longer than the model allows ({limit}); use {limit} or less.")
    train_rows, _ = load_instructions(preset.instruction_data, eval_rows=1)
    return [{"input_ids": block, "labels": block} for block in pack_blocks(train_rows, tokenizer, max_length)]


if __name__ == "__main__":
    tiny = get_preset("tiny")
    blocks = block_dataset(tiny, 128)
    print(f"{len(blocks)} blocks of 128 tokens; the first one:\n")
    print(load_tokenizer(tiny).decode(blocks[0]["input_ids"]))
