"""Test settings: offline before anything imports the hub client, and fixtures shared by the tests."""

import os
import re
import subprocess
import sys
from pathlib import Path

# Read at import time by huggingface_hub and datasets, so it must be set before any test imports them.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("MPLBACKEND", "Agg")
# Under pytest-xdist (``make test`` runs two workers) the workers' processes share the cores, and a process with
# several threads beside a busy one waits for its descheduled threads at every parallel region (one notebook took 6x
# its time so): each process computes with one thread unless told otherwise.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import pytest  # noqa: E402

# The programs a test may start only when it is marked slow: Python (a workflow, a tool, a notebook's kernel) and the
# launchers that start it. ``make test-fast`` runs the tests not marked slow and stays fast because of this.
COURSE_PROGRAMS = re.compile(r"(^|[\s/])(python[\d.]*|accelerate|torchrun|jupyter)(\s|$)")


def starts_course_process(args) -> bool:
    """Whether ``subprocess.Popen(args)`` starts Python or one of its launchers."""
    words = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    text = " ".join(os.fsdecode(w) if isinstance(w, bytes) else str(w) for w in words)
    return sys.executable in text or bool(COURSE_PROGRAMS.search(text))


class Finished:
    """What the sweep's ``_start`` returns, in a test, for a cell that its fake workflow has already finished."""

    def __init__(self, returncode):
        self.returncode = returncode

    def poll(self):
        return self.returncode


def lora_command(args, processes: int) -> list[str]:
    """The LoRA workflow's command line: ``python -m`` for one process, ``accelerate launch`` (configs/cpu_x2.yaml)
    for more."""
    from my_utils.run.launch import accelerate_command

    if processes == 1:
        return [sys.executable, "-m", "my_utils.workflows.lora", *map(str, args)]
    return accelerate_command("my_utils.workflows.lora", args, num_processes=processes,
                              config_file=REPO_ROOT / "configs" / "cpu_x2.yaml")


def logged_losses(run_dir) -> list[tuple[int, float]]:
    """``(step, loss)`` of every step a results folder logged a loss for."""
    from my_utils.run.results import load_run

    return [(m["step"], m["loss"]) for m in load_run(run_dir)["metrics"] if "loss" in m]


@pytest.fixture(autouse=True)
def _slow_if_it_starts_a_process(request, monkeypatch):
    """A test not marked slow fails if it starts a Python process (see ``COURSE_PROGRAMS``)."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    started = []
    popen_init = subprocess.Popen.__init__

    def watched(self, args, *more, **options):
        if starts_course_process(args):
            started.append(args)
        popen_init(self, args, *more, **options)

    monkeypatch.setattr(subprocess.Popen, "__init__", watched)
    yield
    if started:
        pytest.fail(f"this test started {len(started)} Python process(es) ({str(started[0])[:120]}): mark it "
                    "@pytest.mark.slow, or call the command's main(argv) in this process", pytrace=False)


@pytest.fixture
def subprocess_env(tmp_path):
    """Environment for a launched job: the repo importable, offline, one thread per process, and on a machine
    without GPUs the variable that puts a several-process accelerate launch on the CPU (as the README's commands do)."""
    from my_utils.run.launch import is_cpu_only

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    if is_cpu_only():
        env["ACCELERATE_USE_CPU"] = "1"
    env["HF_HOME"] = str(tmp_path / "hf_home")  # no stray user accelerate config
    return env


@pytest.fixture
def tracked_losses():
    """A function of a results folder: ({step: loss} as TensorBoard reads back the event file that holds losses
    (--report-to tensorboard), {step: loss} of its metrics.jsonl lines that have a loss)."""
    import json

    def read(run_dir):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        found = [EventAccumulator(str(f)).Reload() for f in sorted(Path(run_dir).rglob("events.out.tfevents.*"))]
        with_losses = [events for events in found if "loss" in events.Tags()["scalars"]]
        assert len(with_losses) == 1, f"one TensorBoard event file with losses expected under {run_dir}"
        events = with_losses[0]
        lines = map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines())
        return ({e.step: e.value for e in events.Scalars("loss")},
                {m["step"]: m["loss"] for m in lines if "loss" in m})

    return read


@pytest.fixture
def held_elsewhere(subprocess_env):
    """A context manager of a folder: while inside it, another live process holds that folder's writer lock (as a
    run or sweep writing there does); the lock goes when the process is killed, as it does with a killed writer."""
    from contextlib import contextmanager

    @contextmanager
    def hold(folder):
        code = ("import sys, time\nfrom my_utils.run.locks import hold_folder\n"
                "hold_folder(sys.argv[1]); print('held', flush=True); time.sleep(120)")
        holder = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True,
                                  env=subprocess_env)
        try:
            assert holder.stdout.readline().strip() == "held"
            yield holder
        finally:
            holder.kill()
            holder.wait()
            holder.stdout.close()

    return hold


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed on ``subprocess.run(..., check=True, capture_output=True)`` shows the command's stderr:
    the exception alone says only the exit status."""
    report = yield
    error = call.excinfo.value if call.excinfo is not None else None
    if isinstance(error, subprocess.CalledProcessError) and error.stderr:
        stderr = error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else error.stderr
        report.sections.append(("stderr of the failed command (its last 5,000 characters)", stderr[-5000:]))
    return report


def pytest_collection_modifyitems(items):
    """The notebooks first: the longest tests, started while the other worker still has short ones to fill in."""
    items.sort(key=lambda item: item.path.name != "test_notebooks.py")  # stable: each file keeps its order


# `COURSE_TEST_REPORT=<file.json> make test` records what the run took and counted, as the README's sentence on the
# suite's time says it (scripts/update_readme.py reads runs/reference/tests/); the controller alone writes it.
TEST_REPORT = "COURSE_TEST_REPORT"


def pytest_sessionstart(session):
    import time

    session.config.stash[_STARTED] = time.monotonic()


def pytest_sessionfinish(session, exitstatus):
    import json
    import time
    from collections import Counter

    path = os.environ.get(TEST_REPORT)
    if not path or hasattr(session.config, "workerinput"):
        return
    stats = session.config.pluginmanager.get_plugin("terminalreporter").stats
    reasons = Counter(report.longrepr[2].removeprefix("Skipped: ") for report in stats.get("skipped", [])
                      if isinstance(report.longrepr, tuple))
    record = {"seconds": round(time.monotonic() - session.config.stash[_STARTED], 1),
              "selection": session.config.option.markexpr or "all", "exit_status": int(exitstatus),
              **{outcome: len(stats.get(outcome, [])) for outcome in ("passed", "failed", "error", "skipped")},
              "skip_reasons": dict(reasons.most_common()), "workers": session.config.option.numprocesses or 0}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


_STARTED = pytest.StashKey[float]()
