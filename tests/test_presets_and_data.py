import json

import pytest

from my_utils import UserError
from my_utils.core.data import check_enough_rows, format_example, format_prompt, read_jsonl, tokenize_instruction
from my_utils.core.presets import PRESETS, get_preset


def test_known_presets():
    assert {"tiny", "gpt2", "opt-350m", "roberta-large"} <= set(PRESETS)
    assert get_preset("tiny").offline


def test_unknown_preset_suggests_nearest():
    with pytest.raises(UserError, match="did you mean 'gpt2'"):
        get_preset("gtp2")


def test_preset_without_role_says_which_have_it():
    with pytest.raises(UserError, match="no classifier model"):
        get_preset("gpt2").require("classifier")


def test_prompt_format_with_and_without_input():
    row = {"instruction": "Add.", "input": "2 3", "output": "5"}
    assert format_prompt(row) == "### Instruction:\nAdd.\n\n### Input:\n2 3\n\n### Response:\n"
    assert format_prompt({**row, "input": ""}) == "### Instruction:\nAdd.\n\n### Response:\n"
    assert format_example(row, "</s>").endswith("### Response:\n5</s>")


def _write(path, lines):
    path.write_text("\n".join(json.dumps(x) for x in lines), encoding="utf-8")
    return path


def test_read_jsonl_missing_column(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"instruction": "a", "input": "", "output": "b"}, {"instruction": "a"}])
    with pytest.raises(UserError, match="Line 2 .* has no column 'input'"):
        read_jsonl(path, ("instruction", "input", "output"))


@pytest.mark.parametrize(
    "content, message",
    [(b"", "is empty"), (b"\n\n", "is empty"), (b"\xff\xfe\x00", "not UTF-8"), (b"{not json", "not valid JSON")],
)
def test_read_jsonl_bad_files(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError, match=message):
        read_jsonl(path, ("text", "label"))


def test_read_jsonl_missing_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_jsonl(tmp_path / "nope.jsonl", ("text",))


def test_dataset_smaller_than_a_global_batch():
    with pytest.raises(UserError, match="fewer than one global batch of 32"):
        check_enough_rows(10, 32)


def test_tokenize_masks_prompt_and_ends_with_eos():
    from my_utils.core.models import load_tokenizer

    tok = load_tokenizer(get_preset("tiny"))
    row = {"instruction": "Add the numbers.", "input": "2 3", "output": "5"}
    item = tokenize_instruction(row, tok, 128)
    n_prompt = len(tok(format_prompt(row), add_special_tokens=False)["input_ids"])
    assert item["labels"][:n_prompt] == [-100] * n_prompt
    assert item["labels"][n_prompt:] == item["input_ids"][n_prompt:]
    assert item["input_ids"][-1] == tok.eos_token_id
    with pytest.raises(UserError, match="does not fit max_length 4"):
        tokenize_instruction(row, tok, 4)
