"""What a run survives, and how the tests provoke it:

- a rank that dies, hangs or is stopped (SIGSTOP): collectives time out after ``--timeout-s`` and the error names
  the rank that stopped (the live ranks say so in the process group's store; the silent one is named,
  ``name_stopped_ranks``), with what became of it (its own error, its process gone, or alive and silent); a
  stopped rank on this machine is then killed (``RankFailure.end_stopped_ranks``), so that the job ends at once
  and the launcher names the same rank;
- a launcher that stops the other ranks (SIGTERM) once one has died: the dead rank is named all the same
  (``name_lost_ranks``), not taken for a stop asked by hand;
- the Trainer-facing parts, ``reliability_callbacks`` (checkpoint manifests, a clean stop on SIGTERM) and
  ``course_trainer_class``; transformers is imported inside them, so importing this module stays light;
- fault injection for the tests (environment variables, unset in normal runs)::

      COURSE_CRASH_AT_STEP=k     crash at the end of optimizer step k (0: during set-up, once the process group
                                 has formed, before the results folder opens)
      COURSE_CRASH_RANK=r        ... on rank r only (default: every rank)
      COURSE_CRASH_MODE=m        raise (an exception, default) | exit (os._exit(1), no clean-up) |
                                 kill (SIGKILL to itself) |
                                 stop (SIGSTOP to itself: alive, but deaf even to SIGTERM, until killed)
      COURSE_STEP_DELAY_S=s      sleep s seconds after every step (time for a test to send a signal)
      COURSE_FAKE_OOM_ABOVE=n    raise torch.OutOfMemoryError in a training forward with more than n rows
"""


from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

from my_utils import UserError
from my_utils.run.checkpoints import CHECKPOINT_PREFIX, write_checkpoint_manifest
from my_utils.run.divergence import StopNonFinite
from my_utils.run.signals import Sigterm

CRASH_AT_STEP = "COURSE_CRASH_AT_STEP"
CRASH_RANK = "COURSE_CRASH_RANK"
CRASH_MODE = "COURSE_CRASH_MODE"
STEP_DELAY = "COURSE_STEP_DELAY_S"
FAKE_OOM_ABOVE = "COURSE_FAKE_OOM_ABOVE"
CRASH_MODES = ("raise", "exit", "kill", "stop")
FAILED_KEY = "course/collective_failed/{rank}"  # in the process group's store
PROCESS_KEY = "course/process/{rank}"  # "host pid" of each rank, written when it joins
ENDED_KEY = "course/ended/{rank}"  # how a rank's run ended when it did not finish: "interrupted" or its error
# The signals a stop agreed across ranks can name, weakest first: ranks that got different ones all end as the
# strongest asked (a SIGTERM means no requeue; SIGUSR1 alone means preempted, to be requeued).
STOP_SIGNALS = ("SIGUSR1", "Ctrl-C", "SIGTERM")


# ---------------------------------------------------------------------------------------------- ranks


class RankFailure(RuntimeError):
    """Another rank stopped (exited, hung or was stopped) and a collective on this rank failed or timed out.

    ``stopped`` holds the ranks named, ``processes`` the process ids of those among them on this machine.
    """

    def __init__(self, message: str, stopped: list[int] = (), processes: list[int] = ()):
        super().__init__(message)
        self.stopped, self.processes = list(stopped), list(processes)

    def end_stopped_ranks(self, wait_s: float = 5.0) -> None:
        """Kill the stopped ranks on this machine and wait (at most ``wait_s``) until they are gone.

        A stopped or hung process ignores the SIGTERM a launcher sends first, and torch's launcher waits 30 s
        before it kills. Killed here, before this rank exits, the stopped rank is in the launcher's report (as
        SIGKILL) and the job ends now. Which failure the report calls "Root Cause" is torch's choice: the earliest
        by timestamps kept to the second, so either rank. Call it after the run is recorded as failed.
        """
        for pid in self.processes:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        waiting = self.processes
        while waiting and time.monotonic() < deadline:
            time.sleep(0.05)
            waiting = [pid for pid in waiting if _exists(pid)]


def _exists(pid: int) -> bool:
    """Whether process ``pid`` exists (a killed one does until its parent, the launcher, collects it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        pass
    return True


def _store():
    """The process group's key-value store (hosted by the launcher under accelerate launch / torchrun)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def announce_process() -> None:
    """Inside a worker of a several-process group: write this process's host and id to the group's store, so
    that the other ranks can end it if it stops responding (``RankFailure.end_stopped_ranks``)."""
    import torch.distributed as dist

    store = _store()
    if store is not None:
        store.set(PROCESS_KEY.format(rank=dist.get_rank()), f"{socket.gethostname()} {os.getpid()}")


def first_to_say(message: str) -> bool:
    """Whether this process is the first of its process group to report ``message``: an error that every rank
    finds (too many processes for the machine, a bad option) is then printed once, not once per rank, by whichever
    rank finds it first (a launcher stops the others as soon as one exits: the one that spoke must be the first).
    Before the process group exists, the processes one launcher started on this machine agree through a marker
    file named for that launcher; after, through the group's store. True outside a launch, and when neither can
    be reached."""
    import hashlib

    import torch.distributed as dist

    digest = hashlib.sha1(message.encode()).hexdigest()
    if not (dist.is_available() and dist.is_initialized()):
        if "LOCAL_RANK" not in os.environ:  # not launched: nobody else to say it
            return True
        import tempfile

        launch = f"{os.getppid()}-{os.environ.get('MASTER_PORT', '')}-{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
        marker = Path(tempfile.gettempdir()) / f"course-said-{hashlib.sha1(launch.encode()).hexdigest()[:12]}-{digest}"
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False
        except OSError:
            return True
    store = _store()
    if store is None:
        return True
    try:
        return store.add(f"course/said/{digest}", 1) == 1
    except Exception:  # the store's host is gone: better twice than never
        return True


def _processes_here(store, ranks: list[int]) -> dict[int, int]:
    """The process ids of those of ``ranks`` that run on this machine (as they announced them), by rank."""
    pids = {}
    for rank in ranks:
        if store.check([PROCESS_KEY.format(rank=rank)]):
            host, pid = store.get(PROCESS_KEY.format(rank=rank)).decode().split()
            if host == socket.gethostname() and int(pid) != os.getpid():
                pids[rank] = int(pid)
    return pids


# The collectives' timeout of this process's group (``--timeout-s``), set by ``join_world`` when the group forms:
# the sentences that name a stopped rank quote it.
group_timeout_s: float | None = None


def note_ended(error: BaseException) -> None:
    """Inside a worker whose run ends without finishing: say how in the process group's store (interrupted, or the
    error's first line), so that a rank the launcher then stops can tell this rank's error from a death without a
    word (``name_lost_ranks``)."""
    import torch.distributed as dist

    store = _store()
    if store is None:
        return
    from my_utils.run.redaction import redact_secrets

    text = str(error).strip()
    first_line = text.splitlines()[0][:300] if text else ""
    ended = ("interrupted" if isinstance(error, KeyboardInterrupt)
             else redact_secrets(f"{type(error).__name__}: {first_line}".rstrip(": ")))
    try:
        store.set(ENDED_KEY.format(rank=dist.get_rank()), ended)
    except Exception:  # the store's host is gone: nobody is left to tell
        pass


def _fates(store, ranks: list[int]) -> dict[int, str]:
    """What became of each of ``ranks``, as far as this machine can tell: the error it noted (``note_ended``),
    "interrupted", its process gone without a word, or alive but silent (hung or stopped)."""
    fates, pids = {}, _processes_here(store, ranks)
    for rank in ranks:
        if store.check([ENDED_KEY.format(rank=rank)]):
            noted = store.get(ENDED_KEY.format(rank=rank)).decode()
            fates[rank] = noted if noted == "interrupted" else f"it failed with {noted}"
        elif rank in pids and not _exists(pids[rank]):
            fates[rank] = "its process ended without a word: killed by a signal, or exited at once"
        elif rank in pids:
            fates[rank] = "its process is alive but did not answer: hung or stopped"
    return fates


def _looks_like_a_failed_collective(error: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return bool(re.search(r"[Gg]loo|NCCL|[Tt]imed? ?out|[Cc]onnection (reset|closed|refused)|by peer", str(error)))


def _who(stopped: list[int], fates: dict[int, str]) -> str:
    """"rank 1 stopped (its process ended ...)", "ranks 1, 3 stopped (rank 1: ...; rank 3: ...)"."""
    if not stopped:
        return "a rank stopped (which one could not be told)"
    who = f"rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} stopped"
    known = [(r, fates[r]) for r in stopped if r in fates]
    if len(stopped) == 1 and known:
        return f"{who} ({known[0][1]})"
    return f"{who} ({'; '.join(f'rank {r}: {fate}' for r, fate in known)})" if known else who


# The newest step this process finished (``step_done``; None before its first): a failure names it.
last_step: int | None = None


def step_done(step: int, rank: int) -> None:
    """Every workflow calls it at the end of each optimizer step: the step a failure then names, and the tests'
    COURSE_CRASH_* faults (nothing in a normal run)."""
    global last_step
    last_step = step
    inject_fault(step, rank)


def _where() -> str:
    return "" if last_step is None else f" after step {last_step}"


def name_stopped_ranks(error: BaseException, grace_s: float = 3.0) -> RankFailure | None:
    """When ``error`` is a failed or timed-out collective: a RankFailure naming the rank(s) that stopped, what
    became of each (``_fates``), and the last step this rank finished.

    Every rank that is still alive reaches this point through the same failed collective and says so in the
    process group's store; the ranks that have not said so within ``grace_s`` seconds are the ones that died,
    hung, or failed with an error of their own. Returns None for any other error, and ``error`` itself when it is
    already such a RankFailure (named where it was raised)."""
    import torch.distributed as dist

    if isinstance(error, RankFailure):
        return error
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world_size < 2 or not _looks_like_a_failed_collective(error):
        return None
    store = _store()
    here = dist.get_rank()
    stopped, fates, processes = [], {}, []
    if store is not None:
        try:
            store.set(FAILED_KEY.format(rank=here), "1")
            deadline = time.monotonic() + grace_s
            while True:
                stopped = [r for r in range(world_size) if not store.check([FAILED_KEY.format(rank=r)])]
                if not stopped or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            fates, processes = _fates(store, stopped), list(_processes_here(store, stopped).values())
        except Exception:  # the store went with the process that hosted it: nothing more to learn
            stopped = []
    text = str(error).strip()
    first_line = text.splitlines()[0][:300] if text else type(error).__name__
    timeout = f" (--timeout-s {group_timeout_s:g})" if group_timeout_s else ""
    return RankFailure(f"{_who(stopped, fates)}: rank {here} waited for it in a collective{_where()} that failed "
                       f"or timed out{timeout}: {first_line}", stopped, processes)


def name_lost_ranks(interrupt: KeyboardInterrupt) -> RankFailure | None:
    """When the launcher stopped this rank (``interrupt`` is a SIGTERM) because another rank had ended first (it
    failed, or its process is gone without a word: SIGKILL, the out-of-memory killer, ``os._exit``): a RankFailure
    naming that rank, and what became of it. None when no other rank ended so (a stop asked by hand or by a
    scheduler reaches every rank: it stays an interruption)."""
    import torch.distributed as dist

    if str(interrupt) != "SIGTERM" or not (dist.is_available() and dist.is_initialized()):
        return None
    store, here = _store(), dist.get_rank()
    if store is None or dist.get_world_size() < 2:
        return None
    try:
        fates = _fates(store, [r for r in range(dist.get_world_size()) if r != here])
    except Exception:  # the launcher's store is gone already
        return None
    lost = sorted(r for r, fate in fates.items() if fate != "interrupted" and not fate.startswith("its process is"))
    if not lost:
        return None
    return RankFailure(f"{_who(lost, fates)}{_where()}, and the launcher then stopped rank {here} (SIGTERM); its "
                       "report below gives the exit code or signal", lost)


# ---------------------------------------------------------------------------------------------- Trainer parts


def course_trainer_class():
    """``transformers.Trainer`` with two fixes and a guard:

    - evaluation sees every row: ``dataloader_drop_last`` keeps training batches whole (the same shapes on
      every rank), but applied to evaluation it drops the only batch of a small eval set (eval_loss None);
    - the order of length-grouped batches (``train_sampling_strategy="group_by_length"``) depends only on the
      seed and the epoch: the Trainer draws it from the global RNG when an epoch starts, a state that a run
      resumed in the middle of a later epoch cannot recreate, so its batches, and losses, would differ;
    - under several processes, training stops before its first step if the model reached it unwrapped (each rank
      would train alone and exit 0): ``check_wrapped``.
    """
    import torch
    from transformers import Trainer
    from transformers.trainer_pt_utils import LengthGroupedSampler

    class CourseTrainer(Trainer):
        epoch_order = None  # the generator of the length-grouped order, reseeded for every epoch

        def _get_train_sampler(self, train_dataset=None):
            sampler = super()._get_train_sampler(train_dataset)
            if isinstance(sampler, LengthGroupedSampler) and sampler.generator is None:
                sampler.generator = self.epoch_order = torch.Generator()
            return sampler

        def _run_epoch(self, **kwargs):
            if self.epoch_order is not None:
                seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
                self.epoch_order.manual_seed(seed + kwargs["epoch"])
            return super()._run_epoch(**kwargs)

        def training_step(self, model, *args, **kwargs):
            check_wrapped(model, self.args.world_size)
            return super().training_step(model, *args, **kwargs)

        def get_eval_dataloader(self, eval_dataset=None):
            drop_last, self.args.dataloader_drop_last = self.args.dataloader_drop_last, False
            try:
                return super().get_eval_dataloader(eval_dataset)
            finally:
                self.args.dataloader_drop_last = drop_last

    return CourseTrainer


# What wraps a model that several processes train as one: DDP, FSDP (1), DeepSpeed; FSDP2 changes the class itself.
DISTRIBUTED_WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel", "DeepSpeedEngine")


def check_wrapped(model, world_size: int) -> None:
    """Refuse to train ``model`` on ``world_size`` > 1 processes when nothing synchronises its gradients: no
    data-parallel wrapper (``Trainer.evaluate()`` before ``train()`` leaves a model unwrapped under accelerate 1.x)."""
    from torch.distributed.fsdp import FSDPModule

    if world_size > 1 and type(model).__name__ not in DISTRIBUTED_WRAPPERS and not isinstance(model, FSDPModule):
        raise UserError(f"The model reached training on {world_size} processes without a data-parallel wrapper "
                        "(each process would train alone); call Trainer.evaluate() only after train(), or measure "
                        "before training with my_utils.core.evaluation.held_out_loss.")


def fault_settings() -> dict:
    """The fault injection the COURSE_* variables ask for (step, process, mode, delay, oom_above; None or 0 where
    unset). A crash is injected in the first attempt only: workers that an elastic launcher restarts
    (``--max-restarts``) run on."""
    mode = os.environ.get(CRASH_MODE, "raise")
    if mode not in CRASH_MODES:
        raise UserError(f"{CRASH_MODE}={mode!r} is not a fault mode; use one of {', '.join(CRASH_MODES)}.")
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) == 0
    return {
        "step": int(os.environ[CRASH_AT_STEP]) if os.environ.get(CRASH_AT_STEP) and first_attempt else None,
        "process": int(os.environ[CRASH_RANK]) if os.environ.get(CRASH_RANK) else None,
        "mode": mode,
        "delay": float(os.environ.get(STEP_DELAY) or 0),
        "oom_above": int(os.environ.get(FAKE_OOM_ABOVE) or 0),
    }


def inject_fault(step: int, rank: int) -> None:
    """The fault the COURSE_CRASH_* variables ask for, if ``step`` is theirs (0: set-up, else the end of that optimizer
    step) and ``rank`` is theirs; nothing otherwise. Every workflow calls it at the end of each step; ``join_world``
    at set-up."""
    faults = fault_settings()
    if step != faults["step"] or faults["process"] not in (None, rank):
        return
    where = f"{'during set-up' if step == 0 else f'at step {step}'} on rank {rank} ({CRASH_AT_STEP})"
    print(f"fault injection: {faults['mode']} {where}", file=sys.stderr, flush=True)
    if faults["mode"] == "exit":
        os._exit(1)
    if faults["mode"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if faults["mode"] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    raise RuntimeError(f"injected crash {where}")


def reliability_callbacks(world_size: int = 1) -> dict:
    """The Trainer callbacks that make a run survivable, by name:

    - ``manifest``: after every checkpoint save (all ranks done), rank 0 writes the checkpoint's manifest;
    - ``stop``: a SIGTERM, Ctrl-C or SIGUSR1 during training stops every rank at the end of the same step (on several
      processes, the one after the signal), with a checkpoint (``.stopped`` is then True: raise KeyboardInterrupt
      after ``trainer.train()`` returns);
    - ``finite``: a loss or gradient that is not finite stops every rank before that step's optimizer update
      (``my_utils.run.divergence``);
    - ``faults``: ``step_done`` at every step's end (the step a failure names; the COURSE_* faults, if asked).
    """
    import torch
    from accelerate import PartialState
    from transformers import TrainerCallback

    state = PartialState()
    faults = fault_settings()

    class CheckpointManifest(TrainerCallback):
        def on_save(self, args, trainer_state, control, **kwargs):
            state.wait_for_everyone()  # every rank has written its RNG state
            if state.is_main_process:
                folder = Path(args.output_dir) / f"{CHECKPOINT_PREFIX}{trainer_state.global_step}"
                write_checkpoint_manifest(folder)
            state.wait_for_everyone()

    class StopOnSigterm(TrainerCallback):
        stopped = False
        pending = None  # the reduction of the flags that this rank started at the end of the step before

        def on_train_begin(self, args, trainer_state, control, **kwargs):
            Sigterm.deferrable = True
            if Sigterm.requested:  # it came before training started: stop at once
                raise KeyboardInterrupt(Sigterm.name)

        def on_step_end(self, args, trainer_state, control, **kwargs):
            requested = Sigterm.name if Sigterm.requested else None
            if world_size > 1:  # stop together: a rank that got the signal a step later must not be left alone
                requested = self.agreed(requested)
            if requested:
                Sigterm.requested, Sigterm.name = True, requested  # every rank ends as the signal asked
                self.stopped = True
                control.should_save = True
                control.should_training_stop = True
            return control

        def agreed(self, requested: str | None) -> str | None:
            """The signal any rank had one step ago (the strongest of ``STOP_SIGNALS`` if several), or None. Each
            step end starts a reduction of the flags and reads the one started a step before, which has long
            finished: no rank waits for the others here (a blocking reduction each step cost as much as the
            gradients' own). Every rank reads the same reduction at the same step, so all stop at the end of the
            same step, the one after the signal."""
            code = STOP_SIGNALS.index(requested) + 1 if requested else 0
            flag = torch.tensor([code], device=state.device)
            work = torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, async_op=True)
            previous, self.pending = self.pending, (work, flag)
            return self.read(previous) if previous is not None else None

        @staticmethod
        def read(reduction) -> str | None:
            work, flag = reduction
            work.wait()
            return STOP_SIGNALS[int(flag.item()) - 1] if flag.item() else None

        def on_train_end(self, args, trainer_state, control, **kwargs):
            if self.pending is not None:  # no collective left in flight; a signal in the last step counts below
                agreed = self.read(self.pending)
                if agreed:
                    Sigterm.requested, Sigterm.name = True, agreed
                self.pending = None
            Sigterm.deferrable = False
            if Sigterm.requested and not self.stopped:  # it came after the last step: no step left to stop at
                raise KeyboardInterrupt(Sigterm.name)

    class StepDone(TrainerCallback):
        def on_train_begin(self, args, trainer_state, control, model=None, **kwargs):
            # a training forward of more than COURSE_FAKE_OOM_ABOVE rows raises as a GPU out of memory would
            if faults["oom_above"] and not getattr(model, "_fake_oom", False):
                model.register_forward_pre_hook(fake_oom_hook, with_kwargs=True)
                model._fake_oom = True

        def on_step_end(self, args, trainer_state, control, **kwargs):
            if faults["delay"]:
                time.sleep(faults["delay"])
            step_done(trainer_state.global_step, state.process_index)

    def fake_oom_hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if module.training and ids is not None and ids.shape[0] > faults["oom_above"]:
            raise torch.OutOfMemoryError(f"Fake out of memory. A batch of {ids.shape[0]} rows is above "
                                         f"{FAKE_OOM_ABOVE}={faults['oom_above']}.")

    return {"manifest": CheckpointManifest(), "stop": StopOnSigterm(), "finite": StopNonFinite(),
            "faults": StepDone()}
