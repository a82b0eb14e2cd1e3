"""``python -m my_utils cluster up|down|status``: a throwaway SLURM cluster of emulated nodes on this machine, to
run the sbatch scripts of ``configs/slurm/`` unchanged before they meet a real cluster.

    python -m my_utils cluster up                  # 2 nodes (n1, n2), one core each, in runs/cluster/
    export SLURM_CONF=$PWD/runs/cluster/slurm.conf # what sinfo, srun, sbatch, squeue read
    COURSE_CPU=1 sbatch -N 2 configs/slurm/multi_node_accelerate.sbatch --preset tiny --max-steps 3
    python -m my_utils cluster status
    python -m my_utils cluster down

One folder holds everything: slurm.conf, a munge key and munged's socket, the controller's state, each node's
spool, the daemons' logs and pids.json (the daemons ``up`` started: ``down`` stops exactly those). Every node is a
``slurmd -N nK`` of this machine on its own port, at this machine's network address (127.0.0.1 where it has only
loopback; a launch across machines refuses a loopback rendezvous otherwise); node names (n1, n2...) are not host
names, so a script finds a node's address with ``scontrol show node`` (NodeAddr), as the scripts in configs/slurm/
do.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from my_utils import NothingToDo, UserError
from my_utils.core.devices import usable_cores
from my_utils.core.paths import RUNS_ROOT
from my_utils.run.config import OneLineParser
from my_utils.run.launch import network_address

DEFAULT_DIR = RUNS_ROOT / "cluster"
DEFAULT_PORT = 17000  # slurmctld's; node K listens on DEFAULT_PORT + K
PROGRAMS = ("munged", "slurmctld", "slurmd", "sinfo", "scontrol", "squeue", "scancel", "sbatch", "srun")
PACKAGES = "slurm-wlm munge"
UP_TIMEOUT_S = 60
CREDENTIAL_LIFETIME_S = 10  # also how long a requeued job waits before it runs again (SLURM: 120 s)

HELP = f"""\
A SLURM cluster of emulated nodes on this machine: munged, slurmctld and one `slurmd -N nK` per node (one core
each), all in one folder (default: runs/cluster/, or --dir): slurm.conf, the munge key, state, logs and the pids of
the daemons `up` started. Then `export SLURM_CONF=<folder>/slurm.conf` and use sinfo, srun, sbatch, squeue and
`scontrol show job` as on any cluster (no sacct: there is no accounting daemon).

  up      start it and wait until sinfo shows every node idle; says so when it is already up
  down    cancel its jobs and stop the daemons `up` started (and nothing else)
  status  the daemons of the folder, and sinfo

Needs the packages `{PACKAGES}` (apt-get install -y {PACKAGES}) and root: slurmd starts every
job step as the user who submitted it, which only root may do, so a non-root user needs sudo (`sudo -E
.venv/bin/python -m my_utils cluster up`; jobs then run as the user who submits them).
"""


def node_names(nodes: int) -> list[str]:
    """The emulated nodes' names: n1, n2..."""
    return [f"n{k}" for k in range(1, nodes + 1)]


def config_path(folder: Path) -> Path:
    """The cluster's slurm.conf (what SLURM_CONF names)."""
    return folder / "slurm.conf"


def slurm_env(folder: str | Path) -> dict:
    """The environment under which sinfo, srun and sbatch talk to the cluster in ``folder``."""
    return {**os.environ, "SLURM_CONF": str(config_path(Path(folder).resolve()))}


def write_config(folder: Path, nodes: int, port: int) -> None:
    """slurm.conf of a cluster of ``nodes`` emulated nodes of this machine; munged's key."""
    host = socket.gethostname()
    user = "root"
    for sub in ("state", "spool", "log"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    key = folder / "munge" / "munge.key"
    key.parent.mkdir(mode=0o700, exist_ok=True)
    if not key.exists():
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
    address = network_address() or "127.0.0.1"
    node_lines = [f"NodeName={name} NodeHostname={host} NodeAddr={address} Port={port + k} CPUs=1 State=UNKNOWN"
                  for k, name in enumerate(node_names(nodes), start=1)]
    config_path(folder).write_text("\n".join([
        "# Written by `python -m my_utils cluster up`: emulated nodes of one machine.",
        "ClusterName=course",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={port}",
        # job ids from 10 x the port: the scripts take their rendezvous port from the job id, so two clusters of
        # this machine (on other ports) never give two running jobs the same one
        f"FirstJobId={10 * port}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # a requeued job waits for its credential's lifetime before it runs again (120 s by default)
        f"AuthInfo=socket={folder / 'munge' / 'munge.socket'},cred_expire={CREDENTIAL_LIFETIME_S}",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool' / '%n'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd_%n.pid'}",
        f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'log' / 'slurmd_%n.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill",
        "ReturnToService=2",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "KillWait=5",
        *node_lines,
        # a job that asks (sbatch --oversubscribe) may share a node's CPU with others that ask: lesson 14's launch
        # traps, which mostly wait, run at once
        f"PartitionName=local Nodes={','.join(node_names(nodes))} Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=YES",
        "",
    ]))


def start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (a recycled pid has another), or None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def recorded_daemons(folder: Path) -> dict:
    """pids.json: the daemons ``up`` started, by name ({"pid", "start"} each); {} when there is none."""
    try:
        return json.loads((folder / "pids.json").read_text())
    except (OSError, ValueError):
        return {}


def running(folder: Path) -> dict:
    """The daemons ``up`` started in ``folder`` that still run (the same pid, started at the same time)."""
    return {name: d for name, d in recorded_daemons(folder).items() if start_time(d["pid"]) == d["start"]}


def program(name: str) -> str | None:
    """The path of the SLURM or munge program ``name`` (daemons live in /usr/sbin, often not on a user's PATH)."""
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}{os.pathsep}/usr/sbin")


def check_programs() -> None:
    """SLURM's and munge's programs are installed and this user may start the daemons (UserError if not)."""
    missing = [p for p in PROGRAMS if not program(p)]
    if missing:
        raise UserError(f"{', '.join(missing)} not found: install the packages `{PACKAGES}` "
                        f"(apt-get install -y {PACKAGES}).")
    if os.geteuid() != 0:
        raise UserError("slurmd starts job steps as the submitting user, which needs root: run `cluster up` as "
                        "root or with sudo (see --help).")


def check_port_free(port: int) -> None:
    """``port`` is free on this machine (UserError if not). Bound as slurmctld binds it, without SO_REUSEADDR, so a
    port still held by a stopped cluster's connections (TIME_WAIT, about a minute) counts as in use."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            raise UserError(f"Port {port} is in use; pick other ports with --port (the controller's; node K "
                            f"takes the port + K).") from None


def free_ports(first: int, last: int, count: int = 3, step: int = 10) -> int | None:
    """The first of ``first``, ``first + step`` ... below ``last`` whose ``count`` ports from it are all free (a
    cluster's controller and its nodes); None when there is none."""
    for base in range(first, last, step):
        try:
            for p in range(base, base + count):
                check_port_free(p)
        except UserError:
            continue
        return base
    return None


def start(folder: Path, name: str, argv: list[str], daemons: dict) -> None:
    """Start one daemon in the foreground of its own session, its output to log/<name>.out; record its pid."""
    out = open(folder / "log" / f"{name}.out", "ab")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    out.close()
    time.sleep(0.2)
    daemons[name] = {"pid": proc.pid, "start": start_time(proc.pid), "argv": argv}
    (folder / "pids.json").write_text(json.dumps(daemons, indent=1))
    if daemons[name]["start"] is None:
        raise UserError(f"{name} stopped as it started; see {folder / 'log' / (name + '.out')}.")


def node_states(folder: Path) -> dict:
    """Each node's state as sinfo shows it ({} when the controller does not answer)."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=slurm_env(folder), capture_output=True,
                             text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return {}
    return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)


def up(folder: str | Path = DEFAULT_DIR, nodes: int = 2, port: int = DEFAULT_PORT) -> Path:
    """Start the cluster in ``folder`` and wait until every node is idle; the folder. Already up: NothingToDo."""
    folder = Path(folder).resolve()
    alive = running(folder)
    if alive:
        if len([n for n in alive if n.startswith("slurmd")]) == nodes and len(alive) == nodes + 2:
            raise NothingToDo(f"The cluster in {folder} is already up ({nodes} nodes); "
                              f"export SLURM_CONF={config_path(folder)}.")
        raise UserError(f"A cluster in {folder} runs already ({', '.join(alive)}); run `cluster down` first.")
    if nodes < 1:
        raise UserError(f"--nodes {nodes}: a cluster needs at least one node.")
    if nodes > usable_cores():
        raise UserError(f"--nodes {nodes} is more than this machine's {usable_cores()} cores (each emulated node "
                        f"has one); ask for at most {usable_cores()}.")
    check_programs()
    for p in range(port, port + nodes + 1):
        check_port_free(p)
    if len(str(folder / "munge" / "munge.socket")) > 100:
        raise UserError(f"The folder {folder} is too deep for munged's socket path; pass a shorter --dir.")
    folder.mkdir(parents=True, exist_ok=True)
    write_config(folder, nodes, port)
    conf = str(config_path(folder))
    daemons: dict = {}
    try:
        start(folder, "munged", [program("munged"), "-F", "-f", f"--socket={folder / 'munge' / 'munge.socket'}",
                                 f"--key-file={folder / 'munge' / 'munge.key'}",
                                 f"--pid-file={folder / 'munge' / 'munged.pid'}",
                                 f"--seed-file={folder / 'munge' / 'munged.seed'}",
                                 f"--log-file={folder / 'log' / 'munged.log'}"], daemons)
        start(folder, "slurmctld", [program("slurmctld"), "-D", "-c", "-i", "-f", conf], daemons)
        for name in node_names(nodes):
            start(folder, f"slurmd_{name}", [program("slurmd"), "-D", "-f", conf, "-N", name], daemons)
        deadline = time.monotonic() + UP_TIMEOUT_S
        while True:
            states = node_states(folder)
            if len(states) == nodes and all(s == "idle" for s in states.values()):
                return folder
            gone = [n for n, d in daemons.items() if start_time(d["pid"]) != d["start"]]
            if gone or time.monotonic() > deadline:
                raise UserError(f"The cluster did not come up ({', '.join(gone) + ' stopped' if gone else states}); "
                                f"see the logs in {folder / 'log'}.")
            time.sleep(0.5)
    except BaseException:
        stop(folder)
        raise


def cancel_jobs(folder: Path, timeout_s: float = 20) -> None:
    """Cancel every job of the cluster in ``folder`` and wait until none is left (at most ``timeout_s``)."""
    env = slurm_env(folder)
    subprocess.run(["scancel", "--partition=local"], env=env, capture_output=True, timeout=10)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=10)
        if left.returncode or not left.stdout.strip():
            return
        time.sleep(0.5)


def stop(folder: Path) -> list[str]:
    """Cancel the cluster's jobs (slurmd leaves a running job's steps behind when it stops), then stop the daemons
    ``up`` started in ``folder`` (SIGTERM, then SIGKILL after 10 s); their names."""
    alive = running(folder)
    if "slurmctld" in alive:
        cancel_jobs(folder)
    for d in alive.values():
        os.kill(d["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(start_time(d["pid"]) == d["start"] for d in alive.values()):
        time.sleep(0.2)
    for d in alive.values():
        if start_time(d["pid"]) == d["start"]:
            os.kill(d["pid"], signal.SIGKILL)
    for d in alive.values():  # reap those this process started (a test's fixture)
        try:
            os.waitpid(d["pid"], os.WNOHANG)
        except ChildProcessError:
            pass
    (folder / "pids.json").unlink(missing_ok=True)
    return list(alive)


RECORD = "cluster.json"  # {"folder": ...}: a cluster a lesson started, in the lesson's results folder


def stop_recorded(root: Path) -> list[str]:
    """Stop the clusters recorded under ``root`` (``RECORD``, by lessons; also one a failed lesson left running)
    and remove their folders and records; the daemons stopped."""
    stopped = []
    for record in Path(root).rglob(RECORD):
        folder = Path(json.loads(record.read_text())["folder"])
        stopped += stop(folder)
        shutil.rmtree(folder, ignore_errors=True)
        record.unlink()  # it named a temporary folder, now gone
    return stopped


def down(folder: str | Path = DEFAULT_DIR) -> list[str]:
    """Stop the cluster in ``folder``; the daemons stopped. Nothing running: UserError."""
    folder = Path(folder).resolve()
    stopped = stop(folder)
    if not stopped:
        raise UserError(f"No cluster runs from {folder}; nothing to stop.")
    return stopped


def status(folder: str | Path = DEFAULT_DIR) -> str:
    """What runs in ``folder``: each recorded daemon, alive or not, and sinfo."""
    folder = Path(folder).resolve()
    recorded, alive = recorded_daemons(folder), running(folder)
    if not recorded:
        return f"No cluster in {folder}."
    lines = [f"{name:<12} pid {d['pid']:<8} {'running' if name in alive else 'stopped'}"
             for name, d in recorded.items()]
    if "slurmctld" in alive:
        lines += [f"node {n:<7} {s}" for n, s in node_states(folder).items()]
        lines.append(f"export SLURM_CONF={config_path(folder)}")
    return "\n".join(lines)


def main(argv=None) -> None:
    import argparse

    parser = OneLineParser(prog="python -m my_utils cluster", description=HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--dir", default=str(DEFAULT_DIR), help="the cluster's folder (default: runs/cluster)")
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes, one core each (default: 2)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"slurmctld's port; node K listens on port + K (default: {DEFAULT_PORT})")
    args = parser.parse_args(argv)
    if args.action == "up":
        folder = up(args.dir, args.nodes, args.port)
        print(f"{args.nodes} nodes idle; export SLURM_CONF={config_path(folder)}")
    elif args.action == "down":
        print(f"stopped {', '.join(down(args.dir))}")
    else:
        print(status(args.dir))
