import json

import pytest

from my_utils import UserError
from my_utils.core.data import check_enough_rows, format_example, format_prompt, read_jsonl, tokenize_instruction
from my_utils.core.presets import PRESETS, get_preset


# every preset that loads its model from the hub (all but the offline tiny one)
REAL_PRESETS = [name for name, preset in PRESETS.items() if not preset.offline]


def test_known_presets():
    assert get_preset("tiny").offline and "tiny" not in REAL_PRESETS
    assert {"gpt2", "roberta-large"} <= set(REAL_PRESETS)  # a causal and a classifier preset among them


@pytest.mark.parametrize("name", REAL_PRESETS)
def test_real_presets_ship_their_config_and_valid_lora_targets(name):
    """A real preset is its hub id plus its published config.json: the architecture builds offline on the meta
    device, its default LoRA targets are adaptable layers of it, and a causal preset's data and length fit."""
    from my_utils.core.data import HUB_CLASSIFICATION, HUB_INSTRUCTIONS
    from my_utils.core.devices import meta_model
    from my_utils.core.models import check_lora_targets, max_positions

    p = get_preset(name)
    assert not p.offline
    role = "causal" if p.causal_model else "classifier"
    model = meta_model(p.offline_config[role])
    check_lora_targets(model, p.lora_targets if role == "causal" else p.classifier_lora_targets)
    if role == "causal":
        assert p.lora_targets and p.instruction_data in HUB_INSTRUCTIONS
        assert p.max_length <= max_positions(model.config)
    else:
        assert p.classifier_lora_targets and p.classification_data in HUB_CLASSIFICATION


def test_smollm2_adapts_the_attention_by_default_and_could_adapt_every_projection():
    """Its default is the classic query and value projections; every other projection of a Llama block is a valid
    target too, and a layer that is not a linear one (an RMSNorm) is refused in one sentence."""
    from my_utils.core.devices import meta_model
    from my_utils.core.models import check_lora_targets

    p = get_preset("smollm2-135m")
    assert p.lora_targets == ("q_proj", "v_proj")
    model = meta_model(p.offline_config["causal"])
    check_lora_targets(model, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    with pytest.raises(UserError, match="'input_layernorm' is a LlamaRMSNorm"):
        check_lora_targets(model, ("input_layernorm",))
    with pytest.raises(UserError, match="'c_attn' matches nothing in LlamaForCausalLM"):
        check_lora_targets(model, ("c_attn",))


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


def test_read_jsonl_keeps_line_separators_inside_strings_and_names_devices(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a\u2028b", "label": 1}\r\n{"text": "c\u0085d", "label": 0}\n', encoding="utf-8")
    assert [r["text"] for r in read_jsonl(path, ("text", "label"))] == ["a\u2028b", "c\u0085d"]
    with pytest.raises(UserError, match="/dev/null is not a regular file"):
        read_jsonl("/dev/null", ("text",))


def test_packed_examples_keep_to_themselves_and_every_token_is_counted():
    """Examples packed into rows (``--packing``) give the logits each would give alone: the positions restart and,
    once ``TokenCounter`` has counted the real tokens and dropped the mask, transformers masks each example off from
    the others. With the mask left in, the same row lets later examples see earlier ones."""
    import torch

    from my_utils.core.data import load_instructions, pack_examples, packed_collator, tokenize_instructions
    from my_utils.core.models import build_causal_lm, load_tokenizer
    from my_utils.run.callbacks import TokenCounter

    preset = get_preset("tiny")
    tokenizer = load_tokenizer(preset)
    examples = tokenize_instructions(load_instructions("tiny", eval_rows=1)[0][:12], tokenizer, 64)
    packed = pack_examples(examples, 64)
    lengths = sorted(len(e["input_ids"]) for e in examples)
    assert len(packed) < len(examples) and sorted(n for row in packed for n in row["seq_lengths"]) == lengths
    assert all(len(row["input_ids"]) == sum(row["seq_lengths"]) <= 64 for row in packed)

    counter = TokenCounter(packed_collator(tokenizer))
    batch = counter(packed)
    assert "attention_mask" not in batch and counter.tokens == sum(lengths)
    model = build_causal_lm(preset).train()  # as it trains: with a cache the model would skip the mask per example
    with torch.no_grad():
        logits = model(**batch).logits
        masked = model(**batch, attention_mask=(batch["labels"] != -100) | (batch["position_ids"] > 0)).logits
        leaks = 0
        for r, row in enumerate(packed):
            start = 0
            for n in row["seq_lengths"]:
                alone = model(input_ids=batch["input_ids"][r:r + 1, start:start + n]).logits[0]
                torch.testing.assert_close(logits[r, start:start + n], alone, atol=1e-5, rtol=1e-5)
                leaks += start > 0 and not torch.allclose(masked[r, start:start + n], alone, atol=1e-5)
                start += n
    assert leaks > 0  # the check above can fail: a plain padding mask lets examples see each other
