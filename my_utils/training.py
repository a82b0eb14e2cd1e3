"""Plumbing shared by every workflow: opening (or reopening, to resume) a results folder from rank 0, the
learning-rate scaling rule, turning a run's outcome into its status, and the reliability pieces of training:

- checkpoints that are known to be whole (a manifest written after every save) and the newest good one to
  resume from (``find_resume_checkpoint``);
- SIGTERM (a scheduler preempting the job; ``accelerate launch`` forwards it to every worker): training stops
  at the end of the current step on every rank, saves a checkpoint, and the run ends ``interrupted`` with a
  non-zero exit;
- a rank that dies or hangs: collectives time out after ``--timeout-s`` and the error names the rank that
  stopped (the live ranks say so in the process group's store; the silent one is named,
  ``name_stopped_ranks``);
- fault injection for the tests (environment variables, unset in normal runs)::

      COURSE_CRASH_AT_STEP=k     crash at the end of optimizer step k
      COURSE_CRASH_RANK=r        ... on rank r only (default: every rank)
      COURSE_CRASH_MODE=m        raise (an exception, default) | exit (os._exit(1), no clean-up) |
                                 hang (stop responding until killed)
      COURSE_STEP_DELAY_S=s      sleep s seconds after every step (time for a test to send a signal)
      COURSE_FAKE_OOM_ABOVE=n    raise torch.OutOfMemoryError in a training forward with more than n rows

The Trainer-facing parts are made by ``reliability_callbacks`` and ``course_trainer_class``; transformers is
imported inside them, so importing this module stays light.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from my_utils import UserError
from my_utils.runs import Run, atomic_write_json, check_new_run_dir, now, read_json, redact_secrets, unique_dir

LR_SCALING = ("none", "linear", "sqrt")
CHECKPOINT_PREFIX = "checkpoint-"  # the Trainer's folder names: checkpoint-<step>
CHECKPOINT_MANIFEST = "checkpoint_complete.json"  # written last: a checkpoint without it was cut short
INCOMPLETE_PREFIX = "incomplete-"  # a cut-short checkpoint is renamed, never deleted, and never resumed from

CRASH_AT_STEP = "COURSE_CRASH_AT_STEP"
CRASH_RANK = "COURSE_CRASH_RANK"
CRASH_MODE = "COURSE_CRASH_MODE"
STEP_DELAY = "COURSE_STEP_DELAY_S"
FAKE_OOM_ABOVE = "COURSE_FAKE_OOM_ABOVE"
CRASH_MODES = ("raise", "exit", "hang")
FAILED_KEY = "course/collective_failed/{rank}"  # in the process group's store


def scale_learning_rate(base_lr: float, effective_batch: int, base_batch: int, rule: str = "none") -> float:
    """Scale a learning rate tuned for ``base_batch`` to ``effective_batch`` (= batch x accumulation x processes).

    'linear' multiplies by the batch ratio (Goyal et al., for SGD), 'sqrt' by its square root (often better
    for Adam), 'none' keeps it.
    """
    if rule not in LR_SCALING:
        raise UserError(f"Unknown learning-rate scaling {rule!r}; choose one of {', '.join(LR_SCALING)}.")
    ratio = effective_batch / base_batch
    return base_lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def check_positive(name: str, value, kind=int) -> None:
    """One sentence for a count or size that is not a positive (finite) number."""
    number_types = (int, float) if kind is float else int
    if (isinstance(value, bool) or not isinstance(value, number_types) or not math.isfinite(value)
            or value <= 0):
        raise UserError(f"{name} must be a positive {'number' if kind is float else 'integer'}, got {value!r}.")


def _agree(state, outcome: list) -> list:
    """Rank 0's ``outcome`` on every rank."""
    from accelerate.utils import broadcast_object_list

    if state.num_processes > 1:
        broadcast_object_list(outcome)
    return outcome


def open_run(path: str | Path | None, default: str | Path, config: dict, **fields) -> tuple[Run | None, Path]:
    """Create the results folder on rank 0 and agree on it across ranks.

    ``path`` None picks ``default`` (or ``default_2``... if taken); an explicit path that exists is refused on
    every rank with the same sentence, and nothing is written. Returns (the Run on rank 0 or None elsewhere,
    the agreed folder).
    """
    from accelerate import PartialState

    state = PartialState()
    outcome = [None, None]  # [path, error]
    if state.is_main_process:
        try:
            target = check_new_run_dir(path) if path else unique_dir(default)
            run = Run.create(target, config=config, **fields)
            outcome = [str(target), None]
        except UserError as e:
            outcome = [None, str(e)]
        except OSError as e:  # e.g. no space or no permission: every rank must hear of it, not only this one
            outcome = [None, f"Results folder {path or default} cannot be created ({e.strerror or e}); choose "
                       "another --output-dir."]
    _agree(state, outcome)
    if outcome[1]:
        raise UserError(outcome[1])
    return (run if state.is_main_process else None), Path(outcome[0])


# ---------------------------------------------------------------------------------------------- checkpoints


def checkpoint_step(folder: str | Path) -> int | None:
    """The step of a ``checkpoint-<step>`` folder, else None."""
    m = re.fullmatch(re.escape(CHECKPOINT_PREFIX) + r"(\d+)", Path(folder).name)
    return int(m.group(1)) if m else None


def write_checkpoint_manifest(folder: str | Path) -> None:
    """Record every file of a finished checkpoint with its size; written last, atomically."""
    folder = Path(folder)
    files = {p.relative_to(folder).as_posix(): p.stat().st_size
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != CHECKPOINT_MANIFEST}
    atomic_write_json(folder / CHECKPOINT_MANIFEST, {"step": checkpoint_step(folder), "written": now(),
                                                      "files": files})


def checkpoint_problem(folder: str | Path) -> str | None:
    """Why the checkpoint in ``folder`` cannot be resumed from (a few words), or None if it is whole."""
    folder = Path(folder)
    try:
        manifest = read_json(folder / CHECKPOINT_MANIFEST)
        files = manifest["files"]
    except FileNotFoundError:
        return "it was not finished (no manifest)"
    except (OSError, ValueError, KeyError, TypeError):
        return "its manifest is unreadable"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes instead of {size}"
    if "trainer_state.json" not in files:
        return "trainer_state.json is missing"
    for name in files:
        if name.endswith(".safetensors") and not _safetensors_readable(folder / name):
            return f"{name} is not a readable safetensors file"
    return None


def _safetensors_readable(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
        return True
    except Exception:  # safetensors raises its own error types for a damaged header
        return False


def find_resume_checkpoint(checkpoints: str | Path) -> tuple[Path, list[tuple[str, str]]]:
    """The newest whole checkpoint under ``checkpoints`` and the newer ones passed over, as (name, why).

    Never falls back to a fresh start: no whole checkpoint raises UserError with one sentence.
    """
    checkpoints = Path(checkpoints)
    found = sorted((p for p in checkpoints.glob(CHECKPOINT_PREFIX + "*") if checkpoint_step(p) is not None),
                   key=checkpoint_step, reverse=True) if checkpoints.is_dir() else []
    skipped = []
    for folder in found:
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder, skipped
        skipped.append((folder.name, problem))
    if not skipped:
        raise UserError(f"There is no checkpoint in {checkpoints} to resume from; rerun without --resume "
                        "and another --output-dir (add --save-steps N to checkpoint every N steps).")
    name, problem = skipped[0]
    raise UserError(f"No checkpoint in {checkpoints} can be resumed from ({name}: {problem}); rerun without "
                    "--resume and another --output-dir.")


def set_aside_incomplete(checkpoints: str | Path, names) -> list[str]:
    """Rename cut-short checkpoints to ``incomplete-checkpoint-<step>`` (kept for inspection, never resumed
    from, and out of the way of the Trainer, which will save that step again)."""
    moved = []
    for name in names:
        target = unique_dir(Path(checkpoints) / (INCOMPLETE_PREFIX + name))
        os.replace(Path(checkpoints) / name, target)
        moved.append(target.name)
    return moved


def check_resumable(run_dir: str | Path, config: dict, may_differ=()) -> dict:
    """Before resuming: the folder is a results folder that did not complete and was started with the same
    settings (except the keys in ``may_differ``). Returns its run.json."""
    run_dir = Path(run_dir)
    if not (run_dir / "run.json").is_file():
        raise UserError(f"There is no results folder at {run_dir} to resume; check --output-dir or drop --resume.")
    try:
        info = read_json(run_dir / "run.json")
    except (OSError, ValueError):
        raise UserError(f"{run_dir / 'run.json'} is unreadable, so the run cannot be resumed; start a new run "
                        "with another --output-dir.") from None
    if info.get("status") == "complete":
        raise UserError(f"The run in {run_dir} is already complete; there is nothing to resume.")
    recorded_config = info.get("config") or {}
    for key, value in config.items():
        if key in may_differ or key not in recorded_config:
            continue
        old = recorded_config[key]
        if _comparable(old) != _comparable(value):
            flag = "--" + key.replace("_", "-")
            raise UserError(f"The run in {run_dir} was started with {flag} {old!r}, not {value!r}; resume with "
                            "the same settings, or start a new run with another --output-dir.")
    return info


def _comparable(value):
    """Config values as run.json stores them (tuples come back as lists)."""
    return json.loads(json.dumps(value, default=str))


def reopen_run(run_dir: str | Path, checkpoints: str = "checkpoints", *, world_size: int,
               command: list[str] | None = None) -> tuple[Run | None, Path, Path]:
    """Continue the results folder ``run_dir`` from the newest whole checkpoint in its ``checkpoints`` folder.

    Rank 0 picks the checkpoint (``find_resume_checkpoint``: one sentence and nothing changed when there is
    none), sets aside the newer ones that were cut short, keeps the metrics rows up to the checkpoint's step
    (the resumed run logs the later steps again), and puts run.json back to ``running`` with the resume
    recorded under ``resumes``. Every rank must call it; returns (the Run on rank 0 or None elsewhere, the
    folder, the checkpoint).
    """
    from accelerate import PartialState

    state = PartialState()
    run_dir = Path(run_dir)
    outcome = [None, None]  # [checkpoint, error]
    if state.is_main_process:
        try:
            info = read_json(run_dir / "run.json")
            recorded_world = info.get("world_size")
            if recorded_world is not None and recorded_world != world_size:
                raise UserError(f"The run in {run_dir} trained on {recorded_world} process(es), not {world_size}; "
                                "resume it with the same number of processes.")
            checkpoint, skipped = find_resume_checkpoint(run_dir / checkpoints)
            for name, problem in skipped:
                print(f"passing over {name}: {problem}", file=sys.stderr, flush=True)
            moved = set_aside_incomplete(checkpoint.parent, [name for name, _ in skipped])
            step = checkpoint_step(checkpoint)
            run = Run(run_dir)
            run.keep_metrics_until(step)
            resume = {"started": now(), "from_checkpoint": checkpoint.relative_to(run_dir).as_posix(),
                      "from_step": step, "previous_status": info.get("status"),
                      "previous_error": info.get("error"), "set_aside": moved,
                      "command": redact_secrets(command if command is not None
                                                else [os.path.basename(sys.argv[0]), *sys.argv[1:]])}
            run.update(status="running", finished=None, error=None, resumes=[*info.get("resumes", []), resume])
            outcome = [str(checkpoint), None]
        except UserError as e:
            outcome = [None, str(e)]
    _agree(state, outcome)
    if outcome[1]:
        raise UserError(outcome[1])
    return (run if state.is_main_process else None), run_dir, Path(outcome[0])


# ---------------------------------------------------------------------------------------------- signals


class _Sigterm:
    """What the SIGTERM handler installed by ``recorded`` does: interrupt at once, or, while a Trainer can
    stop cleanly (``StopOnSigterm`` is active), ask it to stop after the current step."""

    deferrable = False
    requested = False


def _on_sigterm(signum, frame):
    if _Sigterm.deferrable and not _Sigterm.requested:
        _Sigterm.requested = True
        print("SIGTERM: stopping after this step and saving a checkpoint (send it again to stop at once)",
              file=sys.stderr, flush=True)
        return
    raise KeyboardInterrupt("SIGTERM")


@contextmanager
def recorded(run: Run | None):
    """Mark ``run`` failed (exception) or interrupted (Ctrl-C, SIGTERM) if the body does not finish.

    SIGTERM becomes KeyboardInterrupt (or, during training with ``reliability_callbacks``, a clean stop with a
    checkpoint, then KeyboardInterrupt) so that a preempted job leaves status 'interrupted' and no
    half-written summary, then exits non-zero.
    """
    previous = signal.getsignal(signal.SIGTERM)
    _Sigterm.requested = False
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread (e.g. some notebook launch paths): keep the default
        previous = None
    try:
        yield run
    except KeyboardInterrupt as e:
        if run is not None:
            run.fail(f"interrupted: {e}", status="interrupted")
        raise
    except BaseException as e:
        if run is not None:
            run.fail(redact_secrets(f"{type(e).__name__}: {e}"))  # an error may quote a URL or setting
        raise
    finally:
        _Sigterm.deferrable = False
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------------------------- ranks


class RankFailure(RuntimeError):
    """Another rank stopped (exited or hung) and a collective on this rank failed or timed out."""


def _store():
    """The process group's key-value store (hosted by the launcher under accelerate launch / torchrun)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _looks_like_a_failed_collective(error: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return bool(re.search(r"[Gg]loo|NCCL|[Tt]imed? ?out|[Cc]onnection (reset|closed|refused)|by peer", str(error)))


def name_stopped_ranks(error: BaseException, world_size: int, timeout_s: float, step: int | None = None,
                       grace_s: float = 3.0) -> RankFailure | None:
    """When ``error`` is a failed or timed-out collective: a RankFailure naming the rank(s) that stopped.

    Every rank that is still alive reaches this point through the same failed collective and says so in the
    process group's store; the ranks that have not said so within ``grace_s`` seconds are the ones that died,
    hung, or failed with an error of their own. Returns None for any other error.
    """
    if world_size < 2 or not _looks_like_a_failed_collective(error):
        return None
    import torch.distributed as dist

    store = _store()
    here = dist.get_rank()
    stopped = None
    if store is not None:
        try:
            store.set(FAILED_KEY.format(rank=here), "1")
            deadline = time.monotonic() + grace_s
            while True:
                stopped = [r for r in range(world_size) if not store.check([FAILED_KEY.format(rank=r)])]
                if not stopped or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        except Exception:  # the store went with the process that hosted it: nothing more to learn
            stopped = None
    where = f" after step {step}" if step is not None else ""
    if stopped:
        who = f"rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} stopped"
    else:
        who = "a rank stopped (which one could not be told)"
    text = str(error).strip()
    first_line = text.splitlines()[0][:300] if text else type(error).__name__
    return RankFailure(f"{who}: rank {here} waited for it in a collective{where} that failed or timed out "
                       f"(--timeout-s {timeout_s:g}): {first_line}")


# ---------------------------------------------------------------------------------------------- Trainer parts


def course_trainer_class():
    """``transformers.Trainer`` with two fixes:

    - evaluation sees every row: ``dataloader_drop_last`` keeps training batches whole (the same shapes on
      every rank), but applied to evaluation it drops the only batch of a small eval set (eval_loss None);
    - the order of length-grouped batches (``train_sampling_strategy="group_by_length"``) depends only on the
      seed and the epoch: the Trainer draws it from the global RNG when an epoch starts, a state that a run
      resumed in the middle of a later epoch cannot recreate, so its batches, and losses, would differ.
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

        def get_eval_dataloader(self, eval_dataset=None):
            drop_last, self.args.dataloader_drop_last = self.args.dataloader_drop_last, False
            try:
                return super().get_eval_dataloader(eval_dataset)
            finally:
                self.args.dataloader_drop_last = drop_last

    return CourseTrainer


def install_fake_oom(model) -> bool:
    """Fault injection: with COURSE_FAKE_OOM_ABOVE=n, a training forward with more than n rows raises
    torch.OutOfMemoryError (as a GPU would), to test the batch-size back-off. Returns whether it is on."""
    limit = os.environ.get(FAKE_OOM_ABOVE)
    if not limit:
        return False
    import torch

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if module.training and ids is not None and ids.shape[0] > int(limit):
            raise torch.OutOfMemoryError(f"Fake out of memory. A batch of {ids.shape[0]} rows is above "
                                         f"{FAKE_OOM_ABOVE}={limit}.")

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return True


def _fault_settings() -> dict:
    mode = os.environ.get(CRASH_MODE, "raise")
    if mode not in CRASH_MODES:
        raise UserError(f"{CRASH_MODE}={mode!r} is not a fault mode; use one of {', '.join(CRASH_MODES)}.")
    return {
        "step": int(os.environ[CRASH_AT_STEP]) if os.environ.get(CRASH_AT_STEP) else None,
        "rank": int(os.environ[CRASH_RANK]) if os.environ.get(CRASH_RANK) else None,
        "mode": mode,
        "delay": float(os.environ.get(STEP_DELAY) or 0),
    }


def reliability_callbacks(world_size: int = 1) -> dict:
    """The Trainer callbacks that make a run survivable, by name:

    - ``manifest``: after every checkpoint save (all ranks done), rank 0 writes the checkpoint's manifest;
    - ``stop``: a SIGTERM during training stops every rank at the end of the same step, with a checkpoint
      (``.stopped`` is then True: raise KeyboardInterrupt after ``trainer.train()`` returns);
    - ``faults``: the fault-injection hooks when a COURSE_* variable asks for one, else absent.
    """
    import torch
    from accelerate import PartialState
    from transformers import TrainerCallback

    state = PartialState()
    faults = _fault_settings()

    class CheckpointManifest(TrainerCallback):
        def on_save(self, args, trainer_state, control, **kwargs):
            state.wait_for_everyone()  # every rank has written its RNG state
            if state.is_main_process:
                folder = Path(args.output_dir) / f"{CHECKPOINT_PREFIX}{trainer_state.global_step}"
                write_checkpoint_manifest(folder)
            state.wait_for_everyone()

    class StopOnSigterm(TrainerCallback):
        stopped = False

        def on_train_begin(self, args, trainer_state, control, **kwargs):
            _Sigterm.deferrable = True
            if _Sigterm.requested:  # it came before training started: stop at once
                raise KeyboardInterrupt("SIGTERM")

        def on_step_end(self, args, trainer_state, control, **kwargs):
            requested = _Sigterm.requested
            if world_size > 1:  # stop together: a rank that got the signal a step later must not be left alone
                flag = torch.tensor([int(requested)], device=state.device)
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
                requested = bool(flag.item())
            if requested:
                _Sigterm.requested = True
                self.stopped = True
                control.should_save = True
                control.should_training_stop = True
            return control

        def on_train_end(self, args, trainer_state, control, **kwargs):
            _Sigterm.deferrable = False
            if _Sigterm.requested and not self.stopped:  # it came after the last step: no step left to stop at
                raise KeyboardInterrupt("SIGTERM")

    class InjectFaults(TrainerCallback):
        def on_step_end(self, args, trainer_state, control, **kwargs):
            if faults["delay"]:
                time.sleep(faults["delay"])
            if trainer_state.global_step != faults["step"] or faults["rank"] not in (None, state.process_index):
                return
            where = f"at step {faults['step']} on rank {state.process_index} ({CRASH_AT_STEP})"
            print(f"fault injection: {faults['mode']} {where}", file=sys.stderr, flush=True)
            if faults["mode"] == "exit":
                os._exit(1)
            if faults["mode"] == "hang":
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # unresponsive: only killing it ends it
                while True:
                    time.sleep(60)
            raise RuntimeError(f"injected crash {where}")

    callbacks = {"manifest": CheckpointManifest(), "stop": StopOnSigterm()}
    if faults["step"] is not None or faults["delay"]:
        callbacks["faults"] = InjectFaults()
    return callbacks
