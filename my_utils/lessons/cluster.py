"""Lesson 14, on a cluster: the local SLURM cluster it submits to, the jobs it submits and waits for, the launch traps
made from the shipped scripts by one edit each, a preemption and its requeue, and a hung rank looked at."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from my_utils import JobFailed, UserError
from my_utils.core.paths import REPO_ROOT
from my_utils.run.results import load_run
from my_utils.tools import cluster

SCRIPTS = REPO_ROOT / "configs" / "slurm"
JOB_TIMEOUT_S = 600


class LessonSkipped(Exception):
    """A lesson that cannot run on this machine (SLURM cannot start): the demo and the tests mark it skipped with
    this reason instead of failing it."""


def start_cluster(lesson: Path) -> Path:
    """A local cluster of 2 emulated nodes for the lesson whose folder is ``lesson``; its folder. The cluster lives in
    a short temporary folder (munged's socket path has a length limit), named in ``lesson/cluster.json`` so that
    ``cluster.stop_recorded`` finds it, also after a failed lesson. LessonSkipped, with the reason, where SLURM cannot
    start here."""
    import json
    import tempfile

    try:
        cluster.check_programs()
    except UserError as e:
        raise LessonSkipped(f"SLURM cannot start here: {e}") from None
    folder = Path(tempfile.mkdtemp(prefix="course-cluster-"))
    Path(lesson).mkdir(parents=True, exist_ok=True)
    (Path(lesson) / cluster.RECORD).write_text(json.dumps({"folder": str(folder)}))
    port = cluster.free_ports(cluster.DEFAULT_PORT + 700, cluster.DEFAULT_PORT + 1000)  # clear of the default's
    if port is None:
        raise LessonSkipped("SLURM cannot start here: no free ports for its daemons between 17700 and 18000.")
    try:
        return cluster.up(folder, nodes=2, port=port)
    except UserError as e:
        raise LessonSkipped(f"SLURM cannot start here: {e}") from None


def job_env(folder: Path, base: dict | None = None, **more: str) -> dict:
    """The environment sbatch passes to a job on the cluster in ``folder``: ``base`` (default: this process's), the
    cluster's SLURM_CONF, the scripts' CPU switch (COURSE_CPU=1) where there is no GPU, this Python first on PATH, the
    repository importable, one thread per process, a join bounded by 2 minutes, and ``more``."""
    from my_utils.run.launch import is_cpu_only

    base = dict(os.environ if base is None else base)
    # the tiny jobs join in seconds: a node that cannot (a port another process holds, say) ends the job with the
    # scripts' sentence in 2 minutes, not in their default 10, after a notebook cell would have timed out
    env = {**base, "SLURM_CONF": cluster.slurm_env(folder)["SLURM_CONF"], "OMP_NUM_THREADS": "1",
           "COURSE_JOIN_TIMEOUT_S": "120", **more,
           "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{base['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), base.get("PYTHONPATH")]))}
    if is_cpu_only():
        env["COURSE_CPU"] = "1"
    return env


def output_text(output: Path) -> str:
    """A job's output file (an array's: every task's, ``%a`` in the name), as one text."""
    # errors="replace": two tasks writing one file may split a character of a progress bar
    return "\n".join(p.read_text(errors="replace") for p in sorted(output.parent.glob(output.name.replace("%a", "*"))))


def submit(folder: Path, script: Path, args: list, output: Path, *options: str, env: dict | None = None,
           while_running=None, check: bool = True) -> tuple[str, int, str]:
    """``sbatch script args`` on the cluster in ``folder``, waited for: (job id, exit code, output). ``options``
    go to sbatch (``-N 2``); ``while_running(job_id)`` is called once, when the job has started. With ``check``, a
    job that failed raises JobFailed with the end of its output."""
    env = env or job_env(folder)
    proc = subprocess.Popen(["sbatch", "--parsable", "--wait", f"--output={output}", *options, str(script),
                             *map(str, args)], env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    job = proc.stdout.readline().strip().split(";")[0]  # sbatch says the id as it submits, then waits
    if while_running and job:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if job_state(folder, job) == "RUNNING":
                while_running(job)
                break
            time.sleep(0.2)
    try:
        _, err = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", job], env=env, timeout=30)
        raise
    if not job:
        raise RuntimeError(f"sbatch refused {script.name}: {err.strip()}")
    # sbatch --wait may return while a job requeues itself: the job's own record says when it has really ended
    code, text = wait_for_job(folder, job), output_text(output)
    if check and code:
        raise JobFailed(f"job {job} ({script.name}) failed with exit code {code}; its output ends:\n{text[-3000:]}")
    return job, code, text


def submit_together(folder: Path, jobs: dict, env: dict | None = None) -> dict:
    """Several ``submit`` calls at once, each job with sbatch's ``--oversubscribe`` so that they share the nodes
    (for jobs that mostly wait): ``jobs`` maps a name to (script, args, output, options); returns, per name, (job
    id, exit code, output, seconds from its submission to its end). A failed job is returned, not raised."""
    from concurrent.futures import ThreadPoolExecutor

    def one(script, args, output, options):
        started = time.monotonic()
        job, code, text = submit(folder, script, args, output, "--oversubscribe", *options, env=env, check=False)
        return job, code, text, time.monotonic() - started

    with ThreadPoolExecutor(len(jobs)) as pool:
        running = {name: pool.submit(one, *job) for name, job in jobs.items()}
        return {name: future.result() for name, future in running.items()}


def show(folder: Path, *command: str) -> str:
    """A SLURM command's output on the cluster in ``folder`` (squeue, scontrol show job ...)."""
    return subprocess.run(list(command), env=cluster.slurm_env(folder), capture_output=True, text=True,
                          timeout=30).stdout


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def wait_for_job(folder: Path, job: str) -> int:
    """Wait until the job (every task of an array) has ended for good, a requeued job having run again; its exit
    code (an array's highest), as ``scontrol show job`` keeps it for a while after the end."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        shown = show(folder, "scontrol", "show", "job", job)
        states = re.findall(r"JobState=(\w+)", shown)
        if states and all(state in ENDED for state in states):
            return max(int(code) for code in re.findall(r"\bExitCode=(\d+):", shown))
        time.sleep(0.5)
    raise TimeoutError(f"job {job} did not end within {JOB_TIMEOUT_S} s")


def job_state(folder: Path, job: str) -> str | None:
    """The job's state (PENDING, RUNNING...) as scontrol shows it; None once it is gone."""
    found = re.search(r"JobState=(\w+)", show(folder, "scontrol", "show", "job", job))
    return found.group(1) if found else None


def losses(run_dir: Path) -> list[float]:
    """The per-step training losses a run logged, in order."""
    return [m["loss"] for m in load_run(run_dir)["metrics"] if "loss" in m]


def workers_seen(text: str) -> dict[str, tuple[int, int]]:
    """From a 2-node job's output (srun --label): each node's worker, as (rank, world size) it reported."""
    seen = {}
    for task, node in re.findall(r"^(\d+): node (\w+): ", text, re.MULTILINE):
        found = re.findall(rf"^{task}: \[rank (\d+)/(\d+)\] batch of", text, re.MULTILINE)
        if len(found) == 1:
            seen[node] = tuple(map(int, found[0]))
    return seen


# ------------------------------------------------------------------------------------------------- the traps

# Each trap is the shipped script with one edit: (what is replaced, by what).
TRAPS = {
    "no srun": ("srun --label bash -c '", "bash -c '"),
    "every node machine rank 0": ("srun --label bash -c 'MACHINE_RANK=$SLURM_NODEID\n",
                                  "MACHINE_RANK=$SLURM_NODEID  # expanded here, in the batch shell, on node 0\n"
                                  "export MACHINE_RANK\nsrun --label bash -c '"),
    "localhost rendezvous": ('--main_process_ip "$HEAD_IP"', "--main_process_ip localhost"),
}


def trap_script(trap: str, folder: Path, script: Path = SCRIPTS / "multi_node_accelerate.sbatch") -> Path:
    """The shipped ``script`` with the trap's one edit, written to ``folder``."""
    old, new = TRAPS[trap]
    text = script.read_text()
    if old not in text:
        raise ValueError(f"{script.name} no longer has {old!r}; update TRAPS")
    path = Path(folder) / f"trap_{trap.replace(' ', '_')}.sbatch"
    path.write_text(text.replace(old, new))
    return path


def explain(text: str) -> str | None:
    """One sentence for what went wrong in a multi-node job's output (srun --label's, or one node's): which node or
    rank waited, for what. None when it shows none of the failures the course knows."""
    for line in text.splitlines():  # the course's own sentences: a refused rendezvous host, a rank that stopped
        found = re.search(r"\w+: error: (Rank \d+ on \w+: the rendezvous host .*|ranks? [\d, ]+ stopped\b.*)", line)
        if found:
            return found.group(1)
    nodes = re.findall(r"^(?:(\d+): )?node (\w+): machine rank (\d+) of (\d+), rendezvous (\S+)", text, re.MULTILINE)
    waited = re.search(r"^(?:(\d+): )?.*Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients "
                       r"joined", text, re.MULTILINE)
    if not nodes or not waited:
        return None
    label, seconds, joined, expected = waited.groups()
    node, rank, _, where = next(((n, r, m, w) for t, n, r, m, w in nodes if t == label), nodes[0][1:])
    said_zero = sorted(n for _, n, r, _, _ in nodes if r == "0")
    if len(said_zero) > 1:
        return (f"Nodes {' and '.join(said_zero)} each took machine rank 0: {node} waited {seconds} s at {where} for "
                f"the {int(expected) - int(joined)} machine(s) that never came, as the others could not host the "
                f"same rendezvous (machine rank expanded once, in the batch shell, not in each node's task).")
    if len(nodes) < int(expected):
        return (f"Only {len(nodes)} of the job's {expected} nodes launched: {node} (machine rank {rank}) waited "
                f"{seconds} s at {where} for the other {int(expected) - len(nodes)}, which never started (the launch "
                f"ran in the batch shell, on the first node alone, without srun).")
    return (f"{node} (machine rank {rank}) waited {seconds} s at {where}: {joined} of {expected} machines joined the "
            f"rendezvous.")


# ------------------------------------------------------------------------------------------------- preemption


def preempt(folder: Path, args: list, run_dir: Path, output: Path, after_step: int, *options: str,
            env: dict | None = None, check: bool = True) -> tuple[str, int, str]:
    """configs/slurm/preemptible.sbatch with ``args`` (``--output-dir run_dir`` added), sent SIGUSR1 as its time
    limit would (``scancel --signal=USR1 --batch``) once ``after_step`` steps are logged; the job then checkpoints,
    requeues itself and, run again (after the credential lifetime, ``cluster.CREDENTIAL_LIFETIME_S``), resumes.
    (job id, exit code, the output of both runs)."""
    env = env or job_env(folder)

    def signal_at_step(job: str) -> None:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not ((run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= after_step):
            if time.monotonic() > deadline or job_state(folder, job) != "RUNNING":
                return  # it ended first: the caller's checks say so
            time.sleep(0.2)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)

    return submit(folder, SCRIPTS / "preemptible.sbatch", [*args, "--output-dir", run_dir], output, *options,
                  env=env, while_running=signal_at_step, check=check)


# ------------------------------------------------------------------------------------------------- a hung rank


def rank_processes(marker: str) -> dict[int, int]:
    """The workers on this machine whose command line holds ``marker`` (a results folder): {rank: pid}."""
    found = {}
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    for pid in map(int, out):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        env = dict(item.decode(errors="replace").split("=", 1) for item in environ if b"=" in item)
        if "RANK" in env and "WORLD_SIZE" in env and pid != os.getpid():
            found[int(env["RANK"])] = pid
    return found


def stack_dump(pid: int) -> str:
    """``py-spy dump`` of a process: every thread's Python stack, where it waits (without pausing it, so that a
    process stopped by a signal can be read too). '' where py-spy is not installed."""
    import shutil

    spy = shutil.which("py-spy", path=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}")
    if not spy:
        return ""
    out = subprocess.run([spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                         timeout=60).stdout
    return re.sub(r"\x1b\[[0-9;]*m", "", out)  # py-spy colours its output even into a pipe


def error_file(text: str) -> dict | None:
    """The first torchelastic error file a job's output names (``error_file: <path>``, written by a worker's
    ``@record``), read back; None when the output names none."""
    import json

    for path in re.findall(r"error_file: (/\S+)", text):
        try:
            return json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
    return None


def end_processes(pids) -> None:
    """SIGKILL each process (those a lesson stopped on purpose and no longer needs)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
