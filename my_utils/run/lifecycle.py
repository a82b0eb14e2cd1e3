"""A run's life, on every rank: open (or reopen, to resume) its results folder from rank 0 and agree on it, and
turn its outcome into its status.

SIGTERM (a scheduler preempting the job; ``accelerate launch`` forwards it to every worker) interrupts the run,
or, while a Trainer can stop cleanly (``my_utils.run.faults.reliability_callbacks``), stops every rank at the end
of the current step with a checkpoint; either way the run ends ``interrupted`` with a non-zero exit. SIGUSR1 (SLURM's
warning before the time limit) stops it the same way, and a stop at a step ends it ``Preempted``.
"""


from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import sys
from contextlib import contextmanager
from pathlib import Path

from my_utils import NothingToDo, UserError
from my_utils.core.devices import device_inventory
from my_utils.core.models import set_threads
from my_utils.core.printing import print0
from my_utils.core.records import lora_settings
from my_utils.run.callbacks import gather_to_rank0
from my_utils.run.checkpoints import file_sha256, find_resume_checkpoint, saved_step, set_aside_incomplete
from my_utils.run.config import as_record
from my_utils.run import faults
from my_utils.run.faults import announce_process, inject_fault, name_lost_ranks, name_stopped_ranks, note_ended
from my_utils.run.launch import check_process_count, check_rendezvous_host, check_world_size
from my_utils.run.locks import current_status, hold_folder, owner_alive
from my_utils.run.redaction import hash_secrets, redact_secrets
from my_utils.run.results import Run, check_new_run_dir, now, read_json, stopped_before_a_step, unique_dir
from my_utils.run.signals import Preempted, Sigterm, on_sigterm, signals_held
from my_utils.run.trackers import open_trackers


def _agree(state, outcome: list) -> list:
    """Rank 0's ``outcome`` on every rank."""
    from accelerate.utils import broadcast_object_list

    if state.num_processes > 1:
        broadcast_object_list(outcome)
    return outcome


def open_run(path: str | Path | None, default: str | Path, config: dict, **fields) -> tuple[Run | None, Path]:
    """Create the results folder on rank 0 and agree on it across ranks.

    ``path`` None picks ``default`` (or ``default_2``... if taken); an explicit path that ``check_new_run_dir``
    refuses (it exists, is empty, or lies inside another results folder) is refused on every rank with the same
    sentence, and nothing is written. Returns (the Run on rank 0 or None elsewhere,
    the agreed folder).
    """
    from accelerate import PartialState

    state = PartialState()
    outcome = [None, None]  # [path, error]
    if state.is_main_process:
        try:
            target = check_new_run_dir(path) if path is not None else unique_dir(default)
            run = Run.create(target, config=config, **fields)
            outcome = [str(target), None]
        except UserError as e:
            outcome = [None, str(e)]
        except OSError as e:  # e.g. no space or no permission: every rank must hear of it, not only this one
            outcome = [None, f"Results folder {path or default} cannot be created ({e.strerror or e}); choose "
                       "another --output-dir."]
    with recorded(run if state.is_main_process and outcome[0] else None):  # a rank that stopped meanwhile: named
        _agree(state, outcome)
    if outcome[1]:
        raise UserError(outcome[1])
    return (run if state.is_main_process else None), Path(outcome[0])



def resume_after_restart(cfg):
    """``cfg`` with ``resume`` set when an elastic launcher restarted this worker (``torchrun --max-restarts``, after
    a worker died) and the results folder it names was begun: the restarted job continues from its newest whole
    checkpoint by itself, as ``--resume`` would, instead of refusing the folder as taken."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if restarts and cfg.output_dir and not cfg.resume and (Path(cfg.output_dir) / "run.json").is_file():
        return dataclasses.replace(cfg, resume=True)
    return cfg


def check_resumable(run_dir: str | Path | None, config: dict, may_differ=(), *, workflow: str | None = None,
                    checkpoints: str | None = None) -> dict:
    """Before resuming: a folder was named (``--output-dir``), and it is a results folder of ``workflow`` that did
    not complete, was started with the same settings (except the keys in ``may_differ``; a secret compared by its
    hash, as run.json records it) on the same data file (``data_fingerprint``), and has a whole checkpoint of its
    own under ``checkpoints``. Returns its run.json."""
    if not run_dir:
        raise UserError("--resume continues an existing results folder; name it with --output-dir.")
    run_dir = Path(run_dir)
    try:
        found = (run_dir / "run.json").is_file()
    except OSError:  # a name longer than the file system allows, say
        found = False
    if not found:
        raise UserError(f"There is no results folder at {run_dir} to resume; check --output-dir or drop --resume.")
    try:
        info = read_json(run_dir / "run.json")
    except (OSError, ValueError):
        raise UserError(f"{run_dir / 'run.json'} is unreadable, so the run cannot be resumed; start a new run "
                        "with another --output-dir.") from None
    if workflow and info.get("workflow") not in (None, workflow):
        raise UserError(f"The run in {run_dir} was made by the {info['workflow']} workflow, not {workflow}; resume it "
                        f"with python -m my_utils.workflows.{info['workflow']}.")
    if current_status(info, run_dir) == "complete":
        raise NothingToDo(f"The run in {run_dir} is already complete; there is nothing to resume.")
    if info.get("status") == "running" and owner_alive(info, run_dir):
        raise UserError(f"The run in {run_dir} is still running (process {info['pid']}); let it finish or stop it "
                        "before resuming.")
    recorded_config = _flat(info.get("config") or {})
    for key, value in _flat(hash_secrets(config)).items():  # as run.json recorded them: secrets by their hash
        if key in may_differ or key not in recorded_config:
            continue
        old = recorded_config[key]
        if _comparable(old) != _comparable(value) and key == "peft":  # not a flag: the adapter file's fields
            changed = sorted(k for k in {*old, *value} if _comparable(old.get(k)) != _comparable(value.get(k)))
            raise UserError(f"The run in {run_dir} was started with another adapter ("
                            + "; ".join(f"{k} {old.get(k)!r}, not {value.get(k)!r}" for k in changed)
                            + "); resume with the adapter file as it was, or start a new run with another --output-dir.")
        if _comparable(old) != _comparable(value):
            flag = "--" + key.replace("_", "-")
            raise UserError(f"The run in {run_dir} was started with {flag} {old!r}, not {value!r}; resume with "
                            "the same settings, or start a new run with another --output-dir.")
    data_file, recorded_data = config.get("data_file"), info.get("data_file_fingerprint")
    if recorded_data and data_file and Path(data_file).is_file() and data_fingerprint(data_file) != recorded_data:
        raise UserError(f"The data file {redact_secrets(data_file)} changed since the run started (size/hash); "
                        "restore it or start a new run with another --output-dir.")
    if checkpoints and stopped_before_a_step(run_dir):
        raise UserError(f"The run in {run_dir} stopped before its first step, so there is nothing to resume; the same "
                        "command without --resume starts it again in that folder.")
    if checkpoints:
        find_resume_checkpoint(run_dir / checkpoints)  # one sentence now if there is none of its own
    return info


def data_fingerprint(path: str | Path | None) -> dict | None:
    """The size and sha256 of the data file at ``path`` (read a MiB at a time), as run.json records it
    (``data_file_fingerprint``) for ``--resume`` to check; None without a file."""
    if not path:
        return None
    return {"size": Path(path).stat().st_size, "sha256": file_sha256(Path(path))}


def _flat(config: dict) -> dict:
    """A nested setting (a dict, e.g. the adapter) compared field by field, each named by its own flag as
    ``parse_config`` makes them (``--rank``, not ``--adapter``); an adapter recorded as peft's config is read in the
    flags' words too (``lora_settings``), so that a changed rank is named as the flag that changed it."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value.get("peft") is not None:
            value = {**lora_settings(value["peft"]), **value}
        flat.update(value if isinstance(value, dict) else {key: value})
    return flat


def _comparable(value):
    """Config values as run.json stores them (tuples come back as lists)."""
    return json.loads(json.dumps(value, default=str))


def reopen_run(run_dir: str | Path, checkpoints: str = "checkpoints", *, world_size: int,
               command: list[str] | None = None, layout: dict | None = None) -> tuple[Run | None, Path, Path]:
    """Continue the results folder ``run_dir`` from the newest whole checkpoint in its ``checkpoints`` folder.

    Rank 0 picks the checkpoint (``find_resume_checkpoint``: one sentence and nothing changed when there is
    none), sets aside the newer ones that were cut short, keeps the metrics rows up to the checkpoint's step
    (the resumed run logs the later steps again), and puts run.json back to ``running`` with the resume
    recorded under ``resumes``. A run resumes on the number of processes it trained on, unless the workflow's
    checkpoints are whole and it passes ``layout``: the settings that may change with the count (the workflow has
    checked that what they train stays), which run.json then records as resumed, the previous ones in the resume.
    Every rank must call it; returns (the Run on rank 0 or None elsewhere, the folder, the checkpoint).
    """
    from accelerate import PartialState

    state = PartialState()
    run_dir = Path(run_dir)
    outcome = [None, None]  # [checkpoint, error]
    if state.is_main_process:
        try:
            info = read_json(run_dir / "run.json")
            recorded_world = info.get("world_size")
            if recorded_world is not None and recorded_world != world_size and layout is None:
                raise UserError(f"The run in {run_dir} trained on {recorded_world} process(es), not {world_size}; "
                                "resume it with the same number of processes.")
            hold_folder(run_dir, "The run in")  # two resumes of one run: the second stops here, changing nothing
            checkpoint, skipped = find_resume_checkpoint(run_dir / checkpoints)
            for name, problem in skipped:
                print(f"passing over {name}: {problem}", file=sys.stderr, flush=True)
            moved = set_aside_incomplete(checkpoint.parent, [name for name, _ in skipped])
            step = saved_step(checkpoint)
            run = Run(run_dir)
            run.keep_metrics_until(step)
            resume = {"started": now(), "from_checkpoint": checkpoint.relative_to(run_dir).as_posix(),
                      "from_step": step, "previous_status": info.get("status"),
                      "previous_error": info.get("error"), "set_aside": moved,
                      "command": redact_secrets(command if command is not None
                                                else [os.path.basename(sys.argv[0]), *sys.argv[1:]])}
            relaid = {}
            if layout is not None and recorded_world != world_size:
                resume["layout_before"] = {"world_size": recorded_world,
                                           **{key: info["config"].get(key) for key in layout}}
                relaid = {"world_size": world_size, "config": {**info["config"], **layout}}
            run.update(status="running", finished=None, error=None, resumes=[*info.get("resumes", []), resume],
                       pid=os.getpid(), host=socket.gethostname(), writer_lock=True,  # the resumed run's writer
                       **relaid)
            outcome = [str(checkpoint), None]
        except UserError as e:
            outcome = [None, str(e)]
    with recorded(run if state.is_main_process and outcome[0] else None):  # a rank that stopped meanwhile: named
        _agree(state, outcome)
    if outcome[1]:
        raise UserError(outcome[1])
    return (run if state.is_main_process else None), run_dir, Path(outcome[0])


# ---------------------------------------------------------------------------------------------- signals


@contextmanager
def recorded(run: Run | None):
    """Mark ``run`` failed (exception) or interrupted (Ctrl-C, SIGTERM, SIGUSR1) if the body does not finish.

    SIGTERM, Ctrl-C and SIGUSR1 become KeyboardInterrupt (or, during training with ``reliability_callbacks``, a clean
    stop with a checkpoint, then KeyboardInterrupt; ``Preempted`` for SIGUSR1) so that a preempted or stopped job
    leaves status 'interrupted', the reason in its error, and no half-written summary, then exits non-zero.
    """
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    previous = {s: signal.getsignal(s) for s in signals}
    Sigterm.requested, Sigterm.name = False, "SIGTERM"
    try:
        for s in signals:
            signal.signal(s, on_sigterm)
    except ValueError:  # not the main thread (e.g. some notebook launch paths): keep the defaults
        previous = {}
    try:
        yield run
    except KeyboardInterrupt as e:
        failure = name_lost_ranks(e)  # the launcher stopped this rank because another had died: a failure, named
        if failure is None:
            note_ended(e)
            if run is not None:
                run.fail(f"{'preempted' if isinstance(e, Preempted) else 'interrupted'}: {e}", status="interrupted")
            raise
        _failed(run, failure)
        raise failure from None
    except Exception as e:
        with signals_held(then_stop=False):  # the launcher's SIGTERM, which another rank's end brings, waits
            failure = name_stopped_ranks(e)  # a collective that failed because a rank stopped: named, on every rank
            _failed(run, failure or e)
        if failure is None or failure is e:
            raise
        raise failure from e
    except BaseException as e:
        _failed(run, e)
        raise
    finally:
        Sigterm.deferrable = False
        for s, handler in previous.items():
            signal.signal(s, handler)




def _failed(run: Run | None, error: BaseException) -> None:
    """``error`` noted for the other ranks (before the launcher stops them, they can name it) and, on rank 0, the
    run marked failed with it."""
    note_ended(error)
    if run is not None:
        run.fail(redact_secrets(f"{type(error).__name__}: {error}"))  # an error may quote a URL or setting


# ---------------------------------------------------------------------------------------------- the lifecycle


def join_world(num_processes: int | None, timeout_s: float | None = None) -> int:
    """Inside every worker, first: the world size this process belongs to, checked against what the launch
    asked for (the CPU trap: unsynchronised copies), and the processes on this machine against its cores. From here
    on a launched worker takes SIGTERM as an interruption with its one line (and, when the launcher sent it because
    another rank died, names that rank: ``run_main``), not as a silent end."""
    if "LOCAL_RANK" in os.environ:  # a worker process of a launcher, never a notebook's kernel
        try:
            signal.signal(signal.SIGTERM, on_sigterm)
        except ValueError:  # not the main thread: keep the default
            pass
    local_processes = os.environ.get("LOCAL_WORLD_SIZE")  # set by torchrun and accelerate launch
    if local_processes:  # before the group forms: more processes than cores may not finish forming it before the
        # first of them refuses and exits, and the others would then fail inside gloo
        check_process_count(int(local_processes))
    check_rendezvous_host()
    world_size = check_world_size(num_processes, timeout_s=timeout_s)
    if not local_processes:
        check_process_count(world_size)
    if world_size > 1:
        announce_process()
        faults.group_timeout_s = timeout_s
        inject_fault(0, int(os.environ.get("RANK", "0")))  # COURSE_CRASH_AT_STEP=0: a fault during set-up
    return world_size


class Lifecycle:
    """One run as every workflow lives it; made by ``run_lifecycle``.

    ``folder`` is the results folder (every rank), ``run`` its writer (rank 0; None elsewhere), ``checkpoint``
    the checkpoint a resumed run continues from (None for a new run). The body logs with ``log``, collects
    per-rank records with ``gather`` and ends with ``finish(summary)``; ``summary`` is then the same on every rank.
    """

    def __init__(self, run: Run | None, folder: Path, world_size: int, checkpoint: Path | None):
        self.run, self.folder, self.world_size, self.checkpoint = run, folder, world_size, checkpoint
        self.summary: dict | None = None
        self.finished = False

    @property
    def is_main(self) -> bool:
        return self.run is not None

    def log(self, row: dict) -> None:
        """One metrics line (rank 0 writes it; the others need not know)."""
        if self.run is not None:
            self.run.log_metrics(row)

    def gather(self, obj) -> list | None:
        """One object per rank, on rank 0 (ordered by rank); None elsewhere. Every rank must call it."""
        return gather_to_rank0(obj)

    def finish(self, summary: dict | None) -> dict:
        """Rank 0 writes ``summary`` (what rank 0 passes; the others may pass None) and marks the run complete;
        every rank gets it back (only rank 0 when the body already closed the process group)."""
        if self.run is not None:
            self.run.finish(summary)
            print0(f"results folder: {self.folder}")
        self.summary = _agree_object(summary, self.world_size)
        self.finished = True
        return self.summary


def _agree_object(obj, world_size: int):
    """Rank 0's ``obj`` on every rank (each rank keeps its own when the body already closed the process group, as
    ``accelerator.end_training()`` does)."""
    import torch.distributed as dist

    if world_size > 1 and dist.is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


@contextmanager
def run_lifecycle(cfg, world_size: int, *, default_dir: str | Path, checkpoints: str | None = None,
                  report_to=None, layout: tuple[str, ...] | None = None, **fields):
    """Open the results folder of ``cfg`` (a workflow's settings, every default already resolved: run.json records
    them as they are) and live the run: ``cfg.output_dir`` or a new folder under ``default_dir``; with
    ``cfg.resume``, the same folder continued from the newest whole checkpoint in its ``checkpoints`` subfolder.

    Yields a ``Lifecycle``. A body that raises leaves the run failed (interrupted for Ctrl-C or SIGTERM); one that
    finishes must call ``finish``. The process group stays up: the command line tears it down once ``train`` has
    returned (``run_main``), after the models that use it are gone (tearing gloo down under a live DDP model that
    accelerate still holds can hang).
    ``fields`` (workflow, ...) go into run.json beside the world size, backend, devices and threads. Every metrics
    line also goes to the trackers ``report_to`` names (default: ``cfg.report_to``; a body that hands them to
    accelerate itself passes ``()``). ``layout``: the settings that may change when a run resumes on another number
    of processes (``reopen_run``; none: it resumes on the same number).
    """
    threads = set_threads()
    faults.last_step = None  # this run's steps (a notebook's kernel may have trained another before)
    report_to = getattr(cfg, "report_to", ()) if report_to is None else report_to
    checkpoint = None
    if getattr(cfg, "resume", False):
        run, folder, checkpoint = reopen_run(cfg.output_dir, checkpoints, world_size=world_size,
                                             layout=None if layout is None else {k: getattr(cfg, k) for k in layout})
        print0(f"resuming {folder} from {checkpoint.relative_to(folder)}")
    else:
        run, folder = open_run(cfg.output_dir, default_dir, as_record(cfg), world_size=world_size,
                               backend=process_group_backend(), devices=device_inventory(),
                               threads_per_process=threads,
                               data_file_fingerprint=data_fingerprint(getattr(cfg, "data_file", None)), **fields)
    life = Lifecycle(run, folder, world_size, checkpoint)
    with recorded(run):
        if run is not None and report_to:
            run.trackers = open_trackers(report_to, folder, folder.name)
        try:
            yield life
        except KeyboardInterrupt as e:
            if faults.last_step is not None or life.checkpoint is not None or isinstance(e, Preempted):
                raise
            # nothing to resume, nothing lost: say how to start again, in the same folder
            raise KeyboardInterrupt(f"{e} before the first step; run it again with --output-dir {folder}, which "
                                    "reuses that folder") from None
        finally:
            for tracker in run.trackers if run is not None else ():
                tracker.finish()
        if not life.finished:
            raise RuntimeError("the workflow ended without finishing its run")  # a bug, not a user's mistake


def process_group_backend() -> str | None:
    """gloo, nccl..., or None without a process group."""
    import torch.distributed as dist

    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None
