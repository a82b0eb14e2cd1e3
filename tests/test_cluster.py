"""``python -m my_utils cluster`` and the sbatch scripts of configs/slurm/, run unchanged on a local SLURM cluster of
two emulated nodes (one core each): the cluster starts and stops exactly its own daemons, a 2-node job trains one
process per node with the same losses as two processes on one machine, a job array runs one cell per task, a job
preempted with SIGUSR1 is requeued and resumes by itself with the uninterrupted losses, and bad input is one sentence
and exit 2."""

import fcntl
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from my_utils import NothingToDo, UserError
from my_utils.core.paths import REPO_ROOT
from my_utils.core.records import adapter_of
from my_utils.run.launch import accelerate_command
from my_utils.run.results import load_run
from my_utils.lessons import cluster as lc
from my_utils.tools import cluster

PORT = 17100  # not the default, so that a user's own cluster on this machine is left alone
STARTED = {}  # the controller's port of the cluster local_cluster started


SCRIPTS = lc.SCRIPTS
TRAIN = ["--preset", "tiny", "--max-steps", "3", "--logging-steps", "1", "--eval-rows", "8", "--skip-generation-eval",
         "--mixed-precision", "no", "--local-batch-size", "8"]


def own_daemons(folder) -> list[str]:
    """The live processes whose command line holds ``folder`` (munged, slurmctld and slurmd read their files from
    it; a zombie has no command line)."""
    out = subprocess.run(["pgrep", "-af", str(folder)], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


@pytest.fixture(scope="session")
def session_cluster(tmp_path_factory):
    """A 2-node cluster for the tests of this worker, started once (a fixture set up again right after its teardown
    would find the controller's port still held) and stopped afterwards whatever they did."""
    try:
        cluster.check_programs()
    except UserError as e:
        pytest.skip(f"SLURM cannot start here: {e}")
    folder = tmp_path_factory.mktemp("cluster")
    # each pytest-xdist worker its own range, so that two workers starting a cluster at once never pick the same
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    first = PORT + 200 * worker
    STARTED["port"] = cluster.free_ports(first, first + 200, step=20) or first
    try:
        cluster.up(folder, nodes=2, port=STARTED["port"])
        yield folder
    finally:
        cluster.stop(folder)
        assert own_daemons(folder) == []


@pytest.fixture
def local_cluster(session_cluster, tmp_path_factory):
    """The worker's cluster, used by one test at a time across the pytest-xdist workers: the scripts take their
    rendezvous port from the job id, and two clusters number their jobs alike, so two jobs at once would meet."""
    with open(tmp_path_factory.getbasetemp().parent / "slurm_cluster.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield session_cluster


def submit(folder, env, script, args, output, *sbatch_options):
    """sbatch ``script`` with ``args`` on the cluster in ``folder``, waited for; its id and output (exit 0 asserted)."""
    job, code, text = lc.submit(folder, script, args, output, *sbatch_options, env=lc.job_env(folder, env), check=False)
    assert code == 0, text[-4000:]
    return job, text


@pytest.mark.slow
@pytest.mark.xdist_group("slurm_cluster")
def test_up_is_idempotent_and_status_shows_the_idle_nodes(local_cluster):
    with pytest.raises(NothingToDo, match="already up"):
        cluster.up(local_cluster, nodes=2, port=STARTED["port"])
    shown = cluster.status(local_cluster)
    assert re.search(r"node n1 +idle", shown) and re.search(r"node n2 +idle", shown), shown
    assert len(own_daemons(local_cluster)) == 4  # munged, slurmctld, 2 slurmd


@pytest.mark.slow
@pytest.mark.xdist_group("slurm_cluster")
@pytest.mark.parametrize("script", ["multi_node_accelerate.sbatch", "multi_node_torchrun.sbatch",
                                    "srun_tasks.sbatch"])
def test_two_node_job_trains_like_two_processes_on_one_machine(local_cluster, tmp_path, subprocess_env, script):
    """One process per node (a launcher per node, or a SLURM task per rank), each on its own node in a world of 2; the
    per-step losses are those of a 2-process run on one machine at the same global batch (2 x 8)."""
    nodes_run = tmp_path / "two_nodes"
    job, out = submit(local_cluster, subprocess_env, SCRIPTS / script, [*TRAIN, "--output-dir", nodes_run],
                      tmp_path / "job.out", "-N", "2")
    # srun --label: each line starts with the task that printed it; task 0 runs on n1, task 1 on n2, and each node's
    # worker says its rank in a world of 2 (c10d may give rank 0 to either node; accelerate gives it to n1)
    ranks = {}
    for task, node in ((0, "n1"), (1, "n2")):
        assert re.search(rf"^{task}: node {node}: ", out, re.MULTILINE), out[-3000:]
        seen = re.findall(rf"^{task}: \[rank (\d)/2\] batch of 8 x", out, re.MULTILINE)
        assert len(seen) == 1, out[-3000:]
        ranks[node] = int(seen[0])
    assert sorted(ranks.values()) == [0, 1]
    if "torchrun" not in script:
        assert ranks == {"n1": 0, "n2": 1}
    run = load_run(nodes_run)["run"]
    assert run["status"] == "complete" and run["world_size"] == 2 and run["backend"] == "gloo"
    assert run["slurm"]["job_id"] == job and run["slurm"]["node_list"] == "n[1-2]"
    assert ranks[run["slurm"]["node"]] == 0  # run.json is written by rank 0, on its node
    assert run["slurm"]["script"].startswith(str(SCRIPTS / script))
    if script == "srun_tasks.sbatch":
        assert run["launch"]["launcher"] == "srun, one task per rank"

    one_machine = tmp_path / "one_machine"
    cmd = accelerate_command("my_utils.workflows.lora", [*TRAIN, "--output-dir", one_machine], num_processes=2,
                             config_file=REPO_ROOT / "configs" / "cpu_x2.yaml")
    subprocess.run(cmd, env=subprocess_env, cwd=REPO_ROOT, check=True, capture_output=True, timeout=600)
    assert len(lc.losses(nodes_run)) == 3
    assert lc.losses(nodes_run) == pytest.approx(lc.losses(one_machine), rel=1e-5)


@pytest.mark.slow
@pytest.mark.xdist_group("slurm_cluster")
def test_job_array_runs_one_cell_per_task_each_in_its_own_folder(local_cluster, tmp_path, subprocess_env):
    subprocess_env["COURSE_ARRAY_DIR"] = str(tmp_path / "sweep")
    job, out = submit(local_cluster, subprocess_env, SCRIPTS / "array.sbatch",
                      ["--preset", "tiny", "--max-steps", "2", "--eval-rows", "8", "--skip-generation-eval"],
                      tmp_path / "task_%a.out")
    cells = [load_run(tmp_path / "sweep" / f"cell_{task}")["run"] for task in (0, 1)]
    assert [c["status"] for c in cells] == ["complete", "complete"], out[-3000:]
    assert [adapter_of(c)["r"] for c in cells] == [4, 8]
    assert [c["slurm"]["array_task_id"] for c in cells] == ["0", "1"]
    assert {c["slurm"]["array_job_id"] for c in cells} == {job}


@pytest.mark.slow
@pytest.mark.xdist_group("slurm_cluster")
def test_down_cancels_the_jobs_and_stops_exactly_the_daemons_up_started(tmp_path, capsys):
    from my_utils.__main__ import main

    try:
        cluster.check_programs()
    except UserError as e:
        pytest.skip(f"SLURM cannot start here: {e}")
    try:
        main(["cluster", "up", "--dir", str(tmp_path), "--nodes", "1", "--port", str(PORT + 10)])
        assert len(own_daemons(tmp_path)) == 3  # munged, slurmctld, slurmd
        job = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path / 'job.out'}", "--wrap", "sleep 3141"],
                             env=cluster.slurm_env(tmp_path), capture_output=True, text=True, check=True)
        deadline = time.monotonic() + 30
        while not own_daemons("sleep 3141") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert own_daemons("sleep 3141"), f"job {job.stdout.strip()} did not start"
        main(["cluster", "down", "--dir", str(tmp_path)])
        assert capsys.readouterr().out.splitlines()[-1] == "stopped munged, slurmctld, slurmd_n1"
        assert own_daemons(tmp_path) == [] and own_daemons("sleep 3141") == []
    finally:
        cluster.stop(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["cluster", "down", "--dir", str(tmp_path)])
    assert exit_.value.code == 2


@pytest.mark.slow
@pytest.mark.xdist_group("slurm_cluster")
def test_a_preempted_job_requeues_and_resumes_by_itself_with_the_uninterrupted_losses(local_cluster, tmp_path,
                                                                                       subprocess_env):
    """preemptible.sbatch, sent SIGUSR1 as its time limit would (`scancel --signal=USR1 --batch`) after step 3: the
    workflow checkpoints at the step and exits 75, the script requeues the job, and the job, run again, resumes by
    itself (after the local cluster's 10 s credential lifetime); the per-step losses are those of an uninterrupted run,
    each step logged once."""
    args = ["--preset", "tiny", "--max-steps", "8", "--logging-steps", "1", "--local-batch-size", "4",
            "--eval-rows", "8", "--skip-generation-eval", "--mixed-precision", "no"]
    run_dir, output = tmp_path / "preemptible", tmp_path / "job.out"
    env = lc.job_env(local_cluster, subprocess_env, COURSE_STEP_DELAY_S="1")  # time to signal mid-training
    job_id, code, text = lc.preempt(local_cluster, args, run_dir, output, 3, env=env, check=False)  # both runs
    assert code == 0, text[-4000:]

    stopped = re.findall(r"lora: preempted \(SIGUSR1; stopped after step (\d+) with checkpoints/checkpoint-\1: the "
                         r"same command with --resume continues\)", text)
    assert len(stopped) == 1, text[-4000:]
    assert f"preempted: requeueing job {job_id}" in text and f"job {job_id}, restart 1: resuming" in text
    run = load_run(run_dir)
    assert run["run"]["status"] == "complete" and [r["from_step"] for r in run["run"]["resumes"]] == [int(stopped[0])]
    assert [m["step"] for m in run["metrics"] if "loss" in m] == list(range(1, 9))  # each step once

    uninterrupted = tmp_path / "uninterrupted"
    subprocess.run([sys.executable, "-m", "my_utils.workflows.lora", *map(str, args), "--output-dir", uninterrupted],
                   env=subprocess_env, cwd=REPO_ROOT, check=True, capture_output=True, timeout=600)
    assert lc.losses(run_dir) == lc.losses(uninterrupted)  # exact


# ------------------------------------------------------------------------------------------------ bad input


def test_more_nodes_than_cores_is_refused_in_one_sentence(tmp_path):
    from my_utils.core.devices import usable_cores

    with pytest.raises(UserError, match=r"more than this machine's \d+ cores"):
        cluster.up(tmp_path, nodes=usable_cores() + 1)
    assert not (tmp_path / "pids.json").exists()


def test_missing_programs_name_the_apt_packages(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster.shutil, "which", lambda *args, **kwargs: None)
    with pytest.raises(UserError, match=r"apt-get install -y slurm-wlm munge"):
        cluster.up(tmp_path, nodes=1)


def test_a_user_who_may_not_start_slurmd_is_told_to_use_root(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster.shutil, "which", lambda name, path=None: f"/usr/sbin/{name}")
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(UserError, match="needs root"):
        cluster.up(tmp_path, nodes=1)


def test_a_port_in_use_is_refused_and_nothing_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "check_programs", lambda: None)
    with socket.socket() as taken:
        taken.bind(("", 0))
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"Port {port} is in use"):
            cluster.up(tmp_path, nodes=1, port=port)
    assert not (tmp_path / "pids.json").exists() and own_daemons(tmp_path) == []


def test_down_with_nothing_running_is_one_sentence_and_exit_2(tmp_path, capsys):
    from my_utils.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["cluster", "down", "--dir", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("my_utils cluster: error: No cluster runs from") and err.count("\n") == 1


@pytest.mark.parametrize("script", ["multi_node_accelerate.sbatch", "multi_node_torchrun.sbatch",
                                    "srun_tasks.sbatch"])
def test_a_node_list_that_does_not_resolve_stops_the_job_in_one_sentence(tmp_path, script):
    """The batch shell alone, with an scontrol that names a node no one can resolve: exit 2 before any launch."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\n[ \"$2\" = hostnames ] && echo gone.invalid || "
                                   "echo '   NodeAddr=gone.invalid NodeHostName=gone'\n")
    (fake / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "COURSE_CPU": "1", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "gone.invalid"}
    proc = subprocess.run(["bash", str(SCRIPTS / script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2
    assert proc.stderr == "The first node gone.invalid of gone.invalid has no address this node can resolve.\n"


def test_status_of_a_folder_without_a_cluster_says_so(tmp_path):
    assert cluster.status(tmp_path) == f"No cluster in {tmp_path.resolve()}."


def test_scripts_open_with_how_to_submit_them_and_use_srun_where_nodes_are_several():
    for script in sorted(SCRIPTS.glob("*.sbatch")):
        text = script.read_text()
        assert text.startswith("#!/bin/bash\n# ") and "sbatch " in text.split("#SBATCH")[0], script.name
        assert "COURSE_CPU=1 sbatch" in text, script.name
        if "multi_node" in script.name or "srun_tasks" in script.name:
            # $SLURM_NODEID / $SLURM_PROCID expanded inside srun's tasks (single quotes), not in the batch shell
            launch = text[text.index("\nsrun ") + 1:]
            assert launch.startswith("srun --label bash -c '"), script.name
            assert re.search(r"\$SLURM_(NODEID|PROCID)", launch), script.name


# ------------------------------------------------------------------------------------------------ the lesson's parts


@pytest.mark.parametrize("trap", sorted(lc.TRAPS))
def test_each_trap_is_one_edit_of_the_shipped_script(tmp_path, trap):
    shipped = (SCRIPTS / "multi_node_accelerate.sbatch").read_text()
    edited = lc.trap_script(trap, tmp_path).read_text()
    old, new = lc.TRAPS[trap]
    assert shipped.count(old) == 1 and edited == shipped.replace(old, new) and edited != shipped


NO_SRUN = """node n1: machine rank 0 of 2, rendezvous 10.0.0.1:20003
torch.distributed.DistStoreError: Timed out after 21 seconds waiting for clients. 1/2 clients joined.
"""
RANK_0_TWICE = """1: node n2: machine rank 0 of 2, rendezvous 10.0.0.1:20004
0: node n1: machine rank 0 of 2, rendezvous 10.0.0.1:20004
1: torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address.
0: torch.distributed.DistStoreError: Timed out after 16 seconds waiting for clients. 1/2 clients joined.
"""
STOPPED = ("0: lora: error: rank 1 stopped (its process is alive but did not answer: hung or stopped): rank 0 waited for "
           "it in a collective after step 2 that failed\n")
REFUSED = ("1: lora: error: Rank 1 on n2: the rendezvous host localhost is a loopback address, but this launch spans 2 "
           "machines\n")


@pytest.mark.parametrize("text, sentence", [
    (NO_SRUN, "Only 1 of the job's 2 nodes launched: n1 (machine rank 0) waited 21 s at 10.0.0.1:20003 for the other "
              "1, which never started (the launch ran in the batch shell, on the first node alone, without srun)."),
    (RANK_0_TWICE, "Nodes n1 and n2 each took machine rank 0: n1 waited 16 s at 10.0.0.1:20004 for the 1 machine(s) "
                   "that never came, as the others could not host the same rendezvous (machine rank expanded once, in "
                   "the batch shell, not in each node's task)."),
    (STOPPED, "rank 1 stopped (its process is alive but did not answer: hung or stopped): rank 0 waited for it in a "
              "collective after step 2 that failed"),
    (REFUSED, "Rank 1 on n2: the rendezvous host localhost is a loopback address, but this launch spans 2 machines"),
    ("0: node n1: machine rank 0 of 2, rendezvous 10.0.0.1:1\n0: all done\n", None),
])
def test_a_failed_jobs_output_is_explained_in_one_sentence(text, sentence):
    assert lc.explain(text) == sentence


def test_the_error_file_a_jobs_output_names_is_read_back(tmp_path):
    (tmp_path / "error.json").write_text('{"message": {"message": "RankFailure: rank 1 stopped"}}')
    text = f"0:   error_file: <N/A>\n0:   error_file: {tmp_path / 'error.json'}\n"
    assert lc.error_file(text) == {"message": {"message": "RankFailure: rank 1 stopped"}}
    assert lc.error_file("0:   error_file: <N/A>\n") is None


@pytest.mark.slow
def test_a_lesson_that_cannot_run_here_is_skipped_with_its_reason(tmp_path):
    """A lesson that raises LessonSkipped (SLURM cannot start) is reported as skipped, with the reason, not failed."""
    import nbformat

    from my_utils.tools.demo import LessonSkippedHere, execute_notebook

    lesson = tmp_path / "99_needs_slurm.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from my_utils.lessons.cluster import LessonSkipped\nraise LessonSkipped('SLURM cannot start here: why')")]),
        lesson)
    with pytest.raises(LessonSkippedHere) as skipped:
        execute_notebook(lesson, tmp_path / "out.ipynb", tmp_path, timeout=120)
    assert skipped.value.reason == "SLURM cannot start here: why"


def test_stop_recorded_stops_and_removes_what_a_lesson_recorded(tmp_path):
    import json

    folder, lesson = tmp_path / "course-cluster-x", tmp_path / "runs" / "14_cluster"
    folder.mkdir()
    lesson.mkdir(parents=True)
    (lesson / cluster.RECORD).write_text(json.dumps({"folder": str(folder)}))
    assert cluster.stop_recorded(tmp_path / "runs") == []  # nothing ran there any more
    assert not folder.exists() and not (lesson / cluster.RECORD).exists()
