"""The LoRA / QLoRA workflow: its command line, its checks before anything starts, and (slow) the real
2-process launch from a shell, with and without 4-bit quantization."""

import json
import subprocess
import sys

import pytest

from my_utils import UserError
from my_utils.core.adapters import AdapterSpec
from my_utils.core.paths import REPO_ROOT
from my_utils.core.records import adapter_of, label_of
from my_utils.run.launch import accelerate_command
from my_utils.run.results import load_run
from my_utils.workflows import lora


def test_parse_args_defaults_and_one_line_quantize_switch():
    cfg = lora.parse_args(["--preset", "tiny"])
    assert (cfg.method, cfg.quantize, cfg.adapter, cfg.lr_scaling) == ("lora", "none", AdapterSpec(), "none")
    q = lora.parse_args(["--preset", "tiny", "--quantize", "4bit", "--targets", "c_attn", "--max-steps", "3",
                         "--rank", "4", "--dora", "--output-dir", "somewhere"])
    assert (q.quantize, q.adapter, q.max_steps, q.output_dir) == (
        "4bit", AdapterSpec(rank=4, targets=("c_attn",), dora=True), 3, "somewhere")


RESOLVED = ("local_batch_size", "max_steps", "max_length", "learning_rate", "lr_scheduler", "mixed_precision",
            "num_processes")


def test_resolve_settles_every_default_before_the_folder_opens():
    from my_utils.core.presets import get_preset

    preset = get_preset("tiny")
    cfg = lora.resolve(lora.Config(adapter=AdapterSpec(rank=4)), preset, world_size=2)
    assert all(getattr(cfg, key) is not None for key in RESOLVED) and cfg.mixed_precision != "auto"
    assert cfg.adapter == AdapterSpec(rank=4, alpha=8, targets=tuple(preset.lora_targets), peft={
        "peft_type": "LORA", "bias": "none", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "use_rslora": False,
        "use_dora": False, "target_modules": list(preset.lora_targets)})
    assert (cfg.local_batch_size, cfg.learning_rate, cfg.num_processes) == (preset.batch_size, preset.learning_rate, 2)
    assert lora.resolve(cfg, preset, world_size=2) == cfg, "resolving twice changes nothing (resume compares them)"
    full = lora.resolve(lora.Config(method="full"), preset, world_size=1)
    assert full.adapter is None and full.learning_rate == preset.full_learning_rate  # full fine-tuning: no adapter
    # the optimizer's rate: the recorded one scaled from the preset's batch to the effective batch
    sqrt = lora.resolve(lora.Config(lr_scaling="sqrt"), preset, world_size=4)
    assert lora.training_learning_rate(sqrt, preset, 4) == pytest.approx(2 * sqrt.learning_rate)


@pytest.mark.parametrize("changes, message", [
    ({"method": "full", "quantize": "4bit"}, "cannot be fully fine-tuned"),
    ({"quantize": "2bit"}, "Unknown quantization '2bit'"),
    ({"adapter": AdapterSpec(rank=0)}, "rank must be a positive integer"),
    ({"lr_scaling": "cubic"}, "Unknown learning-rate scaling"),
    ({"max_steps": 0}, "--max-steps must be a positive integer"),
    ({"preset": "gtp2"}, "did you mean 'gpt2'"),
])
def test_bad_config_is_one_sentence(changes, message):
    with pytest.raises(UserError, match=message):
        lora.validate(lora.Config(**changes))


@pytest.mark.slow
def test_existing_output_dir_is_refused_and_left_alone(tmp_path, subprocess_env):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    out = subprocess.run([sys.executable, "-m", "my_utils.workflows.lora", "--preset", "tiny", "--max-steps", "1",
                          "--output-dir", str(tmp_path / "taken")], env=subprocess_env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "already exists and is never overwritten" in out.stderr
    assert "Traceback" not in out.stderr
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["none", "4bit"])
def test_two_process_launch_from_a_shell(tmp_path, subprocess_env, tracked_losses, quantize):
    out_dir = tmp_path / f"lora_{quantize}"
    cmd = accelerate_command("my_utils.workflows.lora",
                             ["--preset", "tiny", "--quantize", quantize, "--max-steps", "3", "--eval-rows", "8",
                              "--logging-steps", "1", "--report-to", "tensorboard", "--output-dir", out_dir],
                             num_processes=2, config_file=REPO_ROOT / "configs" / "cpu_x2.yaml")
    proc = subprocess.run(cmd, env=subprocess_env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    run = json.loads((out_dir / "run.json").read_text())
    summary = json.loads((out_dir / "summary.json").read_text())
    assert run["status"] == "complete"
    assert run["world_size"] == 2 and run["backend"] == "gloo"  # as seen inside the workers
    # the launch as the user typed it, to repeat it: the launcher, its config, and the variable the CPU needs
    assert run["launch"]["launcher"].startswith("ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1 accelerate launch "
                                                "--config_file "), run["launch"]
    assert "-m my_utils.workflows.lora --preset tiny" in run["launch"]["launcher"]
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 2 * summary["local_batch_size"]
    assert run["config"]["chunked_loss"] is True and summary["chunked_loss"] is True  # on by default, recorded
    assert [m["process"] for m in summary["memory"]] == [0, 1]
    for m in summary["memory"]:
        assert m["first_step"]["rss"] > 0 and m["end"]["peak_rss"] >= m["end"]["rss"]
        assert m["breakdown"]["optimizer_states"] >= 2 * 4 * summary["trainable_params"]
        assert m["breakdown"]["gradients"] == 4 * summary["trainable_params"]
    assert [b["process"] for b in summary["first_batches"]] == [0, 1]
    _check_each_fact_once(out_dir)
    assert summary["first_batches"][0]["fingerprint"] != summary["first_batches"][1]["fingerprint"]
    assert "[rank 1/2] batch of 16 x" in proc.stdout
    assert 0 <= summary["similarity_after"] <= 1 and summary["exact_match_after"] is not None
    assert summary["adapter_bytes"] == (out_dir / "adapter" / "adapter_model.safetensors").stat().st_size
    _check_adapter_folder_stands_alone(out_dir, run, summary)
    tensorboard, logged = tracked_losses(out_dir)  # each metrics line went to TensorBoard as well
    assert len(logged) == 3 and tensorboard == pytest.approx(logged)
    if quantize == "4bit":
        assert summary["method"] == "lora" and run["config"]["quantize"] == "4bit"  # quantization: a fact apart
        assert label_of(run, summary) == "qlora-4bit"
        assert summary["quantization"] == {"bits": 4, "type": "nf4", "double_quant": True,
                                           "compute_dtype": "float32"}
        # 4-bit weights: well under the 4 bytes per parameter of the float32 model
        assert summary["memory"][0]["breakdown"]["weights"] < 0.5 * 4 * summary["total_params"]
    else:
        assert summary["quantization"] is None
        assert summary["memory"][0]["breakdown"]["weights"] >= 4 * summary["total_params"]


@pytest.mark.slow
def test_compile_trains_as_eager_does_with_the_graphs_counted(tmp_path, subprocess_env):
    """--compile: the Trainer compiles the model (torch's counter saw graphs built), with transformers' loss in place
    of the chunked one, which the compiler cannot trace; the losses are eager's to float rounding."""
    summaries = {}
    for name, flag in (("compiled", "--compile"), ("eager", "--no-chunked-loss")):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "my_utils.workflows.lora", "--preset", "tiny", "--max-steps", "3",
                               "--logging-steps", "1", "--skip-generation-eval", "--eval-rows", "8", flag,
                               "--output-dir", str(out)], env=subprocess_env, cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        summaries[name] = load_run(out)
    compiled, eager = summaries["compiled"]["summary"], summaries["eager"]["summary"]
    assert summaries["compiled"]["run"]["config"]["compile"] is True and compiled["chunked_loss"] is False
    assert compiled["compiled_graphs"] >= 1 and eager["compiled_graphs"] is None
    losses = [[m["loss"] for m in run["metrics"] if "loss" in m] for run in summaries.values()]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-4)


def _check_each_fact_once(out_dir):
    """The records of a LoRA run (run.json, summary.json, metrics.jsonl) state the adapter's rank once, as peft's
    ``r``, and name no process ``rank``."""
    records = [(out_dir / name).read_text(encoding="utf-8") for name in ("run.json", "summary.json", "metrics.jsonl")]
    assert sum(text.count('"r":') for text in records) == 1
    assert sum(text.count('"lora_alpha":') for text in records) == 1
    assert not any('"rank":' in text or '"alpha":' in text for text in records)


def _check_adapter_folder_stands_alone(out_dir, run, summary):
    """The adapter folder loads with peft and transformers alone, and its card says what trained it."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    adapter_dir = out_dir / "adapter"
    card = (adapter_dir / "README.md").read_text(encoding="utf-8")
    peft = adapter_of(run)
    for fact in (f"| method | {label_of(run, summary)} |", f"| rank, alpha | {peft['r']}, {peft['lora_alpha']} |",
                 f"| targets | {', '.join(peft['target_modules'])} |", f"| steps | {summary['steps']} of",
                 f"| held-out loss | {summary['eval_loss_before']:.4g} -> {summary['eval_loss']:.4g} |",
                 (run.get("launch") or {}).get("launcher") or " ".join(run["command"]), run["commit"][:12],
                 "| base model | the `tiny` preset's model"):  # a preset travels; the clone's path is only a note
        assert fact in card, f"the model card lacks {fact!r}:\n{card}"
    assert "base_model:" not in card.split("---")[1], "no local path in the card's front matter"
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    model = AutoPeftModelForCausalLM.from_pretrained(adapter_dir)  # the base named in adapter_config.json
    assert tokenizer.eos_token is not None and model.peft_config["default"].r == peft["r"]


@pytest.mark.parametrize("cuda, cpu_flags, quantize, expected", [
    (False, {"_is_amx_tile_supported": True, "_is_avx512_bf16_supported": True}, "none", "bf16"),  # AMX
    (False, {"_is_avx512_bf16_supported": True}, "none", "no"),  # native bf16 dot products, slower training
    (False, {}, "none", "no"),  # bf16 would be emulated: slower than fp32
    (False, {"_is_amx_tile_supported": True}, "4bit", "no"),  # bitsandbytes' CPU path stays in fp32
])
def test_auto_mixed_precision_is_bf16_only_where_faster(monkeypatch, cuda, cpu_flags, quantize, expected):
    import torch

    from my_utils.core import devices
    from my_utils.workflows import lora
    from my_utils.workflows.lora import Config, default_mixed_precision, resolve, validate

    monkeypatch.setattr(devices, "cuda_available", lambda: cuda)
    monkeypatch.setattr(lora, "is_cpu_only", lambda: not cuda)
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda flag=cpu_flags.get(name, False): flag, raising=False)
    assert default_mixed_precision(quantize) == expected
    cfg = Config(quantize=quantize)
    assert resolve(cfg, validate(cfg), 1).mixed_precision == expected  # settled before run.json records the config
    cfg = Config(quantize=quantize, mixed_precision="no")
    assert resolve(cfg, validate(cfg), 1).mixed_precision == "no"  # an explicit choice is kept


@pytest.mark.slow
def test_two_processes_of_8_and_4_accumulation_steps_of_4_train_like_one_process_of_16(tmp_path, subprocess_env):
    """The loss is normalised by the whole batch's tokens, across ranks and accumulation steps: on padded examples
    of different lengths, 2 processes x 8, 1 x 16 and 4 accumulated micro-batches x 4 give the same losses, step by
    step (averaging each part's mean loss would not: lesson 12), and DDP really averages the adapters' gradients (a
    run whose ranks trained apart would drift from the second step on)."""
    common = ["--preset", "tiny", "--max-steps", "6", "--logging-steps", "1", "--eval-rows", "16",
              "--skip-generation-eval", "--mixed-precision", "no"]
    one, two, accumulated = tmp_path / "x1", tmp_path / "x2", tmp_path / "accumulated"
    single = [sys.executable, "-m", "my_utils.workflows.lora", *common]
    subprocess.run([*single, "--local-batch-size", "16", "--output-dir", str(one)], env=subprocess_env, cwd=REPO_ROOT,
                   check=True, capture_output=True)
    subprocess.run([*single, "--local-batch-size", "4", "--grad-accum", "4", "--output-dir", str(accumulated)],
                   env=subprocess_env, cwd=REPO_ROOT, check=True, capture_output=True)
    cmd = accelerate_command("my_utils.workflows.lora", [*common, "--local-batch-size", "8", "--output-dir", two],
                             num_processes=2, config_file=REPO_ROOT / "configs" / "cpu_x2.yaml")
    subprocess.run(cmd, env=subprocess_env, cwd=REPO_ROOT, check=True, capture_output=True)

    def losses(folder):
        return [m["loss"] for m in load_run(folder)["metrics"] if "loss" in m]

    assert load_run(two)["summary"]["world_size"] == 2 and len(losses(one)) == 6
    from my_utils.core.data import load_instructions, tokenize_instructions
    from my_utils.core.models import load_tokenizer
    from my_utils.core.presets import get_preset

    examples = tokenize_instructions(load_instructions("tiny")[0], load_tokenizer(get_preset("tiny")), 128)
    answer_lengths = {sum(label != -100 for label in e["labels"]) for e in examples}
    assert len(answer_lengths) > 5, "answers of one length would prove nothing here"
    for run in (two, accumulated):  # each step's loss is taken at the weights the steps before it left
        assert losses(run) == pytest.approx(losses(one), rel=1e-4)
    # the held-out loss, evaluated in the same batches of 16 rows (8 per rank); the accumulated run evaluates in
    # batches of 4, and the Trainer's eval_loss is a mean of batch means, lesson 12's first trap
    assert load_run(two)["summary"]["eval_loss"] == pytest.approx(load_run(one)["summary"]["eval_loss"], rel=1e-4)


@pytest.mark.slow
def test_a_dora_run_trains_from_its_config_file_and_records_dora(tmp_path, subprocess_env):
    """DoRA is a peft config file (configs/peft/dora.json): it reaches peft, run.json, summary.json and the saved
    adapter. run.json's config records what ran: no default left as null, the resolved peft config whole."""
    from safetensors import safe_open

    out = tmp_path / "dora"
    proc = subprocess.run([sys.executable, "-m", "my_utils.workflows.lora", "--preset", "tiny", "--adapter-config",
                           "configs/peft/dora.json", "--max-steps", "2", "--logging-steps", "1", "--local-batch-size", "4",
                           "--eval-rows", "4", "--skip-generation-eval", "--output-dir", str(out)],
                          env=subprocess_env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = load_run(out)
    config, summary = run["run"]["config"], run["summary"]
    assert [key for key in RESOLVED if config[key] is None] == [] and config["mixed_precision"] != "auto"
    assert config["adapter"] == {"adapter_config": "configs/peft/dora.json", "peft": {
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["c_attn"],
        "bias": "none", "use_dora": True, "use_rslora": False}}
    assert "adapter" not in summary and summary["method"] == "lora" and label_of(run["run"], summary) == "dora"
    _check_each_fact_once(out)
    assert summary["steps"] == 2 and len([m for m in run["metrics"] if "loss" in m]) == 2
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["use_dora"] is True
    with safe_open(str(out / "adapter" / "adapter_model.safetensors"), "pt") as f:
        assert any("lora_magnitude_vector" in key for key in f.keys()), "DoRA's magnitudes were saved"
