"""``run-course``: the LoRA workflow (``my_utils.workflows.lora``) unchanged, with its training timed; the measured
side of ``overhead``, ``trainer`` and ``ddp``.

    python -m my_utils bench run-course --preset tiny --output-dir DIR ...   # the LoRA workflow's own options
"""

from __future__ import annotations

from pathlib import Path

from my_utils import UserError
from my_utils.run.results import atomic_write_json, load_run, read_json
from my_utils.tools.bench.harness import WARMUP_STEPS, Settings, logging_steps
from my_utils.tools.bench.loop import over_ranks, window_end, window_start
from my_utils.workflows import lora


def course_args(s: Settings, out: Path, batch_size: int, num_processes: int | None = None) -> list[str]:
    """The LoRA workflow's command line: training only is timed, so generation is skipped and the held-out
    set is small (at least one batch per process: the workflow drops incomplete batches)."""
    return [*s.preset_args(), "--max-steps", s.steps, "--local-batch-size", batch_size, "--skip-generation-eval",
            "--mixed-precision", "bf16" if s.bf16 else "no",
            "--eval-rows", 64, "--logging-steps", logging_steps(s.steps), "--output-dir", out,
            *(["--num-processes", num_processes] if num_processes else [])]


def course_figures(out: Path) -> dict:
    """A LoRA workflow run's training figures: its summary and the per-rank timing written by ``run-course``."""
    summary = read_json(out / "summary.json")
    ranks = [read_json(p) for p in sorted((out / "timing").glob("rank_*.json"))]
    return {**over_ranks(ranks), "steady": over_ranks([r["steady"] for r in ranks]),
            "summary_tokens_per_s": summary["tokens_per_s"], "runtime_s": summary["runtime_s"],
            "world_size": summary["world_size"], "settings": ranks[0]["settings"],
            "losses": [m["loss"] for m in load_run(out)["metrics"] if "loss" in m], "eval_loss": summary["eval_loss"]}


def speed_settings(args) -> dict:
    """The TrainingArguments that decide speed, under the names the results table uses."""
    return {"sampling": args.train_sampling_strategy, "gradient_checkpointing": bool(args.activation_checkpointing),
            "mixed_precision": "bf16" if args.bf16 else "fp16" if args.fp16 else args.mixed_precision,
            "find_unused_parameters": args.ddp_find_unused_parameters}


def course_main(argv) -> None:
    """``run-course``: the LoRA workflow unchanged (its command line), with Trainer.train's wall and CPU seconds,
    the tokens its collator made and the settings that decide speed written per rank to <output-dir>/timing/."""
    from accelerate import PartialState
    from transformers import Trainer, TrainerCallback

    cfg = lora.parse_args(argv)
    if cfg.output_dir is None:
        raise UserError("run-course needs --output-dir, where it writes each rank's timing.")
    measured = {}
    train = Trainer.train

    class SteadyState(TrainerCallback):
        """Starts the steady-state window at the end of step WARMUP_STEPS (as the bare loop does)."""

        def __init__(self, counter):
            self.counter = counter

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == WARMUP_STEPS:
                measured["window"] = window_start(self.counter)

    def timed_train(trainer, *args, **kwargs):
        counter = trainer.data_collator
        trainer.add_callback(SteadyState(counter))
        start = window_start(counter)
        result = train(trainer, *args, **kwargs)
        # the workflow zeroes its counter when training begins: the whole call counts from zero
        measured.update(window_end({**start, "tokens": 0, "padded_tokens": 0}, counter),
                        steady=window_end(measured.pop("window"), counter),
                        settings={**speed_settings(trainer.args), "packing": cfg.packing})
        return result

    Trainer.train = timed_train  # this process only: the workflow's own code runs as it is
    lora.train(cfg)
    rank = PartialState().process_index
    (Path(cfg.output_dir) / "timing").mkdir(exist_ok=True)
    atomic_write_json(Path(cfg.output_dir) / "timing" / f"rank_{rank}.json", {"process": rank, **measured})


WORKERS = {"run-course": course_main}
