"""Bad input stops the LoRA workflow with one sentence saying what to do, before anything is written.

From the command line (exit code 2, one line on stderr, no results folder) for one input of each kind, and
through the Python API (``lora.validate`` then ``lora.load_inputs``: what ``train`` runs before it opens the
results folder) for the rest. Also here: paths with spaces and non-ASCII letters work, a stray user-level
accelerate config is ignored with a note, secrets never reach run.json, remote code stays off, and every
``torch.load`` is restricted to tensors.
"""

import dataclasses
import json
import math
import re
import subprocess
from pathlib import Path

import pytest

from my_utils import UserError
from my_utils.core.adapters import AdapterSpec
from my_utils.core.presets import get_preset
from my_utils.run import launch
from my_utils.core.paths import REPO_ROOT
from my_utils.run.redaction import REDACTED, secret_hash
from my_utils.run.results import Run
from my_utils.run.config import as_record
from my_utils.run.launch import accelerate_default_config
from my_utils.workflows import lora

TINY_TRAIN = REPO_ROOT / "assets" / "tiny" / "data" / "instructions_train.jsonl"


def assert_one_sentence(message: str) -> None:
    """One line, one sentence (no full stop followed by a new capitalised sentence), ending with a full stop."""
    assert "\n" not in message.strip(), message
    assert message.strip().endswith("."), message
    assert not re.search(r"[.!?] [A-Z]", message.split(": error: ", 1)[-1]), message


def cli(args, capsys) -> subprocess.CompletedProcess:
    """``python -m my_utils.workflows.lora <args>`` as its ``main`` runs it, in this process: the exit code and what it
    printed (every case here stops before training)."""
    try:
        lora.main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code
    said = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, said.out, said.err)


def rows(n: int) -> list[dict]:
    return [json.loads(line) for line in TINY_TRAIN.read_text(encoding="utf-8").splitlines()[:n]]


def write_rows(path: Path, items) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in items), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------ command line


@pytest.mark.parametrize("args, expected", [
    (["--preset", "tny"], "Unknown preset 'tny'; did you mean 'tiny'?"),
    (["--rank", "0"], "LoRA rank must be a positive integer, got 0; try --rank 8."),
    (["--rank", "abc"], "argument --rank: invalid int value: 'abc'; see --help."),
    (["--alpha", "-2"], "LoRA alpha must be a positive number, got -2.0"),
    (["--local-batch-size", "0"], "--local-batch-size must be a positive integer, got 0."),
    (["--max-steps", "-3"], "--max-steps must be a positive integer, got -3."),
    (["--max-steps", "ten"], "argument --max-steps: invalid int value: 'ten'"),
    (["--num-processes", "64"], "64 processes asked for but this machine has"),
    (["--resume"], "--resume continues an existing results folder; name it with --output-dir."),
    # checked on the model's config (meta device), with the data files, before the folder is created
    (["--targets", "q_proj"], "LoRA target module 'q_proj' matches nothing in GPT2LMHeadModel"),
])
def test_bad_input_from_the_command_line_is_one_sentence_and_writes_nothing(tmp_path, capsys, args, expected):
    out = tmp_path / "out"
    proc = cli(args + (["--output-dir", out] if "--resume" not in args else []), capsys)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error: " in lines[0] and expected in lines[0], proc.stderr[-2000:]
    assert_one_sentence(lines[0])
    assert not out.exists()


@pytest.mark.skipif(not launch.is_cpu_only(), reason="fp16 is refused on a CPU only")
def test_fp16_on_a_cpu_is_refused(tmp_path, capsys):
    proc = cli(["--mixed-precision", "fp16", "--output-dir", tmp_path / "out"], capsys)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("lora: error: fp16 mixed precision needs a GPU; on a CPU use --mixed-precision "
                                   "bf16 or no.")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not launch.is_cpu_only(), reason="Inductor needs a C++ compiler on a CPU only")
def test_compile_without_a_compiler_is_refused(tmp_path, capsys, monkeypatch):
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "cxx", (None, "no-such-compiler"))  # where Inductor looks ($CXX, else g++)
    proc = cli(["--compile", "--output-dir", tmp_path / "out"], capsys)
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert line.startswith("lora: error: torch.compile needs a C++ compiler on a CPU (") and line.endswith(
        "; install g++ or clang, or drop --compile."), line
    assert "\n" not in line and not (tmp_path / "out").exists()


def test_an_existing_results_folder_is_refused_before_anything_loads(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    proc = cli(["--output-dir", tmp_path / "taken"], capsys)
    assert proc.returncode == 2 and "already exists and is never overwritten" in proc.stderr
    assert_one_sentence(proc.stderr)
    assert list((tmp_path / "taken").iterdir()) == []


def test_resume_without_a_checkpoint_stops_and_leaves_the_folder_as_it_was(tmp_path, capsys):
    run = Run.create(tmp_path / "crashed", config={"preset": "tiny"}, world_size=1)
    run.log_metrics({"step": 1, "loss": 2.0})
    run.fail("RuntimeError: before the first checkpoint")
    early = Run.create(tmp_path / "early", config={"preset": "tiny"}, world_size=1)
    early.fail("interrupted: Ctrl-C", status="interrupted")
    for path, said in [(run.path, "There is no checkpoint in .* rerun without --resume"),
                       (early.path, "stopped before its first step, so there is nothing to resume; the same command "
                                    "without --resume starts it again")]:
        before = {p.name: p.read_bytes() for p in path.iterdir()}
        proc = cli(["--resume", "--output-dir", path], capsys)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert re.search(said, proc.stderr), proc.stderr
        assert_one_sentence(proc.stderr.strip().splitlines()[-1])
        assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # never restarted from scratch


# ------------------------------------------------------------------------------------------ Python API


ADAPTER_FIELDS = {f.name for f in dataclasses.fields(AdapterSpec)}


def lora_config(**changes) -> lora.Config:
    """The LoRA workflow's Config with ``changes``; the adapter's fields (rank, alpha, targets...) go into its
    AdapterSpec, as their flags do."""
    adapter = {key: changes.pop(key) for key in list(changes) if key in ADAPTER_FIELDS}
    return lora.Config(**changes, **({"adapter": AdapterSpec(**adapter)} if adapter else {}))


def check(tmp_path, **changes):
    """What ``train`` runs before it opens the results folder; the folder must not appear."""
    cfg = lora_config(**{"output_dir": str(tmp_path / "out"), **changes})
    try:
        preset = lora.validate(cfg)
        lora.load_inputs(lora.resolve(cfg, preset, 1), preset, world_size=1)
    finally:
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("changes, message", [
    ({"rank": -1}, "LoRA rank must be a positive integer, got -1"),
    ({"rank": 2.5}, "LoRA rank must be a positive integer, got 2.5"),
    ({"alpha": 0}, "LoRA alpha must be a positive number, got 0"),
    ({"alpha": math.nan}, "LoRA alpha must be a positive number, got nan"),
    ({"alpha": "16"}, "LoRA alpha must be a positive number, got '16'"),
    ({"local_batch_size": -1}, "--local-batch-size must be a positive integer, got -1"),
    ({"local_batch_size": "8"}, "--local-batch-size must be a positive integer, got '8'"),
    ({"max_steps": 0}, "--max-steps must be a positive integer, got 0"),
    ({"max_steps": 1.5}, "--max-steps must be a positive integer, got 1.5"),
    ({"learning_rate": math.inf}, "--learning-rate must be a positive number, got inf"),
    ({"learning_rate": -1e-4}, "--learning-rate must be a positive number"),
    ({"grad_accum": 0}, "--grad-accum must be a positive integer"),
    ({"eval_rows": 0}, "--eval-rows must be a positive integer"),
    ({"save_steps": 0}, "--save-steps must be a positive integer"),
    ({"timeout_s": 0}, "--timeout-s must be a positive number"),
    ({"dropout": 1.5}, "--dropout must be at least 0 and below 1"),
    ({"method": "qlora"}, "Unknown method 'qlora'; choose one of lora, full"),
    ({"mixed_precision": "fp8"}, "Unknown mixed precision 'fp8'; choose one of auto, no, fp16, bf16"),
    ({"quantize": "4bit", "random_init": True}, "Quantization needs pretrained weights"),
    ({"targets": ()}, "--targets names no module"),
    ({"targets": ("c_attn", "query")}, "LoRA target module 'query' matches nothing"),
    ({"targets": ("ln_1",)}, "LoRA target module 'ln_1' is a LayerNorm, which LoRA cannot adapt"),
    ({"targets": ("act",)}, "LoRA target module 'act' is a NewGELUActivation, which LoRA cannot adapt"),
    ({"targets": ("h",)}, "LoRA target module 'h' is a ModuleList, which LoRA cannot adapt"),
    ({"targets": ("attn",)}, "LoRA target module 'attn' is a GPT2Attention, which LoRA cannot adapt"),
    ({"max_length": 512}, r"max_length 512 is longer than the model allows \(256\); use --max-length 256"),
    ({"max_length": 8}, "does not fit max_length 8; raise --max-length"),
    ({"local_batch_size": 4096}, "fewer than one global batch of 4096"),
    ({"packing": True, "group_by_length": True}, "--packing fills every row to --max-length, so there are no lengths"),
    ({"packing": True, "adapter_config": "configs/peft/prompt_tuning.json"},
     "--packing restarts the position ids at every example, which PROMPT_TUNING"),
    ({"packing": True, "local_batch_size": 1024}, "The dataset has .* rows, fewer than one global batch of 1024"),
])
def test_bad_settings_are_one_sentence_before_the_folder_exists(tmp_path, changes, message):
    with pytest.raises(UserError, match=message) as e:
        check(tmp_path, **changes)
    assert_one_sentence(str(e.value))


@pytest.mark.parametrize("content, message", [
    (b"", "is empty; give it at least one row with instruction, input, output"),
    ("".join(json.dumps(r) + "\n" for r in rows(12)).encode(), "has 11 rows, fewer than one global batch of 16"),
    ('{"instruction": "Say hi", "input": "", "output": "h\xe9"}\n'.encode("latin-1"), "is not UTF-8 .*re-save it"),
    (b'{"instruction": "Say hi", "output": "hi"}\n', "has no column 'input'; every row needs instruction"),
    (b'{"instruction": "Say hi", "input": "", "output": "hi"\n', "Line 1 of .* is not valid JSON"),
    (b'{"instruction": "Add 2 and 2.", "input": "", "output": 4}\n' * 2, "has int 4 in column 'output', not text"),
    (b'{"instruction": "Say hi", "input": "", "output": "' + b"hi" * 600_000 + b'"}\n',
     "Line 1 of .* is 1,200,052 characters long, over the 1,000,000 a row may hold"),  # tokenizing it takes minutes
])
def test_bad_data_files_are_one_sentence_before_the_folder_exists(tmp_path, content, message):
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    with pytest.raises(UserError, match=message) as e:
        check(tmp_path, data_file=str(data))
    assert_one_sentence(str(e.value))


def test_a_results_folder_that_cannot_be_created(tmp_path):
    (tmp_path / "a file").write_text("")
    with pytest.raises(UserError, match="cannot be created because .*a file is a file; choose another") as e:
        lora.validate(lora.Config(output_dir=str(tmp_path / "a file" / "runs" / "lora")))
    assert_one_sentence(str(e.value))


def test_a_missing_data_file_is_one_sentence(tmp_path):
    with pytest.raises(UserError, match="does not exist; check the path") as e:
        check(tmp_path, data_file=str(tmp_path / "nowhere.jsonl"))
    assert_one_sentence(str(e.value))


def test_more_processes_than_cores_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "max_processes", lambda: 2)
    with pytest.raises(UserError, match="3 processes asked for but this machine has 2"):
        check(tmp_path, num_processes=3)


def _finished_run(path: Path, status: str, **changes) -> Path:
    # as a real run records it: every default resolved ("auto" precision settled to what this machine runs)
    recorded = lora.resolve(lora_config(output_dir=str(path), **changes), get_preset("tiny"), 1)
    run = Run.create(path, config=as_record(recorded), world_size=1)
    if status == "complete":
        run.finish({"steps": 1})
    else:
        run.fail("boom")
    return path


@pytest.mark.parametrize("status, config, resume_changes, message", [
    ("complete", {}, {}, "is already complete; there is nothing to resume"),
    ("failed", {}, {"rank": 16}, "was started with --rank 8, not 16; resume with the same settings"),
    ("failed", {"targets": ("c_attn",)}, {"targets": ("c_fc",)}, "was started with --targets"),
    ("failed", {}, {"dora": True}, "was started with --dora False, not True"),
    ("failed", {}, {"learning_rate": 1e-3}, "was started with --learning-rate 0.004, not 0.001"),
])
def test_resume_refuses_what_it_cannot_continue(tmp_path, status, config, resume_changes, message):
    folder = _finished_run(tmp_path / "run", status, **config)
    before = (folder / "run.json").read_bytes()
    cfg = lora_config(output_dir=str(folder), resume=True, **{**config, **resume_changes})
    with pytest.raises(UserError, match=message) as e:
        lora.validate(cfg)
    assert_one_sentence(str(e.value))
    assert (folder / "run.json").read_bytes() == before


@pytest.mark.slow
def test_a_running_run_is_refused_while_its_writer_lives_and_reads_as_crashed_once_it_is_gone(tmp_path,
                                                                                                held_elsewhere):
    from my_utils.run.locks import release_folder
    from my_utils.run.results import load_run

    folder = _finished_run(tmp_path / "run", "failed")
    Run(folder).update(status="running")  # as a live run records itself
    release_folder(folder)
    with held_elsewhere(folder):
        assert load_run(folder)["run"]["status"] == "running"
        with pytest.raises(UserError, match=r"is still running \(process \d+\); let it finish") as e:
            lora.validate(lora_config(output_dir=str(folder), resume=True))
        assert_one_sentence(str(e.value))
    assert load_run(folder)["run"]["status"] == "crashed"  # SIGKILL left "running" behind; every reader says so
    assert json.loads((folder / "run.json").read_text())["status"] == "running"  # reading changed nothing


def test_resume_of_a_folder_that_is_not_there(tmp_path):
    with pytest.raises(UserError, match="There is no results folder at .* to resume"):
        lora.validate(lora.Config(output_dir=str(tmp_path / "gone"), resume=True))
    assert not (tmp_path / "gone").exists()


def test_resume_may_change_how_it_runs(tmp_path):
    from my_utils.run.checkpoints import write_checkpoint_manifest

    folder = _finished_run(tmp_path / "run", "failed")
    checkpoint = folder / lora.CHECKPOINTS / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    write_checkpoint_manifest(checkpoint)
    before = (folder / "run.json").read_bytes()
    # where and how it runs may change (the timeout, how often it saves); what it trains may not
    assert lora.validate(lora.Config(output_dir=str(folder), resume=True, timeout_s=60, save_steps=5)).name == "tiny"
    with pytest.raises(UserError, match="was started with --max-steps"):
        lora.validate(lora.Config(output_dir=str(folder), resume=True, timeout_s=60, save_steps=5, max_steps=7))
    assert (folder / "run.json").read_bytes() == before


# ------------------------------------------------------------------------------------------ what must work


def test_paths_with_spaces_and_non_ascii_letters_work(tmp_path):
    data = write_rows(tmp_path / "dätä mit Leerzeichen" / "my rows ünïcode.jsonl", rows(100))
    out = tmp_path / "rüns ünd spaces" / "lora run"
    cfg = lora.Config(data_file=str(data), output_dir=str(out))
    preset = lora.validate(cfg)
    inputs = lora.load_inputs(lora.resolve(cfg, preset, 1), preset, world_size=1)
    assert len(inputs["train_set"]) == 90 and len(inputs["eval_rows"]) == 10  # a tenth is held out
    run = Run.create(out, config=dataclasses.asdict(cfg))
    assert json.loads((out / "run.json").read_text(encoding="utf-8"))["config"]["data_file"] == str(data)
    assert run.path == out
    # the whole run under such paths, end to end: tests/test_reliability.py (the offline 1-process run)


def test_a_stray_accelerate_default_config_is_ignored_with_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("ACCELERATE_CONFIG_FILE", raising=False)
    assert launch.stray_config_note() is None
    stray = tmp_path / "accelerate" / "default_config.yaml"
    stray.parent.mkdir()
    stray.write_text("distributed_type: MULTI_CPU\nnum_processes: 4\nmixed_precision: fp16\n")
    assert accelerate_default_config() == stray
    launch.clean_env()
    note = capsys.readouterr().err
    assert f"ignoring the accelerate default config {stray}" in note and "--config_file" in note
    cmd = launch.accelerate_command("my_utils.workflows.lora", [], num_processes=2)
    assert cmd[cmd.index("--config_file") + 1].endswith(("cpu_x2.yaml", "multi_gpu.yaml"))
    # a 2-process run with this stray config in place: tests/test_reliability.py (the 2-process baseline)


# ------------------------------------------------------------------------------------------ safety


def test_secrets_never_reach_run_json(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-value-123")
    token = "hf_" + "a1B2" * 8
    command = ["lora.py", "--hub-token", token, "--password=hunter22", "--note", "key wandb-secret-value-123",
               "--rank", "8", "--max-new-tokens", "16"]
    config = {"rank": 8, "max_new_tokens": 16, "hf_token": token, "nested": {"api_key": "abc", "keyboard": "qwerty"},
              "data_file": f"/data/{token}/rows.jsonl"}
    Run.create(tmp_path / "r", config=config, command=command)
    text = (tmp_path / "r" / "run.json").read_text(encoding="utf-8")
    for secret in (token, "hunter22", "wandb-secret-value-123", '"abc"'):
        assert secret not in text
    info = json.loads(text)
    assert info["command"] == ["lora.py", "--hub-token", REDACTED, f"--password={REDACTED}", "--note",
                               f"key {REDACTED}", "--rank", "8", "--max-new-tokens", "16"]
    assert info["config"]["rank"] == 8 and info["config"]["max_new_tokens"] == 16
    # the config is compared on --resume: each secret by its hash, which tells two secrets apart
    assert info["config"]["nested"] == {"api_key": secret_hash("abc"), "keyboard": "qwerty"}
    assert info["config"]["hf_token"] == secret_hash(token) != secret_hash(token + "x")
    assert info["config"]["data_file"] == f"/data/{secret_hash(token)}/rows.jsonl"


def test_remote_code_is_off_unless_asked_for(monkeypatch):
    import transformers

    from my_utils.core.models import build_causal_lm, load_tokenizer
    from my_utils.core.presets import get_preset

    seen = []

    def fake_from_pretrained(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code", "missing"))
        raise RuntimeError("stop here")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_from_pretrained)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    for build in (load_tokenizer, build_causal_lm):
        with pytest.raises(RuntimeError, match="stop here"):
            build(get_preset("tiny"))
        with pytest.raises(RuntimeError, match="stop here"):
            build(get_preset("tiny"), trust_remote_code=True)
    assert seen == [False, True, False, True]
    assert lora.parse_args([]).trust_remote_code is False
    assert lora.parse_args(["--trust-remote-code"]).trust_remote_code is True


def unsafe_torch_loads(text: str) -> list[str]:
    """The ``torch.load(...)`` calls in ``text`` that do not pass weights_only=True (pickles can run code)."""
    calls = []
    for m in re.finditer(r"torch\.load\(", text):
        depth = 0
        for end in range(m.end() - 1, len(text)):  # the whole call, up to its closing parenthesis
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        calls.append(text[m.start():end + 1])
    return [c for c in calls if not re.search(r"weights_only\s*=\s*True", c)]


def test_every_torch_load_is_restricted_to_tensors():
    assert unsafe_torch_loads("a = torch.load(f(x), map_location='cpu')\nb = torch.load(p, weights_only=True)") == [
        "torch.load(f(x), map_location='cpu')"]
    for path in [*REPO_ROOT.glob("my_utils/**/*.py"), *REPO_ROOT.glob("scripts/*.py"), *REPO_ROOT.glob("tests/*.py")]:
        if path.name != Path(__file__).name:
            assert unsafe_torch_loads(path.read_text(encoding="utf-8")) == [], path


def test_the_secret_redactor_leaves_ordinary_words_and_file_names_alone():
    from my_utils.run.redaction import redact_secrets

    names = ["runs/task-classification-eval-rows-1234567/rows.jsonl", "/mnt/disk-0123456789abcdefghij/data.jsonl",
             "ask-the-model-what-it-learned-today.txt", "flask-app-configuration-production"]
    assert redact_secrets(names) == names
    token = "sk-" + "Ab1_" * 6
    assert redact_secrets([f"/keys/{token}/x", f"key={token}"]) == [f"/keys/{REDACTED}/x", f"key={REDACTED}"]


# ------------------------------------------------------------------------------------------ every command


# Hostile inputs to every command, run in this process as the shell runs them: (command, arguments, what the one
# sentence says). "{tmp}" is the test's folder (files below), "{run}" a complete results folder inside it.
TOKEN = "hf_" + "Zq8" * 10  # token-shaped
HOSTILE = [
    ("lora", ["--output-dir", "{run}/adapter"], "is inside the results folder .*; choose an --output-dir outside"),
    ("lora", ["--output-dir", ""], "--output-dir is empty; name a new folder"),
    ("lora", ["--report-to", "tensorbord"], "--report-to tensorbord is not a tracker; choose from none, all, tensorboard"),
    ("ddp", ["--report-to", "wandb"], "--report-to wandb: wandb is not installed; pip install wandb first"),
    ("sharding", ["--report-to", "trackio"], r"trackio is not installed; pip install -e \"\.\[trackio\]\" first"),
    ("lora", ["--rank", "100000"], "LoRA rank 100000 is above the width of 'c_attn' \\(192\\)"),
    ("lora", ["--data-file", "{tmp}/null.jsonl"], "Line 1 of .* is null, not an object with instruction"),
    ("lora", ["--data-file", "{tmp}/string.jsonl"], 'Line 1 of .* is "just a string", not an object'),
    ("lora", ["--data-file", "{tmp}/folder.jsonl"], "is a folder; give the path of a JSON-lines file inside it"),
    ("lora", ["--data-file", "{tmp}/one_row.jsonl"], "has 1 row; it needs at least 2"),
    ("lora", ["--seed", "-1"], "--seed must be an integer from 0 to 2\\*\\*32 - 1, got -1"),
    # a secret in a refused value or path is not echoed
    ("lora", ["--data-file", "{tmp}/" + TOKEN + "/rows.jsonl"], "Data file .*/<redacted>/rows.jsonl does not exist"),
    ("lora", ["--seed", TOKEN], "argument --seed: invalid int value: '<redacted>'"),
    ("lora", ["--max-length", "100000000"], "max_length 100000000 is longer than the model allows \\(256\\)"),
    ("dpo", ["--data-file", "{tmp}/no_rejected.jsonl"], "Line 2 of .* has no column 'rejected'; every row needs "
     "prompt, chosen, rejected"),
    ("dpo", ["--beta", "abc"], "argument --beta: invalid float value: 'abc'"),
    ("dpo", ["--beta", "0"], "--beta must be a positive number, got 0.0"),
    ("dpo", ["--output-dir", "{run}/dpo"], "is inside the results folder"),
    ("dpo", ["--preset", "gpt2", "--random-init"], "The alpaca data has no preference pairs shipped; give --data-file"),
    ("grpo", ["--reward", "length"], "argument --reward: invalid choice: 'length'"),
    ("grpo", ["--num-generations", "3"], "--num-generations 3 does not divide the global batch of 8 answers"),
    ("grpo", ["--beta", "nan"], "--beta must be a number from 0 up, got nan"),
    ("grpo", ["--data-file", "{tmp}/one_row.jsonl"], "has 1 row; it needs at least 2"),
    ("plan", ["--memory", "0"], "The memory size '0' is not positive"),
    ("plan", ["--memory=-5GiB"], "Cannot read the memory size '-5GiB'"),
    ("plan", ["--max-length", "100000000"], "--max-length 100000000 is longer than tiny allows \\(256 positions\\)"),
    ("plan", ["--rank", "100000"], "LoRA rank 100000 is above the width of the layers it adapts \\(192\\)"),
    ("plan", ["--zero", "2"], "ZeRO shards over processes: --zero 2 needs --processes 2 or more"),
    ("plan", ["--zero", "4"], "argument --zero: invalid choice: 4"),
    ("plan", ["--method", "qlora", "--zero", "1", "--processes", "2"], "ZeRO-1 shards the optimizer states"),
    ("plan", ["--method", "qlora-8bit", "--zero", "3", "--processes", "2"], "models ZeRO over 4-bit weights only"),
    ("plan", ["--preset", "smollm2-135m", "--method", "full", "--tp", "2"],
     "The model's attention heads, 9, do not split over 2 processes"),  # tensor_parallel's own sentence
    ("plan", ["--preset", "gpt2", "--method", "full", "--tp", "2"], "The tensor-parallel plan is written for Llama"),
    ("plan", ["--method", "full", "--tp", "2", "--sequence-parallel", "--max-length", "63"],
     "--sequence-parallel splits each sequence over the processes and --max-length 63 does not split over 2"),
    ("plan", ["--method", "lora", "--tp", "2"], "models tensor parallel for full fine-tuning"),
    ("plan", ["--tp", "0"], "--tp must be a positive integer, got 0"),
    ("plan", ["--pp", "9"], "9 stages for a model of 4 layers leave a stage without one"),  # pipeline_parallel's
    ("plan", ["--pp", "2", "--microbatches", "3"], "A batch of 16 sequences does not split into 3 equal micro-batches"),
    ("plan", ["--pp", "4", "--microbatches", "2"], "1F1B needs at least one micro-batch per stage"),
    ("plan", ["--method", "full", "--pp", "2", "--processes", "2", "--zero", "3"], "models ZeRO-1 with pipeline parallel"),
    ("plan", ["--method", "qlora", "--pp", "2"], "does not model quantized weights or gradient checkpointing with --tp"),
    ("compare", ["{run}", "--output-dir", "{tmp}/a_file"], "--output-dir .* is a file; name a folder"),
    ("compare", ["{run}", "--output-dir", "{tmp}/compared"], "already holds a comparison, which is never overwritten"),
    ("compare", ["{run}", "--output-dir", "{run}/comparison"], "is inside the results folder"),
    ("sweep", ["--spec", "{tmp}/missing.json"], "Sweep spec .* does not exist"),
    ("sweep", ["--spec", "{tmp}/not_json.json"], "Sweep spec .* is not valid JSON \\(line 1"),
    ("sweep", ["--spec", "{tmp}/unknown_key.json"], "Sweep spec .* has an unknown key 'grid'"),
    ("sweep", ["--max-steps", "0", "--output-dir", "{tmp}/sweep"], "--max-steps must be a positive integer, got 0"),
    ("sweep", ["--output-dir", "{run}/sweep"], "is inside the results folder"),
    ("bench", ["--output-root", "{run}/bench"], "is inside the results folder"),
    ("demo", ["--processes", "0"], "--processes must be a positive integer, got 0"),
    ("demo", ["--processes", "4096"], "4096 processes asked for but this machine has"),
    ("demo", ["--preset", "gtp2"], "Unknown preset 'gtp2'; did you mean 'gpt2'"),
]


def _hostile_folder(tmp: Path) -> None:
    """The files the hostile inputs name."""
    (tmp / "null.jsonl").write_text("null\n", encoding="utf-8")
    (tmp / "string.jsonl").write_text('"just a string"\n', encoding="utf-8")
    (tmp / "folder.jsonl").mkdir()
    write_rows(tmp / "one_row.jsonl", rows(1))
    write_rows(tmp / "no_rejected.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": "a"}])
    (tmp / "a_file").write_text("", encoding="utf-8")
    (tmp / "compared").mkdir()
    (tmp / "compared" / "comparison.md").write_text("an earlier comparison\n", encoding="utf-8")
    (tmp / "not_json.json").write_text("{grids: [}", encoding="utf-8")
    (tmp / "unknown_key.json").write_text('{"grid": {"rank": [4]}}', encoding="utf-8")
    Run.create(tmp / "run", config={"preset": "tiny"}, world_size=1).finish({"steps": 1})


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


@pytest.mark.parametrize("command, args, expected", HOSTILE, ids=[f"{c} {' '.join(a)}" for c, a, _ in HOSTILE])
def test_every_command_refuses_hostile_input_in_one_sentence_and_writes_nothing(tmp_path, capsys, command, args,
                                                                               expected):
    from importlib import import_module

    import my_utils.__main__

    _hostile_folder(tmp_path)
    before = _snapshot(tmp_path)
    argv = [a.replace("{run}", str(tmp_path / "run")).replace("{tmp}", str(tmp_path)) for a in args]
    with pytest.raises(SystemExit) as e:
        if command in ("lora", "ddp", "sharding", "dpo", "grpo"):  # a workflow's own command line
            import_module(f"my_utils.workflows.{command}").main(argv)
        else:
            my_utils.__main__.main([command, *argv])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(lines) == 1 and re.search(expected, lines[0]), lines
    assert_one_sentence(lines[0])
    assert _snapshot(tmp_path) == before


def test_a_data_file_with_a_byte_order_mark_reads_like_any_other(tmp_path):
    from my_utils.core.data import INSTRUCTION_COLUMNS, read_jsonl

    data = write_rows(tmp_path / "plain.jsonl", rows(3))
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + data.read_bytes())  # as some Windows editors save UTF-8
    assert read_jsonl(marked, INSTRUCTION_COLUMNS) == read_jsonl(data, INSTRUCTION_COLUMNS) == rows(3)


def test_a_results_folder_whose_run_json_cannot_be_written_is_removed_again(tmp_path, monkeypatch):
    from my_utils.run import results

    def disk_full(path, obj):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(results, "atomic_write_json", disk_full)
    with pytest.raises(OSError, match="No space left"):
        Run.create(tmp_path / "run", config={})
    assert not (tmp_path / "run").exists()  # an empty folder would block the retry


def test_a_tokenizer_without_an_end_of_sequence_token_is_one_sentence(monkeypatch):
    import transformers

    from my_utils.core.models import load_tokenizer

    tokenizer = transformers.AutoTokenizer.from_pretrained(get_preset("tiny").require("causal"))
    tokenizer.eos_token = None
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: tokenizer)
    with pytest.raises(UserError, match="has no end-of-sequence token") as e:
        load_tokenizer(get_preset("tiny"))
    assert_one_sentence(str(e.value))


def test_a_model_neither_cached_nor_downloadable_is_one_sentence_at_once(monkeypatch):
    import socket

    import huggingface_hub
    from huggingface_hub import constants

    from my_utils.core.models import check_available

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: None)  # an empty cache
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="gpt2 is not in the Hugging Face cache and HF_HUB_OFFLINE=1 forbids"):
        check_available("gpt2")

    def unreachable(address, timeout):
        raise OSError("Name or service not known")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    with pytest.raises(UserError, match="gpt2 is not in the Hugging Face cache and huggingface.co cannot be reached"):
        check_available("gpt2")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: "/cache/gpt2/config.json")
    check_available("gpt2")  # cached: nothing to download
    check_available(str(REPO_ROOT / "assets" / "tiny" / "causal_lm"))  # a local folder


@pytest.mark.parametrize("command, args", [
    ("compare", ["{run}", "--output-dir", "{tmp}/compared_again"]),
    ("sweep", ["--output-dir", "{tmp}/sweep"]),
    ("bench", ["--output-root", "{tmp}/bench"]),
])
def test_a_read_only_folder_is_one_sentence_and_exit_2(tmp_path, capsys, monkeypatch, command, args):
    """Every folder made refused as a read-only file system refuses it (root writes through chmod, so the refusal is
    played), before anything is written."""
    import errno

    import my_utils.__main__

    Run.create(tmp_path / "run", config={"preset": "tiny"}, world_size=1).finish({"steps": 1})

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(SystemExit) as e:
        my_utils.__main__.main([command, *(a.replace("{run}", str(tmp_path / "run")).replace("{tmp}", str(tmp_path))
                                           for a in args)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(lines) == 1, lines
    assert re.search(r"The file system refused writing .* \(Read-only file system\); choose a results folder where you can write", lines[0])
    assert_one_sentence(lines[0])
