"""The shipped ``tiny`` assets and real-model configs: data regenerates identically and is well formed, the
held-out families stay out of pretraining, the tokenizer and both tiny models load offline, and the real configs
build with the published parameter counts."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from my_utils.core.data import CLASSIFICATION_COLUMNS, INSTRUCTION_COLUMNS, format_example, format_prompt, read_jsonl

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY = REPO_ROOT / "assets" / "tiny"
DATA = TINY / "data"
CONFIGS = REPO_ROOT / "assets" / "configs"
INSTRUCTION_FILES = ["pretrain.jsonl", "instructions_train.jsonl", "instructions_eval.jsonl"]
CLASSIFICATION_FILES = ["classification_train.jsonl", "classification_eval.jsonl"]


def _load_script(name):
    """Import scripts/<name>.py as a module (the scripts folder is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def make_tiny_data():
    return _load_script("make_tiny_data")


def test_data_generation_is_deterministic_and_matches_the_shipped_files(make_tiny_data, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    make_tiny_data.generate(first)
    make_tiny_data.generate(second)
    names = sorted(p.name for p in DATA.iterdir())
    assert sorted(p.name for p in first.iterdir()) == names
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
        assert (first / name).read_bytes() == (DATA / name).read_bytes(), f"{name} is stale: run scripts/make_tiny_data.py"


@pytest.mark.parametrize("name", INSTRUCTION_FILES)
def test_instruction_files_are_valid(name):
    rows = read_jsonl(DATA / name, INSTRUCTION_COLUMNS + ("family",))
    assert all(isinstance(row[c], str) for row in rows for c in INSTRUCTION_COLUMNS)
    assert all(row["output"] and row["instruction"] for row in rows)


@pytest.mark.parametrize("name", CLASSIFICATION_FILES)
def test_classification_files_are_valid(name):
    labels = json.loads((DATA / "classification_labels.json").read_text())
    rows = read_jsonl(DATA / name, CLASSIFICATION_COLUMNS)
    assert {row["label"] for row in rows} == set(range(len(labels)))
    assert all(isinstance(row["text"], str) and row["text"] for row in rows)


def test_splits_are_disjoint():
    train = read_jsonl(DATA / "instructions_train.jsonl", INSTRUCTION_COLUMNS)
    evaluation = read_jsonl(DATA / "instructions_eval.jsonl", INSTRUCTION_COLUMNS)
    assert not {row["input"] for row in train} & {row["input"] for row in evaluation}
    cls_train, cls_eval = (read_jsonl(DATA / name, CLASSIFICATION_COLUMNS) for name in CLASSIFICATION_FILES)
    assert not {row["text"] for row in cls_train} & {row["text"] for row in cls_eval}


def test_held_out_families_are_absent_from_pretraining(make_tiny_data):
    held_out = set(make_tiny_data.HELD_OUT_FAMILIES)
    pretrain = read_jsonl(DATA / "pretrain.jsonl", INSTRUCTION_COLUMNS)
    fine_tune = read_jsonl(DATA / "instructions_train.jsonl", INSTRUCTION_COLUMNS)
    fine_tune += read_jsonl(DATA / "instructions_eval.jsonl", INSTRUCTION_COLUMNS)
    assert {row["family"] for row in pretrain} == set(make_tiny_data.PRETRAIN_FAMILIES)
    assert {row["family"] for row in fine_tune} == held_out
    assert not {row["instruction"] for row in pretrain} & {row["instruction"] for row in fine_tune}


@pytest.mark.parametrize("folder", ["tokenizer", "causal_lm", "encoder"])
def test_tokenizer_loads_and_round_trips(folder):
    tokenizer = AutoTokenizer.from_pretrained(TINY / folder)
    ids = {name: getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad", "unk", "mask")}
    assert None not in ids.values() and len(set(ids.values())) == 5  # pad distinct from eos
    row = read_jsonl(DATA / "instructions_eval.jsonl", INSTRUCTION_COLUMNS)[0]
    text = format_example(row, tokenizer.eos_token)
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert max(tokenizer(str(12345), add_special_tokens=False)["input_ids"]) < len(tokenizer)
    assert len(tokenizer.tokenize("12345")) == 5  # one token per digit


def test_causal_tokenizer_adds_nothing_and_encoder_tokenizer_wraps():
    causal = AutoTokenizer.from_pretrained(TINY / "causal_lm")
    encoder = AutoTokenizer.from_pretrained(TINY / "encoder")
    prompt = format_prompt({"instruction": "What is 2 + 3?", "input": ""})
    assert causal(prompt)["input_ids"] == causal(prompt, add_special_tokens=False)["input_ids"]
    ids = encoder("A short sentence.")["input_ids"]
    assert (ids[0], ids[-1]) == (encoder.cls_token_id, encoder.sep_token_id)


def test_causal_lm_loads_and_generates():
    tokenizer = AutoTokenizer.from_pretrained(TINY / "causal_lm")
    model = AutoModelForCausalLM.from_pretrained(TINY / "causal_lm")
    assert model.config.model_type == "gpt2" and model.config.pad_token_id == tokenizer.pad_token_id
    assert model.config.vocab_size == len(tokenizer)
    inputs = tokenizer(format_prompt({"instruction": "What is 2 + 3?", "input": ""}), return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    log = json.loads((TINY / "causal_lm" / "pretrain_log.json").read_text())
    assert log["parameters"] == sum(p.numel() for p in model.parameters())


def test_encoder_loads_as_a_classifier_with_only_the_new_head_missing():
    tokenizer = AutoTokenizer.from_pretrained(TINY / "encoder")
    labels = json.loads((DATA / "classification_labels.json").read_text())
    model, info = AutoModelForSequenceClassification.from_pretrained(TINY / "encoder", num_labels=len(labels),
                                                                     output_loading_info=True)
    assert model.config.model_type == "roberta"
    assert not info["unexpected_keys"], "the shipped encoder carries no pretraining head"
    assert info["missing_keys"] and all(key.startswith("classifier.") for key in info["missing_keys"])
    logits = model(**tokenizer(["The storm came at night."], return_tensors="pt")).logits
    assert logits.shape == (1, len(labels))
    log = json.loads((TINY / "encoder" / "pretrain_log.json").read_text())
    assert log["final_loss"] > 0 and log["parameters"] == sum(p.numel() for p in model.roberta.parameters())


def test_bag_of_words_loss_targets_the_texts_own_words_by_weight():
    bag_of_words_loss = _load_script("pretrain_tiny").bag_of_words_loss
    ids = torch.tensor([[0, 5, 6, 5, 1]])  # <s> 5 6 5 </s>: word 5 twice
    weights = torch.tensor([[0.0, 1.0, 2.0, 1.0, 0.0]])  # <s> and </s> weigh nothing
    target = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0]])  # 5: 1 + 1, 6: 2
    perfect = target.clamp(min=1e-9).log()
    entropy = -(target * perfect).sum()
    assert bag_of_words_loss(perfect, ids, weights) == pytest.approx(float(entropy), abs=1e-6)
    assert bag_of_words_loss(torch.zeros(1, 8), ids, weights) > bag_of_words_loss(perfect, ids, weights)


@pytest.mark.parametrize(
    ("name", "auto_class", "expected"),
    [
        ("gpt2", AutoModelForCausalLM, 124_439_808),
        ("opt-350m", AutoModelForCausalLM, 331_196_416),
        ("roberta-large", AutoModelForSequenceClassification, 355_361_794),
        ("smollm2-135m", AutoModelForCausalLM, 134_515_008),
    ],
)
def test_real_configs_build_offline_with_published_sizes(name, auto_class, expected):
    config = AutoConfig.from_pretrained(CONFIGS / name, num_labels=2)
    assert config.architectures and config.model_type
    with torch.device("meta"):  # no memory, no initialisation: just the shapes
        model = auto_class.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == expected


def test_gpt2_lora_on_c_attn_has_the_textbook_parameter_count():
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIGS / "gpt2"))
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True))
    trainable, _ = model.get_nb_trainable_parameters()
    assert trainable == 294_912  # 12 layers x r x (768 + 3 x 768)


def test_smollm2_config_is_the_published_llama():
    """The shipped config.json is SmolLM2-135M's as published: a Llama with grouped-query attention (9 query and 3
    key/value heads), a SwiGLU MLP, RMSNorm and tied embeddings; the output layer shares the embedding's weight."""
    config = AutoConfig.from_pretrained(CONFIGS / "smollm2-135m")
    assert config.architectures == ["LlamaForCausalLM"] and config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size) == \
        (30, 576, 1536, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.hidden_act) == (9, 3, "silu")
    assert config.tie_word_embeddings and config.max_position_embeddings == 8192
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    attention = model.model.layers[0].self_attn
    assert (attention.q_proj.out_features, attention.k_proj.out_features, attention.v_proj.out_features) == \
        (576, 192, 192)


def test_the_tiny_llama_is_smollm2s_architecture_at_the_tiny_presets_size():
    """assets/tiny/llama/config.json (tensor parallel's model, random weights): SmolLM2's layout (grouped-query
    attention, SwiGLU, RMSNorm) at the tiny GPT-2's width and depth, over the tiny tokenizer's vocabulary, untied so
    that the embedding and the output layer can both be split by vocabulary."""
    from my_utils.core.models import load_tokenizer
    from my_utils.core.presets import get_preset
    from my_utils.core.splits import TINY_LLAMA

    config = AutoConfig.from_pretrained(TINY_LLAMA)
    tiny = AutoConfig.from_pretrained(get_preset("tiny").causal_model)
    assert config.model_type == "llama" and config.num_key_value_heads < config.num_attention_heads
    assert (config.hidden_size, config.num_hidden_layers) == (tiny.n_embd, tiny.n_layer)
    assert config.vocab_size == len(load_tokenizer(get_preset("tiny"))) and not config.tie_word_embeddings


@pytest.mark.parametrize("split", ["train", "eval"])
def test_preference_pairs_choose_the_reference_answer_and_reject_a_corruption_of_it(split):
    """Each pair: the instruction row's prompt as the course formats it, its answer chosen, a wrong one rejected,
    and what made it wrong."""
    pairs = [json.loads(line) for line in (DATA / f"preferences_{split}.jsonl").read_text().splitlines()]
    rows = read_jsonl(DATA / f"instructions_{split}.jsonl", INSTRUCTION_COLUMNS)
    assert len(pairs) == len(rows)
    for pair, row in zip(pairs, rows):
        assert pair["prompt"] == format_prompt(row) and pair["chosen"] == row["output"]
        assert pair["rejected"] != pair["chosen"] and pair["family"] == row["family"]
    kinds = {pair["corruption"] for pair in pairs}
    assert kinds == {"the count off by one", "a name the lambda does not take", "another input's answer"}
    for pair in pairs:
        if pair["corruption"] == "the count off by one":
            assert abs(int(pair["rejected"]) - int(pair["chosen"])) == 1
