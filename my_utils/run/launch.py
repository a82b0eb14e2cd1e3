"""Launching one training function on one or several processes: from a notebook (``notebook_launcher``)
or from a shell (``accelerate launch`` / ``torchrun``), with the checks that catch the usual traps first.

Traps caught here, each with one sentence before anything starts:
- on a CPU-only machine accelerate starts N unsynchronised single-process copies unless told to use the
  CPU: we set ``ACCELERATE_USE_CPU=1``, and every worker checks the world size it sees (``check_world_size``);
- CUDA initialised, or bitsandbytes / peft / the Trainer imported, in the notebook before the launch;
- more processes than devices (GPUs, or cores on a CPU);
- a port already taken (a free one is picked).

    from my_utils.run.launch import launch, accelerate_command
    launch(train, cfg, num_processes=2)            # in a notebook
    accelerate_command("my_utils.workflows.lora", ["--preset", "tiny"], config_file="configs/cpu_x2.yaml")
"""

from __future__ import annotations

import codecs
import functools
import ipaddress
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from my_utils import UserError
from my_utils.core.devices import cuda_available, usable_cores
from my_utils.core.paths import REPO_ROOT
from my_utils.core.progress import follow_log
from my_utils.run.results import output_to, shown_path, typed_command
from my_utils.run.signals import end_process_group

# Modules that initialise a device or import bitsandbytes when imported; they must stay inside the function.
LAUNCH_UNSAFE_MODULES = ("bitsandbytes", "peft", "trl", "transformers.trainer")


def is_cpu_only() -> bool:
    return not cuda_available()


def max_processes() -> int:
    """How many processes this machine can usefully run: its GPUs, or its CPU cores without GPUs."""
    if is_cpu_only():
        return usable_cores()
    import torch

    return torch.cuda.device_count()


# =1: let more CPU processes run than the machine has cores (each step then waits its turn: slower, never faster);
# for layouts that need more ranks than a laptop has cores, such as a run resumed on 4 processes in the tests
OVERSUBSCRIBE = "COURSE_OVERSUBSCRIBE"


def check_process_count(num_processes, option: str | None = None) -> None:
    """Refuse more processes than this machine can run, in the words of the command that was typed (``option``:
    the flag that asked for them, where the caller knows it; else found from the command, ``with_processes``);
    on a CPU, unless ``COURSE_OVERSUBSCRIBE=1`` allows it."""
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise UserError(f"The number of processes must be a positive integer, got {num_processes!r}.")
    available = max_processes()
    if num_processes > available and not (is_cpu_only() and os.environ.get(OVERSUBSCRIBE) == "1"):
        what = "CPU cores" if is_cpu_only() else "GPUs"
        raise UserError(f"{num_processes} processes asked for but this machine has {available} {what}; "
                        f"{with_processes(available, option)}.")  # a line to copy, then the full stop


# The flag that sets the number of processes, by the command typed (``typed_command``)
PROCESS_FLAGS = {"torchrun": ("--nproc_per_node", "--nproc-per-node"), "accelerate launch": ("--num_processes",)}


def with_processes(count: int, option: str | None = None) -> str:
    """What to type instead, to run ``count`` processes: "use --nproc_per_node 2: `<the command typed, with it>`".
    The flag is the typed command's own (torchrun's ``--nproc_per_node``, accelerate's ``--num_processes``, or
    ``option``: demo's ``--processes``); a plain ``python -m <workflow> --num-processes N`` becomes the torchrun
    line that launches it. In a notebook, ``notebook_launcher``'s argument."""
    typed = typed_command()
    if any("ipykernel" in part for part in typed):
        return f"use num_processes={count}"
    flags = (option,) if option else PROCESS_FLAGS.get(typed[0] if typed else "", ())
    if not flags:  # a workflow run by python alone: the launch that runs it on several processes
        args = drop_option(typed[3:] if typed[:2] == ["python", "-m"] else typed[1:], "--num-processes")
        module = typed[2] if typed[:2] == ["python", "-m"] else "<module>"
        flags, typed = PROCESS_FLAGS["torchrun"], ["torchrun", "--nproc_per_node", str(count), "-m", module, *args]
    line = set_option(typed, flags, str(count))
    prefix = "ACCELERATE_USE_CPU=1 " if is_cpu_only() and line[0] in PROCESS_FLAGS and count > 1 else ""
    return f"use {flags[0]} {count}: `{prefix}{line[0]} {shlex.join(line[1:])}`"  # "accelerate launch" unquoted


def drop_option(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (``--flag N`` or ``--flag=N``)."""
    kept, skip = [], False
    for part in argv:
        if skip:
            skip = False
        elif part == flag:
            skip = True
        elif not part.startswith(f"{flag}="):
            kept.append(part)
    return kept


def set_option(argv: list[str], flags: tuple[str, ...], value: str) -> list[str]:
    """``argv`` with the first of ``flags`` (any of its spellings) set to ``value``: replaced where it is, else
    added after the command's name (``accelerate launch``, ``torchrun``)."""
    for i, part in enumerate(argv):
        if part in flags and i + 1 < len(argv):
            return [*argv[:i + 1], value, *argv[i + 2:]]
        if any(part.startswith(f"{flag}=") for flag in flags):
            return [*argv[:i], f"{flags[0]}={value}", *argv[i + 1:]]
    return [argv[0], flags[0], value, *argv[1:]]


def preflight(num_processes: int) -> None:
    """Checks before ``notebook_launcher`` forks workers; each failure is one clear sentence."""
    check_process_count(num_processes)
    if num_processes == 1:
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise UserError(
            "CUDA was already initialised in this notebook, so forked workers cannot use it; restart the kernel "
            "and keep every .cuda()/.to('cuda') call inside the launched function."
        )
    imported = [m for m in LAUNCH_UNSAFE_MODULES if m in sys.modules]
    if imported:
        raise UserError(
            f"{imported[0]} is already imported in this notebook, which stops notebook_launcher from starting "
            "several processes; restart the kernel and import it inside the launched function."
        )
    accelerate_state = sys.modules.get("accelerate.state")
    # A PartialState (made by check_world_size, or by an Accelerator) would be inherited by the forked
    # workers with this process's world of one.
    if accelerate_state is not None and (
        accelerate_state.AcceleratorState._shared_state or accelerate_state.PartialState._shared_state
    ):
        raise UserError(
            "An Accelerator already exists in this notebook; restart the kernel and create it only inside the "
            "launched function."
        )


def free_port(preferred: int = 0) -> int:
    """``preferred`` if nothing listens on it, else (and by default) a free port chosen by the OS: two launches
    started side by side (a sweep's cells, the test suite's workers) would both find one fixed port free before
    either binds it."""
    for port in (preferred, 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
                return s.getsockname()[1]
            except OSError:
                continue
    raise OSError("no free port")


def _port(port: int | None) -> int:
    """``port`` if it is free, else a free one (also when none was given)."""
    return free_port(port) if port else free_port()


def _then_end_process_group(function):
    """``function`` for a notebook-launched worker: called with text progress bars, then the process group torn down
    once the function's models are gone, as the command line does (``run_main``); gloo can abort a worker that exits
    with it up."""

    @functools.wraps(function)  # notebook_launcher reads the function's name
    def worker(*args):
        import tqdm.auto
        import tqdm.std

        # The kernel's widget bars cannot be drawn from a fork (ipykernel drops each message, with a warning): the
        # worker's bars (the libraries' own, the Trainer's) are tqdm's text ones.
        tqdm.auto.tqdm = tqdm.std.tqdm
        result = function(*args)
        end_process_group()
        return result

    return worker


def launch(function, *args, num_processes: int = 1, port: int | None = None, log: str | Path | None = None):
    """Run ``function(*args)`` on ``num_processes`` processes from a notebook (or directly for one).

    On a CPU-only machine the workers use gloo (``ACCELERATE_USE_CPU=1``); each should call
    ``check_world_size(num_processes)`` first. With ``log``, what the workers print (the libraries' notices, their
    progress) goes to that file, and the notebook shows one progress bar, whose last state is one line.
    """
    preflight(num_processes)
    if log is None:
        return _run_launched(function, args, num_processes, port)
    processes = f"{num_processes} process{'es' if num_processes > 1 else ''}"
    with follow_log(log, getattr(function, "__name__", "launch"), note=f"; {processes}' output: {shown_path(log)}"):
        return _run_launched(_logged(function, log), args, num_processes, port)


def _run_launched(function, args, num_processes: int, port: int | None):
    return function(*args) if num_processes == 1 else _notebook_launch(function, args, num_processes, port)


def _shown_argument(argument: str) -> str:
    """A command's argument as the reader finds it: an absolute path relative to the run's results or the repo."""
    return shown_path(argument) if os.path.isabs(argument) else argument


# Set in a process whose output goes to a log: no progress display (a notebook's HTML bar, from a forked worker, only
# makes the kernel complain that a fork cannot send it).
OUTPUT_LOGGED = "COURSE_OUTPUT_LOGGED"


def _logged(function, log):
    """``function`` with its process's output appended to ``log`` (each worker appends its own lines)."""

    @functools.wraps(function)  # notebook_launcher reads the function's name
    def worker(*args):
        previous = os.environ.get(OUTPUT_LOGGED)
        os.environ[OUTPUT_LOGGED] = "1"
        try:
            with output_to(log):
                return function(*args)
        finally:
            if previous is None:
                os.environ.pop(OUTPUT_LOGGED, None)
            else:
                os.environ[OUTPUT_LOGGED] = previous

    return worker


def _notebook_launch(function, args, num_processes: int, port: int | None):
    from accelerate import notebook_launcher

    # The workers inherit these. Threads: the usable cores shared out (accelerate would otherwise pick a count
    # itself, from the physical cores, and warn that it did).
    settings = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(max(1, usable_cores() // num_processes))}
    if is_cpu_only():
        settings["ACCELERATE_USE_CPU"] = "1"
    previous = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        return notebook_launcher(_then_end_process_group(function), args=args, num_processes=num_processes,
                                 use_port=str(_port(port)))
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# What `accelerate launch` tells its workers when the config asks for a GPU-only engine.
GPU_ONLY_ENGINES = {"ACCELERATE_USE_FSDP": "FSDP", "ACCELERATE_USE_DEEPSPEED": "DeepSpeed"}


def check_gpu_only_launch() -> None:
    """One sentence when the launch asked for GPUs on a machine without any: FSDP or DeepSpeed (accelerate runs
    neither on a CPU, and the worker would otherwise train as plain DDP while its config says it shards), a
    one-process GPU config (configs/single_gpu.yaml), or a several-process launch without ACCELERATE_USE_CPU=1 (a GPU
    config such as configs/multi_gpu.yaml, or the CPU config without its variable: accelerate's launcher does not tell
    its workers which). Made from the environment alone, before any process group forms: it is the first thing that
    stops such a launch, and the first thing said."""
    if not is_cpu_only():
        return
    asked = [name for key, name in GPU_ONLY_ENGINES.items() if os.environ.get(key, "").lower() == "true"]
    if asked:
        raise UserError(f"The launch config asks for {asked[0]}, which accelerate runs only on GPUs, and this machine "
                        "has none; on a CPU, ZeRO runs with torch's own FSDP2: ACCELERATE_USE_CPU=1 torchrun "
                        "--nproc_per_node 2 -m my_utils.workflows.sharding.")
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower()
    if use_cpu == "false":  # accelerate's one-process launcher passes the config's use_cpu on
        raise UserError("The launch config is for a GPU (use_cpu: false) and this machine has none; on a CPU use "
                        "--config_file configs/cpu_x1.yaml (configs/cpu_x2.yaml for 2 processes).")
    launched = "ACCELERATE_DYNAMO_MODE" in os.environ  # accelerate launch always passes its dynamo settings
    if launched and int(os.environ.get("WORLD_SIZE", "1")) > 1 and use_cpu not in ("1", "true"):
        raise UserError("This machine has no GPU, and the launch did not set ACCELERATE_USE_CPU=1 (a GPU config, or "
                        "the CPU config without the variable its workers need); on a CPU launch it as "
                        "ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml, with the same module "
                        "and options.")


def is_loopback(ip: str) -> bool:
    """Whether ``ip`` is a loopback address (127.x, ::1), which names each machine itself."""
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


def network_address() -> str | None:
    """This machine's first IPv4 address that another machine could reach (not loopback); None when it has only
    loopback (a laptop offline), where every "machine" of a launch is necessarily this one."""
    import psutil  # accelerate's dependency

    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not is_loopback(a.address):
                return a.address
    return None


def check_rendezvous_host() -> None:
    """Inside a worker of a launch that spans machines (more processes in the world than on this machine): the
    rendezvous address (MASTER_ADDR) is not loopback. Each machine takes localhost for itself, so every machine
    would host a rendezvous of its own, or wait at one nobody hosts; refused before the group forms (UserError)."""
    world, here = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    host = os.environ.get("MASTER_ADDR")
    if not host or not here or world <= here:
        return
    try:
        ip = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError):
        return  # the launcher's own error names an address that does not resolve
    own = network_address()
    if is_loopback(ip) and own:
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        raise UserError(f"Rank {os.environ.get('RANK', '?')} on {node}: the rendezvous host {host} is a loopback "
                        f"address, but this launch spans {world // here} machines, each of which takes it for "
                        f"itself; give the first machine's network address instead (this one's is {own}).")


def join_restarted_group(timeout_s: float | None = None) -> None:
    """In a worker that an elastic launcher restarted (``torchrun --max-restarts``), form the process group under
    keys of this attempt alone; elsewhere do nothing. torchrun shares its rendezvous store with the workers and keeps
    the previous attempt's keys in it, so a restarted worker may read a dead peer's address and fail to connect
    ("Connection refused" in gloo's or NCCL's set-up, about half the time; pytorch#135712)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s) if timeout_s else dist.default_pg_timeout
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    backend = "gloo" if is_cpu_only() else "nccl"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, store=dist.PrefixStore(f"course/attempt_{attempt}", store), timeout=timeout,
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def check_world_size(expected: int | None = None, timeout_s: float | None = None) -> int:
    """Inside a worker: the world size this process really belongs to, checked against what was asked.

    ``expected`` defaults to WORLD_SIZE set by the launcher. A mismatch means the launcher started
    unsynchronised copies (the CPU trap) and training would silently not be data parallel. ``timeout_s``
    bounds every collective of the process group it creates (default: torch's, 30 minutes or more): a rank
    that dies or hangs then ends the job with an error instead of a wait.
    """
    from datetime import timedelta

    from accelerate import PartialState

    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    check_gpu_only_launch()  # before the process group: the first thing that would stop the launch
    if is_cpu_only():  # said, not guessed: DeepSpeed (which transformers' Trainer imports where it is installed)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # would log a warning while finding out
    join_restarted_group(timeout_s)  # accelerate then takes the group as it is
    state = PartialState(cpu=is_cpu_only(), **kwargs)
    expected = int(os.environ.get("WORLD_SIZE", "1")) if expected is None else expected
    if state.num_processes != expected:
        raise UserError(
            f"This worker sees a world of {state.num_processes} process(es) but {expected} were asked for; "
            f"{with_processes(expected)}."
        )
    return state.num_processes


def default_config_file(num_processes: int) -> Path:
    """The shipped accelerate config for this machine and process count."""
    if is_cpu_only():
        return REPO_ROOT / "configs" / ("cpu_x2.yaml" if num_processes > 1 else "cpu_x1.yaml")
    return REPO_ROOT / "configs" / ("multi_gpu.yaml" if num_processes > 1 else "single_gpu.yaml")


def accelerate_command(module: str, args: list[str], *, num_processes: int = 1, config_file=None,
                       port: int | None = None) -> list[str]:
    """The ``accelerate launch --config_file ... -m module args`` command line, as a list."""
    config_file = Path(config_file) if config_file else default_config_file(num_processes)
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(config_file),
        "--num_processes", str(num_processes),
        "--main_process_port", str(_port(port)),
        "-m", module, *map(str, args),
    ]


def accelerate_default_config() -> Path | None:
    """The user-level accelerate config file, if one exists (it changes what `accelerate launch` does)."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    path = Path(os.environ.get("ACCELERATE_CONFIG_FILE", home / "accelerate" / "default_config.yaml"))
    return path if path.is_file() else None


def stray_config_note() -> str | None:
    """A note when a user-level accelerate default config exists: the course's commands never read it."""
    stray = accelerate_default_config()
    if stray is None:
        return None
    return (f"note: ignoring the accelerate default config {stray}; course commands pass --config_file "
            "configs/... explicitly.")


def clean_env(**extra) -> dict:
    """The environment for a launched job: offline mode kept, a stray user accelerate config ignored (the
    command passes ``--config_file``; a note says so)."""
    note = stray_config_note()
    if note:
        print(note, file=sys.stderr, flush=True)
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(REPO_ROOT))
    if is_cpu_only():
        env["ACCELERATE_USE_CPU"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_logged(cmd: list[str], log: str | Path, env: dict, ok_codes=(0,)) -> None:
    """Run ``cmd`` in a fresh process with its output going to ``log``; raise with the log's end if it fails."""
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        code = subprocess.run(cmd, env=env, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if code not in ok_codes:
        # the last lines as they finally read (a redrawn line shows its last state)
        lines = log.read_text(encoding="utf-8", errors="replace").rstrip().split("\n")[-15:]
        tail = "\n".join(line.rsplit("\r", 1)[-1] for line in lines)
        raise RuntimeError(f"Command failed with exit code {code}; the end of {shown_path(log)}:\n{tail}")


def run_command(cmd: list[str], *, env: dict | None = None, echo: bool = True,
                log: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run a launch command in a fresh process, streaming its output; raise if it fails.

    The output is passed through as it comes, carriage returns included, so a progress bar redraws in place
    (in a terminal and in a notebook) instead of printing one line per update. With ``log`` it goes to that file
    instead, and a progress bar follows the one the process draws there (in a notebook: a widget, whose last state
    is one line)."""
    env = env or clean_env()
    if echo:  # as a shell would take it, with the variable that decides whether a CPU launch is distributed
        shown = ["ACCELERATE_USE_CPU=1"] if env.get("ACCELERATE_USE_CPU") == "1" else []
        print("$", " ".join([*shown, *(_shown_argument(c) if i else Path(c).name for i, c in enumerate(cmd))]),
              flush=True)
    if log is not None:
        with follow_log(log, Path(log).stem, note=f"; its output: {shown_path(log)}"):
            run_logged(cmd, log, env)
        return subprocess.CompletedProcess(cmd, 0, Path(log).read_text(encoding="utf-8", errors="replace"), "")
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    chunks = []
    while chunk := proc.stdout.read1(65536):
        chunks.append(decoder.decode(chunk))
        print(chunks[-1], end="", flush=True)
    proc.wait()
    output = "".join(chunks) + decoder.decode(b"", final=True)
    if proc.returncode != 0:
        # the last lines as they finally read (a redrawn line shows its last state)
        tail = "\n".join(line.rsplit("\r", 1)[-1] for line in output.rstrip().split("\n")[-5:]).strip()
        raise RuntimeError(f"Command failed with exit code {proc.returncode}: {tail}")
    return subprocess.CompletedProcess(cmd, proc.returncode, output, "")
