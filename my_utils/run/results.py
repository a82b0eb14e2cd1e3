"""Results folders: one self-describing folder per run, written by rank 0, never overwritten.

    runs/run_3_cpu_x2/05_lora_ddp/
        run.json        what ran: command, config, git commit (+ dirty flag), library versions, devices,
                        world size and backend seen in the worker, timestamps, status
        metrics.jsonl   one JSON object per logged step
        summary.json    final figures: loss, quality, runtime, throughput, peak memory per rank, parameters
        *.png           plots

Every file is written atomically (temporary file, then rename), so a crash leaves the previous version or
nothing, never half a file. ``status`` is one of running / complete / failed / interrupted; comparisons read
only complete runs.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from my_utils import UserError
from my_utils.core.paths import REPO_ROOT, RUNS_ROOT
from my_utils.run.locks import current_status, hold_folder, release_folder
from my_utils.run.redaction import hash_secrets, redact_secrets
from my_utils.run.signals import signals_held
from my_utils.run.trackers import numbers

LIBRARIES = ("torch", "transformers", "peft", "accelerate", "trl", "bitsandbytes", "datasets", "tokenizers")


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and an atomic rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes owner-only files; results are for everyone to read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: str | Path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def git_state() -> dict:
    """The commit of the course repository and whether its tracked files have uncommitted changes."""

    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip() != ""
        return {"commit": head.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}


def library_versions() -> dict:
    """Versions of Python and the course's libraries, read from package metadata (nothing is imported)."""
    from importlib import metadata

    versions = {"python": sys.version.split()[0]}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def check_new_run_dir(path: str | Path) -> Path:
    """Preflight, before anything starts: ``path`` can become a new results folder. It is named (not empty), does
    not exist (a results folder is never overwritten) or holds a run that stopped before its first step
    (``stopped_before_a_step``: it is reused), is not inside another results folder (whose files it would mix with,
    or which may still be running), and can be created. Returns it as a Path."""
    if not str(path).strip():
        raise UserError("--output-dir is empty; name a new folder, or leave the option out for one under runs/.")
    path = Path(path)
    too_long = next((part for part in path.parts if len(part.encode()) > 255), None)
    if too_long is not None:
        raise UserError(f"Results folder name {too_long[:40]}... is {len(too_long.encode())} bytes long, over the 255 "
                        "a file system allows; choose a shorter --output-dir.")
    if path.exists() and not stopped_before_a_step(path):
        raise UserError(
            f"Results folder {path} already exists and is never overwritten; choose another --output-dir or delete it."
        )
    check_outside_runs(path)
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"Results folder {path} cannot be created because {parent} is a file; choose another "
                        "--output-dir.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"Results folder {path} cannot be created because {parent} is not writable; choose "
                        "another --output-dir.")
    return path


# What a run writes before its first step: a folder holding only these has nothing to lose.
BEFORE_A_STEP = frozenset({"run.json", "metrics.jsonl", "workers"})


def stopped_before_a_step(folder: str | Path) -> bool:
    """Whether ``folder`` is a results folder whose run ended (interrupted, failed, or its process gone) before it
    finished a step: no summary, no metrics line, nothing but what a run writes as it starts (``BEFORE_A_STEP``).
    Such a folder holds nothing to resume or compare, and a new run may take it (``Run.create``)."""
    folder = Path(folder)
    try:
        info = read_json(folder / "run.json")
        names = {p.name for p in folder.iterdir()}
        metrics = (folder / "metrics.jsonl").read_text(encoding="utf-8") if "metrics.jsonl" in names else ""
    except (OSError, ValueError):
        return False
    return (isinstance(info, dict) and current_status(info, folder) in ("interrupted", "failed", "crashed")
            and names <= BEFORE_A_STEP and not metrics.strip())


def check_outside_runs(path: str | Path) -> None:
    """Refuse to write ``path`` inside a results folder (its files would mix with the run's, which may still be
    running), except one made to hold others (``_holds_runs``)."""
    enclosing = next((p for p in Path(path).absolute().parents if is_run_dir(p) and not _holds_runs(p)), None)
    if enclosing is not None:
        raise UserError(f"{path} is inside the results folder {enclosing}; choose an --output-dir outside it.")


def _holds_runs(folder: Path) -> bool:
    """Whether the results folder ``folder`` is made to hold others (a benchmark's measurement runs): its run.json
    says ``"holds_runs": true``."""
    try:
        return read_json(folder / "run.json").get("holds_runs") is True
    except (OSError, ValueError, AttributeError):
        return False


def next_run_root(device: str, count: int, root: str | Path = RUNS_ROOT) -> Path:
    """The next free ``runs/run_<n>_<device>_x<count>`` folder name (not created)."""
    root = Path(root)
    taken = [int(m.group(1)) for p in root.glob("run_*") if (m := re.match(r"run_(\d+)_", p.name))]
    return root / f"run_{max(taken, default=0) + 1}_{device}_x{count}"


def unique_dir(path: str | Path) -> Path:
    """``path`` if free, else ``path_2``, ``path_3``...: for notebooks re-run by hand."""
    path = Path(path)
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}_{n}")
    return candidate


def invocation() -> list[str]:
    """How this process was started: the script's name and its arguments. In a notebook's kernel (and the workers
    ``notebook_launcher`` forks from it) only the kernel's name: its arguments name a temporary connection file."""
    name = os.path.basename(sys.argv[0])
    return [name] if name == "ipykernel_launcher.py" else [name, *sys.argv[1:]]


# The environment settings that decide how a launch runs: part of the command as the user typed it.
LAUNCH_ENV = ("ACCELERATE_USE_CPU", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "ACCELERATE_MIXED_PRECISION")


def as_typed(argv: list[str]) -> list[str]:
    """A command line as its user typed it: ``python -m torch.distributed.run`` or ``.../bin/torchrun`` is
    ``torchrun``, ``python -m accelerate.commands.launch`` is ``accelerate launch`` (one word), the interpreter's
    path is ``python``."""
    shown = []
    for i, part in enumerate(argv):
        name = os.path.basename(part)
        if i == 0 and name.startswith("python"):
            continue  # the interpreter's path: "python -m torch.distributed.run" is torchrun
        shown.append({"torch.distributed.run": "torchrun", "accelerate.commands.launch": "accelerate launch"}.get(
            part, name if i <= 1 else part))
    if shown[:1] == ["-m"]:
        shown = shown[1:]
    if shown[:1] == ["accelerate"] and shown[1:2] == ["launch"]:
        shown = ["accelerate launch", *shown[2:]]
    if argv[:1] and os.path.basename(argv[0]).startswith("python") and shown[:1] not in (["torchrun"],
                                                                                       ["accelerate launch"]):
        shown = ["python", *(["-m"] if argv[1:2] == ["-m"] else []), *shown]
    return shown


def typed_command() -> list[str]:
    """The command line that started this process, as typed (``as_typed``): its launcher's for a launched worker
    (torchrun, accelerate launch), else its own (``python -m my_utils.workflows.lora ...``)."""
    if "LOCAL_RANK" in os.environ:
        try:
            parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
            return as_typed([part.decode("utf-8", "replace") for part in parent if part])
        except OSError:
            return []
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    module = spec.name.removesuffix(".__main__") if spec else None  # python -m my_utils runs my_utils.__main__
    return as_typed([sys.executable, *(["-m", module] if module else sys.argv[:1]), *sys.argv[1:]])


def launch_record() -> dict | None:
    """How this process was started when a launcher started it (torchrun, ``accelerate launch``, a notebook's
    ``notebook_launcher``): the launcher's command line as typed, and the environment settings in ``LAUNCH_ENV``;
    None for a process started directly (``invocation`` then says it all)."""
    if "LOCAL_RANK" not in os.environ:
        return None
    try:
        # the launcher's environment as it started: what the user set, not what the launcher adds for its workers
        started = dict(line.split(b"=", 1) for line in Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\0")
                       if b"=" in line)
        given = {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in started.items()}
    except OSError:
        given = dict(os.environ)
    env = {k: given[k] for k in LAUNCH_ENV if k in given}
    shown = typed_command()
    if any("ipykernel" in part for part in shown):
        return {"launcher": "notebook_launcher, from a notebook", "env": env}
    if shown[:1] and shown[0].startswith("slurmstepd"):  # a SLURM task per rank, no launcher (run.json's slurm)
        return {"launcher": "srun, one task per rank", "env": env}
    typed = " ".join([*(f"{k}={v}" for k, v in env.items()), *shown])
    return {"launcher": redact_secrets(typed), "env": redact_secrets(env)}


def slurm_record() -> dict | None:
    """The SLURM job this process runs in: job id, array job and task ids, node list, this node, and the script
    that was submitted with its arguments (``Command`` of ``scontrol show job``); None outside a SLURM job."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    record = {key: os.environ.get(var) for key, var in (
        ("job_id", "SLURM_JOB_ID"), ("array_job_id", "SLURM_ARRAY_JOB_ID"), ("array_task_id", "SLURM_ARRAY_TASK_ID"),
        ("node_list", "SLURM_JOB_NODELIST"), ("node", "SLURMD_NODENAME"), ("nodes", "SLURM_NNODES"))}
    try:
        shown = subprocess.run(["scontrol", "show", "job", os.environ["SLURM_JOB_ID"]], capture_output=True,
                               text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        shown = ""
    script = re.search(r"^\s*Command=(.*)$", shown, re.MULTILINE)
    record["script"] = script.group(1).strip() if script else None
    return record


class Run:
    """A results folder being written. Create it on rank 0 only."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.trackers = []  # --report-to: each metrics line also goes to these (my_utils.run.trackers)

    @classmethod
    def create(cls, path: str | Path, *, config: dict, command: list[str] | None = None, **fields) -> "Run":
        """Create the folder (it must not exist) and write run.json with status 'running'."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if stopped_before_a_step(path):  # a run that never finished a step: nothing of it is lost
            print(f"reusing {path}: its run stopped before its first step", file=sys.stderr, flush=True)
            shutil.rmtree(path)
        try:
            path.mkdir()
        except FileExistsError:
            check_new_run_dir(path)
            raise
        info = {
            "status": "running",
            "run_id": uuid.uuid4().hex,  # the run's identity: its checkpoints carry it, and a resume checks it
            "command": redact_secrets(command if command is not None else invocation()),
            "launch": launch_record(),  # under a launcher: its command line as typed, and what set it up
            "slurm": slurm_record(),  # in a SLURM job: its ids, nodes and submitted script
            "config": hash_secrets(config),  # compared on --resume: a secret by its hash, never written
            **git_state(),
            "versions": library_versions(),
            "started": now(),
            "finished": None,
            # the process that created the folder and its parent: shows that runs meant to be separate
            # processes (a sweep, a memory measurement) really were
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "host": socket.gethostname(),
            "writer_lock": True,  # this process holds the folder's lock while it writes (hold_folder)
            **fields,
        }
        try:
            hold_folder(path)
            atomic_write_json(path / "run.json", info)
        except BaseException:  # e.g. a full disk: an empty folder would only block the retry
            release_folder(path)
            path.rmdir()
            raise
        return cls(path)

    @property
    def info(self) -> dict:
        return read_json(self.path / "run.json")

    def update(self, **fields) -> None:
        """Merge ``fields`` into run.json (atomically)."""
        atomic_write_json(self.path / "run.json", {**self.info, **fields})

    def log_metrics(self, record: dict) -> None:
        """Append one line to metrics.jsonl (one write per line, so a crash loses at most that line)."""
        with open(self.path / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")
        if self.trackers:
            for tracker in self.trackers:
                tracker.log(numbers(record), step=record.get("step"))

    def keep_metrics_until(self, step: int) -> None:
        """Drop the metrics rows logged after ``step`` (atomically): a run resumed from the checkpoint of that
        step logs the later steps again, so none is recorded twice."""
        path = self.path / "metrics.jsonl"
        if not path.is_file():
            return
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a crash
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                kept.append(line + "\n")
        atomic_write_text(path, "".join(kept))

    def finish(self, summary: dict) -> None:
        """Write summary.json, then mark the run complete, as one step: a stop asked for meanwhile (SIGTERM, Ctrl-C)
        takes effect after it. A complete run always has its summary."""
        with signals_held():
            atomic_write_json(self.path / "summary.json", summary)
            self.update(status="complete", finished=now())
            release_folder(self.path)

    def fail(self, error: str, status: str = "failed") -> None:
        """Mark the run failed (or ``status``), unless it already completed: a finished run stays finished (a
        SIGTERM that arrives as the process ends changes nothing)."""
        if current_status(self.info, self.path) == "complete":
            return
        self.update(status=status, finished=now(), error=error)
        release_folder(self.path)


def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / "run.json").is_file()


def find_run_dirs(*paths: str | Path) -> list[Path]:
    """Every results folder at or below ``paths`` (a folder with a run.json), sorted."""
    found = set()
    for p in map(Path, paths):
        if is_run_dir(p):
            found.add(p)
        if p.is_dir():
            found.update(q.parent for q in p.rglob("run.json"))
    return sorted(found)


def load_run(path: str | Path) -> dict:
    """run.json (with its current status: ``crashed`` for a running one whose writer is gone), summary.json (or
    None) and the metrics rows of one folder, plus its path."""
    path = Path(path)
    summary = path / "summary.json"
    metrics = path / "metrics.jsonl"
    rows = []
    if metrics.is_file():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash
                continue
    info = _read_object(path / "run.json")
    return {
        "path": str(path),
        "run": {**info, "status": current_status(info, path)},
        "summary": _read_object(summary) if summary.is_file() else None,
        "metrics": rows,
    }


def _read_object(path: Path) -> dict:
    """The JSON object in ``path``; ValueError naming the file and what is wrong with it otherwise."""
    try:
        obj = read_json(path)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.name} is not valid JSON (line {e.lineno}, column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path.name} holds no JSON object")
    return obj


def shown_path(path: str | Path) -> str:
    """``path`` as the reader of a lesson finds it: relative to the demo's results folder (``COURSE_RUN_ROOT``)
    when it lies there, else to the repository; other paths whole."""
    path = Path(path).absolute()
    for root in filter(None, (os.environ.get("COURSE_RUN_ROOT"), REPO_ROOT)):
        if path.is_relative_to(Path(root).absolute()):
            return str(path.relative_to(Path(root).absolute()))
    return str(path)


@contextlib.contextmanager
def output_to(log: str | Path):
    """Everything this process prints while the block runs, appended to ``log``: prints, progress bars, warnings, and
    the libraries' logging handlers that wrote to the terminal (they hold the stream they were made with)."""
    import logging

    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8", buffering=1) as f:
        terminal = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
        handlers = [h for logger in [logging.getLogger(), *logging.root.manager.loggerDict.values()]
                    for h in getattr(logger, "handlers", []) if isinstance(h, logging.StreamHandler)
                    and not isinstance(h, logging.FileHandler) and h.stream in terminal
                    and not isinstance(getattr(type(h), "stream", None), property)]  # those follow sys.stderr
        streams = [h.setStream(f) for h in handlers]
        try:
            with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                yield
        finally:
            for handler, stream in zip(handlers, streams):
                handler.setStream(stream)
