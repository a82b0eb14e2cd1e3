"""Datasets for the course: the shipped tiny data, the real hub loaders, prompt formatting and tokenization.

Instruction data uses the Alpaca schema (``instruction``, ``input``, ``output``); classification data uses
(``text``, ``label``). Every loader validates its rows so that a bad file stops with one clear sentence.

Run ``python -m my_utils.core.data`` to print a few formatted examples of the tiny data.
"""

from __future__ import annotations

import json
from pathlib import Path

from my_utils import UserError
from my_utils.core.paths import ASSETS

TINY_DATA = ASSETS / "tiny" / "data"

INSTRUCTION_COLUMNS = ("instruction", "input", "output")
CLASSIFICATION_COLUMNS = ("text", "label")
PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")  # trl's names for a preference pair
# The longest line a data file may hold: a row is a prompt and a response, far shorter; a longer line is refused
# before it is parsed, or tokenizing it would take minutes
MAX_LINE_CHARS = 1_000_000

# The Alpaca template without its one-sentence preamble (which costs tokens and teaches nothing).
PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


def format_prompt(row: dict) -> str:
    """The prompt for one Alpaca-style row, ending where the model's response starts; a row that carries its prompt
    already (a preference pair's, a GRPO prompt's) gives it as it is."""
    if "prompt" in row:
        return row["prompt"]
    if row.get("input"):
        return PROMPT_WITH_INPUT.format(instruction=row["instruction"], input=row["input"])
    return PROMPT_NO_INPUT.format(instruction=row["instruction"])


def format_example(row: dict, eos_token: str = "") -> str:
    """Prompt plus response (plus the end-of-sequence token), the text a causal LM is trained on."""
    return format_prompt(row) + row["output"] + eos_token


def read_jsonl(path: str | Path, columns: tuple[str, ...]) -> list[dict]:
    """Read a JSON-lines file and check that every row has ``columns``; raise UserError otherwise."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"Data file {path} is a folder; give the path of a JSON-lines file inside it.")
    if not path.exists():
        raise UserError(f"Data file {path} does not exist; check the path or run `python scripts/make_tiny_data.py`.")
    if not path.is_file():
        raise UserError(f"Data file {path} is not a regular file (a device or a pipe); give the path of a JSON-lines "
                        "file.")
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark, as some editors write, is skipped
    except UnicodeDecodeError as e:
        raise UserError(f"Data file {path} is not UTF-8 (byte {e.start}); re-save it as UTF-8.") from None
    rows = []
    # JSON lines end at "\n" (and "\r\n") only: str.splitlines would also cut at U+2028 and other separators that
    # JSON text may hold unescaped inside a string
    for number, line in enumerate(text.split("\n"), start=1):
        if len(line) > MAX_LINE_CHARS:
            raise UserError(f"Line {number} of {path} is {len(line):,} characters long, over the {MAX_LINE_CHARS:,} a "
                            "row may hold; split or remove that line.")
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"Line {number} of {path} is not valid JSON; fix or remove that line.") from None
        if not isinstance(row, dict):
            raise UserError(f"Line {number} of {path} is {json.dumps(row)[:40]}, not an object with "
                            f"{', '.join(columns)}; fix or remove that line.")
        missing = [c for c in columns if c not in row]
        if missing:
            raise UserError(
                f"Line {number} of {path} has no column {missing[0]!r}; every row needs {', '.join(columns)}."
            )
        rows.append(row)
    if not rows:
        raise UserError(f"Data file {path} is empty; give it at least one row with {', '.join(columns)}.")
    return rows


def check_text_columns(rows: list[dict], columns: tuple[str, ...], source: str | Path) -> None:
    """Every value of ``columns`` must be text: a number or null there would fail later, mid-run."""
    for row in rows:
        for column in columns:
            if not isinstance(row[column], str):
                raise UserError(
                    f"A row of {source} has {type(row[column]).__name__} {row[column]!r} in column {column!r}, "
                    "not text; quote it as a string."
                )


# Hub datasets of the real presets: (dataset id, column renames into our schema).
HUB_INSTRUCTIONS = {
    "alpaca": ("tatsu-lab/alpaca", {}),
    "codealpaca": ("sahil2801/CodeAlpaca-20k", {}),
}
HUB_CLASSIFICATION = {"sst2": ("stanfordnlp/sst2", {"sentence": "text"})}


def _hub_rows(dataset_id: str, renames: dict, columns: tuple[str, ...], eval_rows: int, seed: int):
    """Load a hub dataset's train split and cut a held-out eval split from it (online only)."""
    from datasets import load_dataset

    ds = load_dataset(dataset_id, split="train")
    for old, new in renames.items():
        ds = ds.rename_column(old, new)
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise UserError(f"Dataset {dataset_id} has no column {missing[0]!r}; it needs {', '.join(columns)}.")
    split = ds.train_test_split(test_size=eval_rows, seed=seed)
    return [dict(r) for r in split["train"]], [dict(r) for r in split["test"]]


def _split_file(path: str, columns: tuple[str, ...], eval_rows: int) -> tuple[list[dict], list[dict]]:
    """(train, held out) of the JSON-lines file ``path``: its first rows (a tenth, at most ``eval_rows``) held out."""
    rows = read_jsonl(path, columns)
    if len(rows) < 2:
        raise UserError(f"Data file {path} has 1 row; it needs at least 2, one held out for evaluation and the rest "
                        "to train on.")
    cut = max(1, min(eval_rows, len(rows) // 10))
    return rows[cut:], rows[:cut]


def load_instructions(source: str, *, eval_rows: int = 200, seed: int = 0, path: str | None = None):
    """(train_rows, eval_rows) of Alpaca-style data: 'tiny' (shipped), 'alpaca' or 'codealpaca' (hub),
    or a JSON-lines file given by ``path``."""
    if path is not None:
        return _split_file(path, INSTRUCTION_COLUMNS, eval_rows)
    if source == "tiny":
        return (
            read_jsonl(TINY_DATA / "instructions_train.jsonl", INSTRUCTION_COLUMNS),
            read_jsonl(TINY_DATA / "instructions_eval.jsonl", INSTRUCTION_COLUMNS)[:eval_rows],
        )
    if source not in HUB_INSTRUCTIONS:
        raise UserError(f"Unknown instruction data {source!r}; choose tiny, {', '.join(HUB_INSTRUCTIONS)}.")
    return _hub_rows(*HUB_INSTRUCTIONS[source], INSTRUCTION_COLUMNS, eval_rows, seed)


def load_preferences(source: str | None, *, eval_rows: int = 100, path: str | None = None):
    """(train_pairs, held_out_pairs) of preference pairs (``PREFERENCE_COLUMNS``, text): the tiny preset's, built by
    ``scripts/make_tiny_data.py`` from its instruction rows (the answer chosen, a corruption of it rejected), or a
    JSON-lines file given by ``path``, whose first rows (a tenth, at most ``eval_rows``) are held out."""
    if path is not None:
        train, held_out = _split_file(path, PREFERENCE_COLUMNS, eval_rows)
    elif source == "tiny":
        train = read_jsonl(TINY_DATA / "preferences_train.jsonl", PREFERENCE_COLUMNS)
        held_out = read_jsonl(TINY_DATA / "preferences_eval.jsonl", PREFERENCE_COLUMNS)[:eval_rows]
    else:
        raise UserError(f"The {source} data has no preference pairs shipped; give --data-file with one JSON object "
                        f"per line holding {', '.join(PREFERENCE_COLUMNS)} (assets/tiny/data/preferences_train.jsonl "
                        "shows the format).")
    check_text_columns(train + held_out, PREFERENCE_COLUMNS, path or f"the {source} preference pairs")
    return train, held_out


def load_classification(source: str, *, eval_rows: int = 300, seed: int = 0):
    """(train_rows, eval_rows, label_names) of (text, label) data: 'tiny' (shipped) or 'sst2' (hub)."""
    if source == "tiny":
        labels = json.loads((TINY_DATA / "classification_labels.json").read_text(encoding="utf-8"))
        return (
            read_jsonl(TINY_DATA / "classification_train.jsonl", CLASSIFICATION_COLUMNS),
            read_jsonl(TINY_DATA / "classification_eval.jsonl", CLASSIFICATION_COLUMNS)[:eval_rows],
            labels,
        )
    if source not in HUB_CLASSIFICATION:
        raise UserError(f"Unknown classification data {source!r}; choose tiny or {', '.join(HUB_CLASSIFICATION)}.")
    train, evaluation = _hub_rows(*HUB_CLASSIFICATION[source], CLASSIFICATION_COLUMNS, eval_rows, seed)
    return train, evaluation, ["negative", "positive"]


def tokenize_instruction(row: dict, tokenizer, max_length: int) -> dict:
    """Token ids of prompt + response + eos, with labels -100 on the prompt so that only the response is
    learned. Raises UserError when the prompt alone does not fit ``max_length``."""
    prompt_ids = tokenizer(format_prompt(row), add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(row["output"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    if len(prompt_ids) >= max_length:
        raise UserError(
            f"A prompt of {len(prompt_ids)} tokens does not fit max_length {max_length}; raise --max-length "
            "or shorten the data."
        )
    ids = (prompt_ids + answer_ids)[:max_length]
    labels = ([-100] * len(prompt_ids) + answer_ids)[:max_length]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def tokenize_instructions(rows, tokenizer, max_length: int) -> list[dict]:
    """``tokenize_instruction`` over rows, after checking max_length against the model's limit."""
    limit = getattr(tokenizer, "model_max_length", None)
    if limit and limit < 10**9 and max_length > limit:
        raise UserError(f"max_length {max_length} is longer than the model allows ({limit}); use --max-length {limit}.")
    if not rows:
        raise UserError("The dataset is empty; give it at least one row.")
    return [tokenize_instruction(r, tokenizer, max_length) for r in rows]


def check_enough_rows(n_rows: int, global_batch: int) -> None:
    """A dataset smaller than one global batch cannot make a single step."""
    if n_rows < global_batch:
        raise UserError(
            f"The dataset has {n_rows} rows, fewer than one global batch of {global_batch}; "
            "lower --local-batch-size or the number of processes, or add data."
        )


def padding_collator(tokenizer, pad_to: int | None = None):
    """Pads input_ids with the pad token and labels with -100, per batch to its longest example (dynamic padding),
    or to ``pad_to`` tokens."""
    from transformers import DataCollatorForSeq2Seq

    padding = {"padding": "max_length", "max_length": pad_to} if pad_to else {"padding": True}
    return DataCollatorForSeq2Seq(tokenizer, **padding, label_pad_token_id=-100, return_tensors="pt")


def pack_examples(examples: list[dict], max_length: int) -> list[dict]:
    """Tokenized examples (``tokenize_instructions``) packed into rows of at most ``max_length`` tokens by best-fit
    decreasing (trl's ``pack_dataset``): whole examples, longest first, each into the fullest row it fits. A row
    keeps its examples' lengths (``seq_lengths``), from which ``packed_collator`` restarts the positions."""
    from datasets import Dataset
    from trl import pack_dataset

    return pack_dataset(Dataset.from_list(examples), max_length, strategy="bfd").to_list()


def packed_collator(tokenizer):
    """Pads packed rows (``pack_examples``) and gives each token its position within its own example
    (``position_ids``). From positions that restart, transformers draws a causal mask per example, so that no
    example attends to another, but only without an attention mask and without a key/value cache: the batch asks
    for no cache, and ``TokenCounter`` removes the mask once it has counted the tokens. Rows without
    ``seq_lengths`` (held-out examples) get positions 0, 1, 2... as with padding."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collate = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, return_position_ids=True)

    def packed(rows):
        return {**collate(rows), "use_cache": False}

    return packed


def token_blocks(preset, tokenizer, n_blocks: int, max_length: int):
    """``n_blocks`` sequences of ``max_length`` tokens cut from the preset's instruction texts laid end to end
    (no padding, so every micro-batch has the same shape and the same number of tokens)."""
    import torch

    rows, _ = load_instructions(preset.instruction_data)
    stream: list[int] = []
    for row in rows:
        stream += tokenizer(format_example(row, tokenizer.eos_token), add_special_tokens=False)["input_ids"]
        if len(stream) >= n_blocks * max_length:
            break
    if len(stream) < n_blocks * max_length:
        raise UserError(f"The data holds {len(stream)} tokens, fewer than {n_blocks} x {max_length}; "
                        "lower --max-steps or --max-length.")
    return torch.tensor(stream[: n_blocks * max_length]).view(n_blocks, max_length)


if __name__ == "__main__":
    train, evaluation = load_instructions("tiny")
    print(f"tiny instruction data: {len(train)} train rows, {len(evaluation)} eval rows\n")
    for row in train[:3]:
        print(format_example(row) + "\n" + "-" * 40)
