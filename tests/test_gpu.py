"""What only a machine with GPUs exercises, skipped elsewhere (as accelerate's ``require_cuda`` tests are). On one GPU:
the LoRA workflow launched through accelerate with CUDA's memory counters in its report, and 4-bit QLoRA on
bitsandbytes' CUDA kernels. On 2 or more: DDP over nccl, the GPU configs launched through accelerate (FSDP2,
DeepSpeed ZeRO-2 and ZeRO-3), and every rank's counters.

    pytest -m gpu        # on a GPU machine; the tests that need 2 GPUs skip themselves on one
                         # (DeepSpeed's: pip install -e ".[deepspeed]")
"""

import importlib.util
import json
import math
import subprocess

import pytest

from my_utils.core.paths import REPO_ROOT
from my_utils.run.launch import accelerate_command, clean_env


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs 2 or more GPUs")
TINY = ["--preset", "tiny", "--max-steps", "2", "--local-batch-size", "2"]


def _launch(module: str, config: str, run_dir, *extra, processes: int = 2) -> list[dict]:
    """Launch ``module`` on ``processes`` GPUs through ``configs/<config>``; returns what each worker reported."""
    cmd = accelerate_command(module, [*TINY, *extra, "--output-dir", run_dir], num_processes=processes,
                             config_file=REPO_ROOT / "configs" / config)
    proc = subprocess.run(cmd, env=clean_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "complete"
    return [json.loads(p.read_text()) for p in sorted((run_dir / "workers").glob("rank_*.json"))]


def _filled(report: dict) -> bool:
    """Whether CUDA's four columns are filled at every moment of one rank's memory report."""
    return all(report[moment][column] is not None for moment in ("begin", "first_step", "end")
               for column in ("allocated", "reserved", "peak_allocated", "peak_reserved"))


def test_lora_on_one_gpu_reports_cudas_memory_columns(tmp_path):
    _launch("my_utils.workflows.lora", "single_gpu.yaml", tmp_path / "run", "--eval-rows", "8", processes=1)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["mixed_precision"] == "bf16"  # auto, on a GPU with bf16
    [report] = summary["memory"]
    assert report["end"]["device"] == "cuda:0" and _filled(report)
    assert report["end"]["peak_allocated"] >= report["breakdown"]["weights"] > 0


def test_qlora_4bit_trains_on_bitsandbytes_cuda_kernels(tmp_path):
    _launch("my_utils.workflows.lora", "single_gpu.yaml", tmp_path / "run", "--quantize", "4bit", "--eval-rows", "8",
            "--logging-steps", "1", processes=1)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["quantization"]["bits"] == 4 and summary["memory"][0]["end"]["device"] == "cuda:0"
    assert math.isfinite(summary["train_loss_final"])


@two_gpus
def test_ddp_runs_over_nccl_one_gpu_per_process(tmp_path):
    workers = _launch("my_utils.workflows.ddp", "multi_gpu.yaml", tmp_path / "run")
    assert [w["world_size"] for w in workers] == [2, 2] and {w["backend"] for w in workers} == {"nccl"}
    assert sorted(w["model_device"] for w in workers) == ["cuda:0", "cuda:1"]


@two_gpus
@pytest.mark.parametrize("config", ["fsdp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_the_sharded_gpu_configs_train_through_accelerate(tmp_path, config):
    if config.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip('DeepSpeed is an extra: pip install -e ".[deepspeed]"')
    workers = _launch("my_utils.workflows.accelerate_steps.step6_tracking", config, tmp_path / "run")
    assert [w["world_size"] for w in workers] == [2, 2] and {w["backend"] for w in workers} == {"nccl"}


@two_gpus
def test_cuda_memory_counters_fill_every_rank_report(tmp_path):
    _launch("my_utils.workflows.lora", "multi_gpu.yaml", tmp_path / "run", "--eval-rows", "8")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(summary["memory"]) == summary["world_size"] == 2
    for report in summary["memory"]:
        assert report["end"]["device"].startswith("cuda") and _filled(report)
        assert report["end"]["peak_allocated"] >= report["breakdown"]["weights"] > 0
