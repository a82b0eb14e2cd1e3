"""``make test-fast`` stays fast: a test not marked ``slow`` that starts Python or one of its launchers fails
(``tests/conftest.py`` watches ``subprocess.Popen`` during every such test)."""

import sys

from conftest import starts_course_process


def test_python_and_its_launchers_count_as_course_processes_and_other_programs_do_not():
    for args in ([sys.executable, "-m", "my_utils.workflows.lora"], ["python3", "-c", "pass"],
                 "ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m x",
                 ["torchrun", "--nproc_per_node", "2", "-m", "x"], ["/usr/bin/python3.11", "script.py"],
                 [b"python", b"-V"], ["jupyter", "lab"]):
        assert starts_course_process(args), args
    for args in (["ruff", "check", "."], ["git", "rev-parse", "HEAD"], "nvidia-smi -L", ["pythonic-tool"]):
        assert not starts_course_process(args), args
