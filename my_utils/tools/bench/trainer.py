"""``trainer``: the LoRA workflow's defaults, and the same with ``--group-by-length``, against stock trl
``SFTTrainer`` (SFTConfig defaults but for the model, data, batch, steps, learning rate and schedule, which are the
same): useful tokens/s, >= 1.25, with the held-out loss after training at most 10 % above stock's and (random
batches in the same order on both sides) the logged training losses within 10 %.

    python -m my_utils bench run-sft --preset tiny --output-dir DIR     # stock SFTTrainer alone
"""

from __future__ import annotations

import time
from pathlib import Path
from statistics import median

from my_utils.core.adapters import AdapterSpec
from my_utils.core.data import format_prompt, load_instructions
from my_utils.core.models import add_adapter, build_causal_lm, load_tokenizer, set_threads
from my_utils.core.presets import get_preset
from my_utils.run.callbacks import TokenCounter
from my_utils.run.config import OneLineParser
from my_utils.run.launch import is_cpu_only
from my_utils.run.results import read_json
from my_utils.tools.bench.course import course_args, course_figures, speed_settings
from my_utils.tools.bench.harness import (Settings, alternate, bench_env, logging_steps, python_command, ratio_row,
                                          recorded_run, throughput_ratio)

NAME = "trainer"
HELP = ("the LoRA workflow's defaults (and --group-by-length) against stock trl SFTTrainer: useful tokens/s "
        ">= 1.25; held-out and training losses within 10 %")
LOSS_TOLERANCE = 0.10  # relative difference of losses that counts as "the same trajectory"
TARGETS = {"trainer": 1.25, "loss_over_stock": 1 + LOSS_TOLERANCE}  # the loss: at most
ORDER = 20
REPEATS = 2
STOCK = "stock trl SFTTrainer"


def run(s: Settings, folder: Path):
    """The LoRA workflow's defaults (and with ``--group-by-length``) against stock SFTTrainer on the same data."""
    batch = s.batch()
    variants = {
        "course": lambda out: python_command("run-course", *course_args(s, out, batch)),
        "grouped": lambda out: python_command("run-course", *course_args(s, out, batch), "--group-by-length"),
        "sft": lambda out: python_command("run-sft", *s.preset_args(), "--local-batch-size", batch, "--steps", s.steps,
                                          "--logging-steps", logging_steps(s.steps), "--eval-rows", 64,
                                          "--output-dir", out),
    }
    runs = alternate(variants, s.repeats_for(NAME), folder, bench_env(s), NAME)
    found = {name: [course_figures(p) for p in runs[name]] for name in ("course", "grouped")}
    found["sft"] = sft_runs = [read_json(p / "summary.json") for p in runs["sft"]]
    held_out = {name: median(r["eval_loss"] for r in rs) for name, rs in found.items()}
    rows = []
    for name, label in (("course", "LoRA workflow defaults"), ("grouped", "LoRA workflow, --group-by-length")):
        wall, cpu = throughput_ratio(found[name], sft_runs)
        differs = ", ".join(f"{k}: {v}" for k, v in sft_runs[0]["stock_settings"].items()
                            if k != "find_unused_parameters" and found[name][0]["settings"].get(k) != v)
        rows += [
            ratio_row(NAME, "useful tokens/s, training", label, STOCK, wall,
                      target=TARGETS["trainer"] if name == "course" else None, cpu_ratio=cpu,
                      detail=f"useful/padded tokens {useful_fraction(found[name]):.2f} vs "
                             f"{useful_fraction(sft_runs):.2f}; stock {differs}"),
            ratio_row(NAME, "held-out loss after training", label, STOCK, held_out[name] / held_out["sft"],
                      target=TARGETS["loss_over_stock"], at_most=True, detail=f"{s.steps} steps, 64 held-out rows",
                      if_missed="where length follows the task, as in the tiny data, batches of one length hold one "
                                "task and the last steps decide the loss: why --group-by-length is off by default"),
        ]
    # The same random batches in the same order (both seed their sampler with the seed): the logged losses can be
    # compared window by window. Length-grouped batches cannot: each holds one length, so one kind of task.
    gap = trajectory_gap(found["course"], sft_runs)
    rows.append(ratio_row(NAME, "training loss, every logged window: 1 + largest relative gap",
                          "LoRA workflow defaults", STOCK, 1 + gap, target=TARGETS["loss_over_stock"], at_most=True,
                          detail=f"{len(sft_runs[0]['losses'])} windows of {logging_steps(s.steps)} steps"))
    return {**found, "held_out_loss": held_out, "trajectory_gap": gap}, rows


def trajectory_gap(measured: list[dict], baseline: list[dict]) -> float:
    """The largest relative difference between two runs' logged training losses, window by window (the median
    run's curve of each side, taken point by point)."""
    curves = [[median(points) for points in zip(*(r["losses"] for r in runs))] for runs in (measured, baseline)]
    return max(abs(a / b - 1) for a, b in zip(*curves))


def useful_fraction(runs: list[dict]) -> float:
    return sum(r["tokens"] for r in runs) / sum(r["padded_tokens"] for r in runs)


def sft_main(argv) -> None:
    """``run-sft``: stock trl SFTTrainer (SFTConfig's defaults) on the workflow's model, data, batch, steps and
    learning-rate schedule, with LoRA from the same function; training time and tokens measured as the workflow's."""
    p = OneLineParser(prog="python -m my_utils bench run-sft", description=sft_main.__doc__)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--local-batch-size", dest="batch_size", type=int, default=None)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument("--eval-rows", type=int, default=64)
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--data-file", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)
    recorded_run(args.output_dir, vars(args), lambda: stock_sft(args))


def stock_sft(args) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    preset = get_preset(args.preset)
    set_threads()
    tokenizer = load_tokenizer(preset)
    train_rows, eval_rows = load_instructions(preset.instruction_data, eval_rows=args.eval_rows, seed=args.seed,
                                              path=args.data_file)

    def prompt_completion(rows):  # trl's prompt-completion format: the loss is on the completion only, as ours
        return Dataset.from_list([{"prompt": format_prompt(r), "completion": r["output"]} for r in rows])

    model = add_adapter(build_causal_lm(preset, random_init=args.random_init),
                     AdapterSpec(rank=8).resolved(preset.lora_targets))
    config = SFTConfig(
        output_dir=str(Path(args.output_dir) / "trainer"),
        per_device_train_batch_size=args.batch_size or preset.batch_size,
        per_device_eval_batch_size=args.batch_size or preset.batch_size,
        learning_rate=preset.learning_rate, lr_scheduler_type=preset.lr_scheduler, warmup_steps=0.05,
        max_steps=args.steps,
        max_length=preset.max_length, logging_steps=args.logging_steps, save_strategy="no", report_to="none",
        seed=args.seed, use_cpu=is_cpu_only(),
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=prompt_completion(train_rows),
                         eval_dataset=prompt_completion(eval_rows), processing_class=tokenizer)
    counter = trainer.data_collator = TokenCounter(trainer.data_collator)
    started, cpu_started = time.perf_counter(), time.process_time()
    trainer.train()
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    tokens, padded = counter.tokens, counter.padded_tokens  # before the evaluation's batches add to them
    eval_loss = trainer.evaluate().get("eval_loss")
    return {
        "stock_settings": speed_settings(trainer.args), "runtime_s": seconds, "cpu_s": cpu_seconds,
        "tokens": tokens, "padded_tokens": padded, "tokens_per_s": tokens / seconds, "cpu_tokens_per_s": tokens / cpu_seconds,
        "losses": [r["loss"] for r in trainer.state.log_history if "loss" in r], "eval_loss": eval_loss,
    }


WORKERS = {"run-sft": sft_main}
