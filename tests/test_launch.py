import os
import re
import sys

import pytest

from my_utils import UserError
from my_utils.run import launch
from my_utils.core.devices import check_device_map, per_rank_device_map


def test_more_processes_than_cores_is_refused(monkeypatch):
    monkeypatch.setattr(launch, "max_processes", lambda: 2)
    with pytest.raises(UserError, match="3 processes asked for but this machine has 2"):
        launch.check_process_count(3)
    for bad in (0, -1, "2", 1.5):
        with pytest.raises(UserError, match="positive integer"):
            launch.check_process_count(bad)


def test_more_cpu_processes_than_cores_run_when_asked_for(monkeypatch):
    monkeypatch.setattr(launch, "max_processes", lambda: 2)
    monkeypatch.setattr(launch, "is_cpu_only", lambda: True)
    monkeypatch.setenv(launch.OVERSUBSCRIBE, "1")
    launch.check_process_count(4)  # allowed: each process waits its turn on the 2 cores
    monkeypatch.setattr(launch, "is_cpu_only", lambda: False)  # GPUs are not shared that way
    with pytest.raises(UserError, match="4 processes asked for but this machine has 2 GPUs"):
        launch.check_process_count(4)


def test_preflight_refuses_launch_unsafe_imports(monkeypatch):
    monkeypatch.setattr(launch, "max_processes", lambda: 2)
    monkeypatch.setitem(sys.modules, "bitsandbytes", object())
    with pytest.raises(UserError, match="bitsandbytes is already imported"):
        launch.preflight(2)
    launch.preflight(1)  # one process runs in-process: nothing to protect


def test_free_port_skips_a_taken_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert launch.free_port(taken) != taken


def test_accelerate_command_uses_config_and_module(tmp_path):
    cmd = launch.accelerate_command("my_utils.workflows.lora", ["--preset", "tiny"], num_processes=2, port=1234)
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"]
    assert cmd[cmd.index("--config_file") + 1].endswith("cpu_x2.yaml")
    assert cmd[cmd.index("--num_processes") + 1] == "2"
    assert cmd[-4:] == ["-m", "my_utils.workflows.lora", "--preset", "tiny"]


def test_device_maps():
    assert per_rank_device_map(1) == {"": "cpu"}  # no CUDA here
    check_device_map({"": "cpu"}, world_size=2)
    check_device_map("auto", world_size=1)
    with pytest.raises(UserError, match="per_rank_device_map"):
        check_device_map("auto", world_size=2)


def test_lr_scaling():
    from my_utils.core.learning_rate import scale_learning_rate

    assert scale_learning_rate(1e-3, 32, 16, "none") == 1e-3
    assert scale_learning_rate(1e-3, 32, 16, "linear") == pytest.approx(2e-3)
    assert scale_learning_rate(1e-3, 64, 16, "sqrt") == pytest.approx(2e-3)
    with pytest.raises(UserError, match="choose one of none, linear, sqrt"):
        scale_learning_rate(1e-3, 32, 16, "cubic")


def test_preflight_refuses_initialised_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(launch, "max_processes", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(UserError, match="CUDA was already initialised in this notebook"):
        launch.preflight(2)


@pytest.mark.parametrize("module", ["peft", "trl", "transformers.trainer"])
def test_preflight_refuses_peft_trl_and_the_trainer(monkeypatch, module):
    monkeypatch.setattr(launch, "max_processes", lambda: 2)
    for name in launch.LAUNCH_UNSAFE_MODULES:  # other tests in this process may have imported them
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, module, object())
    with pytest.raises(UserError, match=f"{module} is already imported"):
        launch.preflight(2)


@pytest.mark.parametrize("state_class", ["AcceleratorState", "PartialState"])
def test_preflight_refuses_an_existing_accelerator(monkeypatch, state_class):
    import accelerate.state

    monkeypatch.setattr(launch, "max_processes", lambda: 2)
    monkeypatch.setattr(launch, "LAUNCH_UNSAFE_MODULES", ())
    monkeypatch.setattr(getattr(accelerate.state, state_class), "_shared_state", {"num_processes": 1})
    with pytest.raises(UserError, match="An Accelerator already exists"):
        launch.preflight(2)


def test_preflight_refuses_more_processes_than_cores_before_other_checks(monkeypatch):
    monkeypatch.setattr(launch, "max_processes", lambda: 2)
    monkeypatch.setitem(sys.modules, "bitsandbytes", object())
    with pytest.raises(UserError, match="3 processes asked for"):
        launch.preflight(3)


def test_launch_replaces_a_taken_port(monkeypatch):
    import socket

    import accelerate

    seen = {}

    def fake_notebook_launcher(function, args=(), num_processes=None, use_port=None):
        seen.update(num_processes=num_processes, port=int(use_port), cpu=launch.os.environ.get("ACCELERATE_USE_CPU"))
        return function(*args)

    monkeypatch.setattr(launch, "preflight", lambda n: None)
    monkeypatch.setattr(accelerate, "notebook_launcher", fake_notebook_launcher)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert launch.launch(lambda x: x + 1, 41, num_processes=2, port=taken) == 42
        cmd = launch.accelerate_command("m", [], num_processes=2, port=taken)
        assert cmd[cmd.index("--main_process_port") + 1] != str(taken)
    assert seen["num_processes"] == 2 and seen["port"] != taken
    if launch.is_cpu_only():  # the CPU trap: without it the workers would not form one world
        assert seen["cpu"] == "1"


def test_a_successful_run_ends_its_process_group_and_a_failed_one_keeps_it():
    """Left to interpreter shutdown, a gloo group can abort the finished process; after an error the other
    ranks may still be in a collective, so the group must not be torn down then."""
    import torch.distributed as dist

    from my_utils.run.cli import run_main

    def body():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{launch.free_port()}", rank=0, world_size=1)
        return {"ok": 1}

    assert run_main(body) == {"ok": 1}
    assert not dist.is_initialized()

    def failing():
        body()
        raise UserError("bad input")

    with pytest.raises(SystemExit):
        run_main(failing)
    try:
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("body, code", [("pass", 0), ("raise SystemExit(2)", 2), ("raise SystemExit(None)", 0)])
def test_a_script_ending_without_teardown_keeps_its_output_and_its_exit_code(subprocess_env, body, code):
    import subprocess

    script = ("from my_utils.run.cli import run_as_script\n"
              f"def main():\n    print('written', end='')\n    {body}\n"
              "run_as_script(main)\nprint(' after')\n")  # never reached: the process ends inside run_as_script
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env)
    assert (proc.returncode, proc.stdout) == (code, "written")  # buffered output is flushed before the exit


@pytest.mark.slow
def test_run_command_passes_carriage_returns_through_and_names_the_failure(capsys):
    """A progress bar redraws in place (its carriage returns reach the notebook), and a failure quotes the last
    lines as they finally read, not every redraw."""
    script = "import sys\nfor i in range(3):\n    print(f'\\rstep {i}', end='', flush=True)\nprint()\nsys.exit(int(sys.argv[1]))"
    done = launch.run_command([sys.executable, "-c", script, "0"], echo=False)
    assert done.stdout == "\rstep 0\rstep 1\rstep 2\n" and capsys.readouterr().out == done.stdout
    with pytest.raises(RuntimeError, match=r"exit code 3: step 2$"):
        launch.run_command([sys.executable, "-c", script, "3"], echo=False)


@pytest.mark.parametrize("variable, engine", [("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")])
def test_a_gpu_only_engine_on_a_cpu_is_one_sentence(monkeypatch, variable, engine):
    monkeypatch.setenv(variable, "true")
    monkeypatch.setattr(launch, "is_cpu_only", lambda: True)
    with pytest.raises(UserError, match=f"asks for {engine}, which accelerate runs only on GPUs"):
        launch.check_gpu_only_launch()
    monkeypatch.setattr(launch, "is_cpu_only", lambda: False)
    launch.check_gpu_only_launch()  # on GPUs it is what accelerate runs


@pytest.mark.parametrize("use_cpu, world_size, refused", [
    (None, "2", "This machine has no GPU, and the launch did not set ACCELERATE_USE_CPU=1"),
    (None, "1", None), ("False", "1", "The launch config is for a GPU"), ("1", "2", None), ("True", "2", None)])
def test_an_accelerate_launch_for_gpus_on_a_cpu_is_refused(monkeypatch, use_cpu, world_size, refused):
    monkeypatch.setattr(launch, "is_cpu_only", lambda: True)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.delenv("ACCELERATE_DYNAMO_MODE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", world_size)
    launch.check_gpu_only_launch()  # not launched by accelerate (torchrun, a notebook): nothing to say
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "default")  # what accelerate launch always passes
    if use_cpu is not None:
        monkeypatch.setenv("ACCELERATE_USE_CPU", use_cpu)
    if refused:
        with pytest.raises(UserError, match=refused):
            launch.check_gpu_only_launch()
    else:
        launch.check_gpu_only_launch()


@pytest.mark.slow
@pytest.mark.parametrize("config, processes, expected", [
    ("fsdp.yaml", 2, "lora: error: The launch config asks for FSDP, which accelerate runs only on GPUs"),
    ("single_gpu.yaml", 1, "lora: error: The launch config is for a GPU \\(use_cpu: false\\) and this machine has none"),
    ("multi_gpu.yaml", 2, "lora: error: This machine has no GPU, and the launch did not set ACCELERATE_USE_CPU=1"),
])
def test_a_gpu_config_on_a_cpu_says_so_once(tmp_path, subprocess_env, config, processes, expected):
    """The GPU configs' commands as the README shows them (no ACCELERATE_USE_CPU), on a machine without GPUs: one
    sentence, the first thing said, and nothing written."""
    import re
    import subprocess

    if not launch.is_cpu_only():
        pytest.skip("on GPUs these configs run")
    out = tmp_path / "run"
    env = {k: v for k, v in subprocess_env.items() if k != "ACCELERATE_USE_CPU"}
    cmd = launch.accelerate_command("my_utils.workflows.lora", ["--preset", "tiny", "--max-steps", "1",
                                                               "--eval-rows", "8", "--output-dir", out],
                                    num_processes=processes, config_file=launch.REPO_ROOT / "configs" / config)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    said = [line for line in proc.stderr.splitlines() if line.startswith("lora: error:")]
    assert len(said) == 1 and re.search(expected, said[0]), proc.stderr[-3000:]
    assert proc.returncode != 0 and not out.exists(), proc.stderr[-3000:]


@pytest.mark.slow
def test_an_error_every_rank_finds_is_printed_once(subprocess_env, tmp_path):
    """Both ranks see a world of 2 where 3 were asked for; the job says so in one line, not one per rank, and
    no worker prints a traceback."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "my_utils.workflows.ddp",
           "--preset", "tiny", "--num-processes", "3", "--output-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, env=subprocess_env, capture_output=True, text=True, timeout=300)
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("ddp: error:")]
    assert proc.returncode != 0 and len(said) == 1, proc.stderr[-3000:]
    assert "sees a world of 2 process(es) but 3 were asked for" in said[0]
    assert "[rank0]" not in proc.stderr and "[rank1]" not in proc.stderr and not (tmp_path / "run").exists()



def test_more_processes_than_cores_are_refused_before_the_group_forms(monkeypatch):
    """A launcher's workers are counted before they form the process group: one that refused inside it could exit
    while the others still connect, and they would fail in gloo with tracebacks of their own."""
    from my_utils.run import lifecycle

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(launch, "max_processes", lambda: 2)
    monkeypatch.setattr(lifecycle, "check_world_size", lambda *a, **k: pytest.fail("the group must not form"))
    with pytest.raises(UserError, match="8 processes asked for but this machine has 2"):
        lifecycle.join_world(None)


@pytest.mark.slow
def test_before_the_group_forms_the_first_rank_to_find_an_error_alone_reports_it(monkeypatch, tmp_path):
    """Whichever rank finds it first (the launcher stops the others when one exits), once per launch."""
    import subprocess

    from my_utils.run.faults import first_to_say

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the markers' folder (tempfile reads it once: set it for children)
    code = ("import sys; from my_utils.run.faults import first_to_say; "
            "print(first_to_say(sys.argv[1]))")
    env = {**os.environ, "LOCAL_RANK": "1", "MASTER_PORT": "29511", "PYTHONPATH": str(launch.REPO_ROOT)}
    said = [subprocess.run([sys.executable, "-c", code, message], env={**env, "LOCAL_RANK": rank},
                           capture_output=True, text=True).stdout.strip()
            for rank, message in (("1", "bad option"), ("0", "bad option"), ("0", "another error"))]
    assert said == ["True", "False", "True"], "rank 1 found it first; rank 0 stays quiet; another error is news"
    env["MASTER_PORT"] = "29512"  # the next launch says it again
    again = subprocess.run([sys.executable, "-c", code, "bad option"], env=env, capture_output=True, text=True)
    assert again.stdout.strip() == "True"
    monkeypatch.delenv("LOCAL_RANK", raising=False)  # not launched: the only process
    assert first_to_say("bad option")


@pytest.mark.slow
def test_a_logged_command_shows_one_line_and_keeps_its_output(tmp_path, capsys):
    log = tmp_path / "lesson" / "run.log"
    done = launch.run_command([sys.executable, "-c", "print('step 1'); print('step 2')"], echo=False, log=log)
    final = capsys.readouterr().out.split("\r")[-1]  # what is left once the bar's frames are drawn over
    assert re.fullmatch(r"run: in \d+ s; its output: .*run\.log\n", final), final
    assert log.read_text().splitlines()[1:] == ["step 1", "step 2"] and "step 2" in done.stdout
    with pytest.raises(RuntimeError, match=r"exit code 3; the end of .*bad\.log:\n.*boom"):
        launch.run_command([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], echo=False,
                           log=tmp_path / "bad.log")


def test_a_logged_launch_keeps_prints_progress_and_library_notices_in_its_log(tmp_path, capsys):
    import logging

    library = logging.getLogger("some.library")
    library.addHandler(logging.StreamHandler(sys.stderr))  # as transformers does: the stream fixed when made

    def work(x):
        print("training", x)
        print("progress 100%|", file=sys.stderr)  # a progress bar's stream
        library.warning("a library notice")
        return 2 * x

    assert launch.launch(work, 21, num_processes=1, log=tmp_path / "work.log") == 42
    assert re.fullmatch(r"work: in \d+ s; 1 process' output: .*work\.log\n", capsys.readouterr().out.split("\r")[-1])
    kept = (tmp_path / "work.log").read_text()
    assert "training 21" in kept and "progress 100%|" in kept and "a library notice" in kept
    library.warning("after the launch")  # the handler writes to the terminal again
    assert "after the launch" in capsys.readouterr().err


@pytest.mark.parametrize("typed, option, said", [
    (["torchrun", "--nproc_per_node", "4", "-m", "m", "--x"], None,
     "use --nproc_per_node 2: `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m m --x`"),
    (["torchrun", "--nproc-per-node=4", "-m", "m"], None,
     "use --nproc_per_node 2: `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node=2 -m m`"),
    (["accelerate launch", "--config_file", "c.yaml", "-m", "m"], None,  # the config's count: the flag overrides it
     "use --num_processes 2: `ACCELERATE_USE_CPU=1 accelerate launch --num_processes 2 --config_file c.yaml -m m`"),
    (["python", "-m", "my_utils.workflows.lora", "--num-processes", "4", "--output-dir", "my runs"], None,
     "use --nproc_per_node 2: `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m my_utils.workflows.lora "
     "--output-dir 'my runs'`"),
    (["python", "-m", "my_utils", "demo", "--processes=9"], "--processes",
     "use --processes 2: `python -m my_utils demo --processes=2`"),
    (["python", "-m", "ipykernel_launcher", "-f", "kernel.json"], None, "use num_processes=2"),
])
def test_a_process_count_refused_is_answered_in_the_typed_commands_words_with_a_line_to_copy(typed, option, said,
                                                                                             monkeypatch):
    monkeypatch.setattr(launch, "typed_command", lambda: typed)
    monkeypatch.setattr(launch, "is_cpu_only", lambda: True)
    monkeypatch.setattr(launch, "max_processes", lambda: 2)
    with pytest.raises(UserError) as refused:
        launch.check_process_count(4, option)
    assert str(refused.value) == f"4 processes asked for but this machine has 2 CPU cores; {said}."


@pytest.mark.slow
def test_which_launcher_needs_accelerate_use_cpu_as_the_docs_say(tmp_path, subprocess_env):
    """docs/running.md: on a CPU, a plain accelerate script needs ACCELERATE_USE_CPU=1 under torchrun too (each
    worker alone otherwise); the course's workflows under torchrun do not (every worker sees the world of 2)."""
    import json
    import subprocess

    if not launch.is_cpu_only():
        pytest.skip("the variable matters only where there is no GPU")
    env = {k: v for k, v in subprocess_env.items() if k != "ACCELERATE_USE_CPU"}
    script = tmp_path / "plain.py"
    script.write_text("from accelerate import Accelerator\nprint('world', Accelerator().num_processes)\n")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    plain = subprocess.run([*torchrun, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and plain.stdout.count("world 1") == 2, plain.stdout + plain.stderr[-2000:]
    out = tmp_path / "tp"
    course = subprocess.run([*torchrun, "-m", "my_utils.workflows.tensor_parallel", "--preset", "tiny", "--max-steps",
                             "1", "--output-dir", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert course.returncode == 0, course.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["world_sizes_seen"] == [2, 2]
