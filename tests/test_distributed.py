"""Data parallelism proven on a CPU with gloo:

- DDP over 2 processes with batch b ends with the same weights as 1 process with batch 2b, and as 1 process
  accumulating 2 batches of b;
- two machines simulated on localhost (two torchrun launches, one process each) form one world, each process
  placing the model on its local rank's device;
- notebook_launcher (my_utils.run.launch.launch), `accelerate launch` and `torchrun` each start workers that see the
  world size asked for (every worker writes what it sees into the results folder).
"""

import json
import subprocess
import sys
import textwrap

import pytest

from my_utils import UserError

TINY = ["--preset", "tiny", "--max-length", "32"]


def _run(cmd, env, expect_ok=True):
    out = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=600)
    if expect_ok:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _torchrun(nproc, *extra):
    return [sys.executable, "-m", "torch.distributed.run", *extra, "--nproc_per_node", str(nproc)]


def _workers(run_dir):
    return [json.loads(p.read_text()) for p in sorted((run_dir / "workers").glob("rank_*.json"))]


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(run_dir / "model" / "model.safetensors")


def _max_difference(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.slow
def test_ddp_equals_one_process_with_the_global_batch(tmp_path, subprocess_env):
    steps = ["--max-steps", "3", "--save-model", "--optimizer", "sgd", "--learning-rate", "0.1"]
    ddp, big, accumulated = tmp_path / "ddp_2x2", tmp_path / "one_1x4", tmp_path / "accum_2x2"
    _run([*_torchrun(2, "--standalone"), "-m", "my_utils.workflows.ddp", *TINY, *steps, "--local-batch-size", "2",
          "--output-dir", ddp], subprocess_env)
    single = [sys.executable, "-m", "my_utils.workflows.ddp", *TINY, *steps]
    _run([*single, "--local-batch-size", "4", "--output-dir", big], subprocess_env)
    _run([*single, "--local-batch-size", "2", "--grad-accum", "2", "--output-dir", accumulated], subprocess_env)

    assert [w["world_size"] for w in _workers(ddp)] == [2, 2]
    assert [w["world_size"] for w in _workers(big)] == [1]
    from safetensors.torch import load_file

    from my_utils.core.presets import get_preset

    trained = _weights(big)
    start = load_file(f"{get_preset('tiny').causal_model}/model.safetensors")
    moved = _max_difference(trained, {k: start[k] for k in trained})
    assert moved > 1e-3, "training did not change the weights: the comparison below would prove nothing"
    assert _max_difference(_weights(ddp), trained) < 1e-5
    assert _max_difference(_weights(accumulated), trained) < 1e-5
    losses = [json.loads((d / "summary.json").read_text())["train_loss_final"] for d in (ddp, big, accumulated)]
    assert losses == pytest.approx([losses[1]] * 3, rel=1e-4)


@pytest.mark.slow
def test_two_machines_on_one_host(tmp_path, subprocess_env):
    """Two launches of one process each, as two machines would, meeting at this machine's network address (its
    loopback address where it has no other: a launch across machines refuses loopback otherwise)."""
    from my_utils.core.devices import per_rank_device
    from my_utils.run.launch import free_port, network_address

    port = free_port()
    run_dir = tmp_path / "two_nodes"
    nodes = [
        subprocess.Popen([str(c) for c in [*_torchrun(1, "--nnodes", "2", "--node_rank", str(rank), "--master_addr",
                                                       network_address() or "127.0.0.1", "--master_port", str(port)),
                                           "-m", "my_utils.workflows.ddp", *TINY, "--max-steps", "2",
                                           "--local-batch-size", "2", "--output-dir", run_dir]],
                         env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    workers = _workers(run_dir)
    assert [w["world_size"] for w in workers] == [2, 2]
    assert [(w["process"], w["node_rank"], w["local_rank"]) for w in workers] == [(0, 0, 0), (1, 1, 0)]
    assert all(w["device_map"] == {"": per_rank_device(w["local_rank"])} for w in workers)
    assert all(w["model_device"] == per_rank_device(w["local_rank"]) for w in workers)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == "gloo"


def _notebook_launcher(module, args_dir):
    code = textwrap.dedent(f"""
        from my_utils.run.launch import launch
        from {module} import Config, train
        launch(train, Config(preset="tiny", max_length=32, local_batch_size=2, max_steps=2,
                             output_dir={str(args_dir)!r}, num_processes=2), num_processes=2)
    """)
    return [sys.executable, "-c", code]


# notebook_launcher and accelerate, each with a DDP workflow (the raw torch loop, the Trainer); torchrun runs the
# README's DDP line (tests/test_readme_commands.py). The lessons launch the DDP, LoRA and accelerate workflows
# through all three as well, and check the world size each worker saw.
LAUNCHES = [
    ("notebook_launcher", "my_utils.workflows.ddp"),
    ("accelerate", "my_utils.workflows.ddp_trainer"),
]


@pytest.mark.slow
@pytest.mark.parametrize("launcher, module", LAUNCHES, ids=[f"{launcher}-{m.rsplit('.', 1)[1]}" for launcher, m in LAUNCHES])
def test_every_worker_sees_the_world_size_asked_for(launcher, module, tmp_path, subprocess_env):
    from my_utils.run.launch import accelerate_command

    run_dir = tmp_path / "run"
    args = [*TINY, "--local-batch-size", "2", "--max-steps", "2", "--output-dir", run_dir]
    cmd = {
        "notebook_launcher": lambda: _notebook_launcher(module, run_dir),
        "accelerate": lambda: accelerate_command(module, args, num_processes=2),
        "torchrun": lambda: [*_torchrun(2, "--standalone"), "-m", module, *args],
    }[launcher]()
    _run(cmd, subprocess_env)
    workers = _workers(run_dir)
    assert [w["world_size"] for w in workers] == [2, 2], workers
    assert [w["process"] for w in workers] == [0, 1] and {w["backend"] for w in workers} == {"gloo"}
    assert len({w["pid"] for w in workers}) == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 4 and summary["tokens_per_s"] > 0


@pytest.mark.slow
def test_data_parallel_runs_in_one_process_and_refuses_several(tmp_path, subprocess_env):
    from my_utils.run.launch import accelerate_command

    one = tmp_path / "one"
    _run([sys.executable, "-m", "my_utils.workflows.data_parallel", *TINY, "--global-batch-size", "4", "--max-steps", "3",
          "--output-dir", one], subprocess_env)
    summary = json.loads((one / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["devices_used"] == ["cpu"] and summary["samples_per_s"] > 0
    refused = _run(accelerate_command("my_utils.workflows.data_parallel", [*TINY, "--output-dir", tmp_path / "two"],
                                      num_processes=2), subprocess_env, expect_ok=False)
    assert refused.returncode != 0 and "DataParallel is one process driving every GPU" in refused.stderr


def test_data_parallel_split_and_refusal():
    from my_utils.workflows.data_parallel import check_single_process, chunk_sizes

    assert chunk_sizes(10, 4) == [3, 3, 3, 1]  # what scatter does: torch.chunk along the batch
    assert chunk_sizes(2, 4) == [1, 1]  # fewer rows than GPUs: some GPUs idle
    assert chunk_sizes(8, 0) == [8]
    check_single_process(1)
    with pytest.raises(UserError, match="launch started 2"):
        check_single_process(2)


def test_ddp_config_errors_are_one_sentence():
    from my_utils.workflows.ddp import Config, validate

    with pytest.raises(UserError, match="--local-batch-size must be a positive integer"):
        validate(Config(local_batch_size=0))
    with pytest.raises(UserError, match="--untimed-steps must be at least 0 and below --max-steps"):
        validate(Config(max_steps=2, untimed_steps=2))
    with pytest.raises(UserError, match="Unknown learning-rate scaling"):
        validate(Config(lr_scaling="cubic"))


@pytest.mark.slow
def test_a_batch_larger_than_the_data_stops_before_writing(tmp_path, subprocess_env):
    target = tmp_path / "never"
    out = _run([sys.executable, "-m", "my_utils.workflows.ddp", *TINY, "--local-batch-size", "100000", "--output-dir",
                target], subprocess_env, expect_ok=False)
    assert out.returncode == 2 and "fewer than one global batch of 100000" in out.stderr
    assert not target.exists()
