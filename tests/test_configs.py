"""The shipped accelerate configs load with accelerate's own config classes, say how to launch them, turn into a
valid launch (the FSDP and DeepSpeed plugins are built from them), and the DeepSpeed JSON files they name parse."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.utils import DistributedType

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIGS = REPO_ROOT / "configs"
# name: (distributed type, processes, machines, use_cpu)
EXPECTED = {
    "cpu_x1": (DistributedType.NO, 1, 1, True),
    "cpu_x2": (DistributedType.MULTI_GPU, 2, 1, True),
    "single_gpu": (DistributedType.NO, 1, 1, False),
    "multi_gpu": (DistributedType.MULTI_GPU, 2, 1, False),
    "multi_node": (DistributedType.MULTI_GPU, 4, 2, False),
    "fsdp": (DistributedType.FSDP, 2, 1, False),
    "deepspeed_zero2": (DistributedType.DEEPSPEED, 2, 1, False),
    "deepspeed_zero3": (DistributedType.DEEPSPEED, 2, 1, False),
}
DEEPSPEED_STAGES = {"deepspeed_zero2": (2, "zero2_config.json", False), "deepspeed_zero3": (3, "zero3_config.json", True)}


def test_every_shipped_config_is_checked():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == set(EXPECTED)


@pytest.mark.parametrize("name", EXPECTED)
def test_config_loads_with_accelerate(name):
    config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    assert isinstance(config, ClusterConfig)
    kind, processes, machines, use_cpu = EXPECTED[name]
    assert config.distributed_type == kind
    assert (config.num_processes, config.num_machines, config.use_cpu) == (processes, machines, use_cpu)
    if machines > 1:
        assert config.main_process_ip and config.main_process_port, "several machines need the first one's address"


@pytest.mark.parametrize("name", EXPECTED)
def test_config_opens_with_its_launch_command(name):
    lines = (CONFIGS / f"{name}.yaml").read_text().splitlines()
    assert lines[0].startswith("# "), f"{name}.yaml must open with a comment"
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    assert any(f"accelerate launch --config_file configs/{name}.yaml" in line for line in header), header


def _launch_args(name):
    """The arguments `accelerate launch --config_file configs/<name>.yaml -m x` ends up with."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / f"{name}.yaml"), "-m", "x"])
    args, defaults, _ = _validate_launch_command(args)
    return args, defaults


def test_cpu_x2_starts_two_synchronised_cpu_workers():
    # MULTI_CPU would start one process; MULTI_GPU with use_cpu starts N workers that use gloo.
    args, _ = _launch_args("cpu_x2")
    assert args.multi_gpu and args.use_cpu and args.num_processes == 2


def test_fsdp_config_builds_the_fsdp_plugin(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _ = _launch_args("fsdp")
    assert args.use_fsdp
    env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"


@pytest.mark.parametrize("name", DEEPSPEED_STAGES)
def test_deepspeed_config_names_a_json_file_of_its_stage(name, monkeypatch):
    stage, json_name, zero3_init = DEEPSPEED_STAGES[name]
    config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    path = config.deepspeed_config["deepspeed_config_file"]
    assert path == f"configs/{json_name}", "the path is relative to the repository root, where launches run"
    settings = json.loads((REPO_ROOT / path).read_text())
    assert settings["zero_optimization"]["stage"] == stage
    assert config.deepspeed_config["zero3_init_flag"] is zero3_init
    # The accelerate fields that a DeepSpeed JSON file replaces must not be set twice.
    assert config.mixed_precision is None and "gradient_accumulation_steps" not in config.deepspeed_config

    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    monkeypatch.chdir(REPO_ROOT)
    args, defaults = _launch_args(name)
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    _, env = prepare_deepspeed_cmd_env(args)
    for key, value in env.items():
        if "DEEPSPEED" in key:
            monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == stage and plugin.zero3_init_flag is zero3_init
    assert plugin.deepspeed_config["zero_optimization"] == settings["zero_optimization"]


@pytest.mark.parametrize("json_name", ["zero2_config.json", "zero3_config.json"])
def test_deepspeed_json_leaves_script_values_to_auto(json_name):
    settings = json.loads((CONFIGS / json_name).read_text())
    # "auto" lets accelerate and the Trainer fill these from the script, so they never disagree with it.
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        assert settings[key] == "auto", key
    assert settings["bf16"]["enabled"] == "auto" and settings["fp16"]["enabled"] == "auto"


def test_the_shipped_sharding_configs_do_what_the_sharding_lesson_teaches():
    """Lesson 10: ZeRO-3 gathers a block's weights for its use and frees them after (FSDP2's reshard_after_forward;
    DeepSpeed's live-parameter and reuse limits at 0, which the lesson's own runs use), ZeRO-2 keeps the gradients
    sharded. DeepSpeed's defaults (1e9 each) would keep every gathered weight of a smaller model."""
    import yaml

    from my_utils.workflows.sharding import deepspeed_zero

    zero3 = json.loads((CONFIGS / "zero3_config.json").read_text())["zero_optimization"]
    assert zero3["stage"] == 3
    for key in ("stage3_max_live_parameters", "stage3_max_reuse_distance"):
        assert zero3[key] == deepspeed_zero(3)[key] == 0, key
    assert json.loads((CONFIGS / "zero2_config.json").read_text())["zero_optimization"]["stage"] == 2
    fsdp = yaml.safe_load((CONFIGS / "fsdp.yaml").read_text())["fsdp_config"]
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_reshard_after_forward"] is True


# ---------------------------------------------------------------------------------------------- CPU launches

CPU_LAUNCH = "accelerate launch --config_file configs/cpu_x2.yaml"


def readme_cpu_launchers() -> list[str]:
    """The launchers of the CPU multi-process commands of the README and docs/ (the part before ``-m module ...``)."""
    pages = [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md")]
    lines = [line for page in pages for line in page.read_text(encoding="utf-8").splitlines()]
    return sorted({line.strip().split(" -m ")[0] for line in lines
                   if CPU_LAUNCH in line or line.strip().startswith(("torchrun", "ACCELERATE_USE_CPU=1 torchrun"))})


def test_every_shown_cpu_launch_sets_accelerate_use_cpu():
    assert readme_cpu_launchers() == [f"ACCELERATE_USE_CPU=1 {CPU_LAUNCH}",
                                      "ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2"]
    shown = [*REPO_ROOT.glob("my_utils/**/*.py"), *REPO_ROOT.glob("notebooks/*.ipynb"), *CONFIGS.glob("*.yaml")]
    for path in shown:
        text = path.read_text(encoding="utf-8")
        assert text.count(CPU_LAUNCH) == text.count(f"ACCELERATE_USE_CPU=1 {CPU_LAUNCH}"), path


@pytest.mark.slow
def test_accelerate_test_passes_with_two_processes_on_the_cpu(subprocess_env):
    """accelerate's own check, through the shipped CPU config as the README launches it."""
    env = {k: v for k, v in subprocess_env.items() if k != "ACCELERATE_USE_CPU"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    proc = subprocess.run("ACCELERATE_USE_CPU=1 accelerate test --config_file configs/cpu_x2.yaml", shell=True,
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Test is a success" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("Num processes: 2") == 2, proc.stdout[-3000:]
