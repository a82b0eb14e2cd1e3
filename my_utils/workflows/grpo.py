"""GRPO (group relative policy optimization) of a causal LM with a LoRA adapter and a verifiable reward, on one or
several processes: trl's ``GRPOTrainer``. For every prompt the policy samples ``--num-generations`` answers, a
formula scores each against the reference answer (``my_utils.core.rewards``: exact match, or chrF similarity for
partial credit), and each answer's advantage is its reward against the mean of its group.

    python -m my_utils.workflows.grpo --preset tiny
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_x2.yaml -m my_utils.workflows.grpo --preset tiny
    python -m my_utils.workflows.grpo --preset tiny --reward exact_match --num-generations 8
    # a notebook
    from my_utils.run.launch import launch
    launch(train, Config(preset="tiny", local_batch_size=4), num_processes=2)

A batch counts answers, not prompts: the global batch (local_batch_size x grad_accum x processes) holds
global_batch / num_generations prompts, so ``--num-generations`` must divide it (refused before any process
starts to train, where trl would stop with a traceback).

Writes a results folder (run.json, metrics.jsonl with trl's reward and reward_std per logged step, summary.json,
the adapter) and returns its summary: the reward over steps, exact match and similarity of greedy answers on
held-out rows before and after, speed, the seconds each process spent generating and their share of training
time, memory on every process. ``--save-steps`` and ``--resume`` work as in ``my_utils.workflows.lora``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import ClassVar

from my_utils import UserError
from my_utils.core.adapters import complete_adapter_folder
from my_utils.core.data import INSTRUCTION_COLUMNS, check_enough_rows, check_text_columns, format_prompt, load_instructions
from my_utils.core.devices import per_rank_device
from my_utils.core.models import add_adapter, build_causal_lm, count_parameters, load_tokenizer
from my_utils.core.paths import RUNS_ROOT
from my_utils.core.printing import print0
from my_utils.core.rewards import REWARDS, reward_function
from my_utils.run.callbacks import make_callbacks
from my_utils.run.cli import command_line
from my_utils.run.config import check_positive, setting
from my_utils.run.faults import reliability_callbacks
from my_utils.run.lifecycle import join_world, resume_after_restart, run_lifecycle
from my_utils.workflows import post_training
from my_utils.workflows.ddp_common import worker_report, write_worker_report
from my_utils.workflows.lora import fit, generation_eval, save_adapter, stop_if_already_trained

DESCRIPTION = ("GRPO of a causal LM with a LoRA adapter and a verifiable reward (trl's GRPOTrainer). Writes a results "
               "folder and prints its summary. Launch with `ACCELERATE_USE_CPU=1 accelerate launch --config_file "
               "configs/cpu_x2.yaml -m my_utils.workflows.grpo ...` for several processes.")


@dataclass
class Config(post_training.PostTrainingSettings):
    TRAINING_DEFAULTS: ClassVar[dict] = {"local_batch_size": 8, "max_steps": 100}
    METHOD: ClassVar[str] = "lora"
    SETTING_HELP: ClassVar[dict] = {"local_batch_size": "sampled answers (not prompts) per process per micro-batch",
                                    "max_length": "tokens per prompt (default: the preset's)"}
    reward: str = setting("similarity", "the verifiable reward: exact_match (1 or 0) or similarity (chrF, partial "
                          "credit)", choices=tuple(REWARDS))
    num_generations: int = setting(4, "answers sampled per prompt (a group); must divide the global batch")
    max_completion_length: int = setting(16, "tokens sampled per answer")
    temperature: float = setting(1.0, "sampling temperature")
    beta: float = setting(0.0, "weight of the KL penalty against the base model (0, trl's default: none, and no "
                          "reference pass)")
    data_file: str | None = setting(None, "JSON-lines file with instruction, input, output (default: the preset's "
                                    "data); output is the reference the reward scores against")


def validate(cfg: Config):
    """Check the settings before anything starts (nothing heavy imported, nothing written, no process group);
    returns the preset."""
    preset = post_training.check_settings(cfg, "grpo")
    reward_function(cfg.reward)
    for name in ("num_generations", "max_completion_length"):
        check_positive(f"--{name.replace('_', '-')}", getattr(cfg, name))
    check_positive("--temperature", cfg.temperature, float)
    if isinstance(cfg.beta, bool) or not isinstance(cfg.beta, (int, float)) or not 0 <= cfg.beta < float("inf"):
        raise UserError(f"--beta must be a number from 0 up, got {cfg.beta!r}.")
    check_groups(cfg, preset)
    return preset


resolve = post_training.resolve


def check_groups(cfg: Config, preset) -> None:
    """A group of ``num_generations`` answers is scored together, so the global batch must hold whole groups:
    one sentence, before any process group, where trl would stop every process with a traceback (trl #2858,
    #3061). The world size is the launcher's (WORLD_SIZE), or ``--num-processes``."""
    if cfg.num_generations < 2:
        raise UserError(f"--num-generations must be 2 or more (an answer's advantage is against the others of its "
                        f"group), got {cfg.num_generations}.")
    world_size = cfg.num_processes or int(os.environ.get("WORLD_SIZE", "1"))
    local = cfg.local_batch_size or preset.batch_size
    global_batch = local * cfg.grad_accum * world_size
    if global_batch % cfg.num_generations:
        raise UserError(f"--num-generations {cfg.num_generations} does not divide the global batch of {global_batch} "
                        f"answers ({local} per process per micro-batch x {cfg.grad_accum} micro-batch(es) x {world_size} "
                        "process(es)); "
                        "change --local-batch-size, --grad-accum or --num-generations.")


def train(cfg: Config) -> dict:
    """Train the adapter by GRPO and evaluate; returns the summary (on every process; process 0 also writes it)."""
    cfg = resume_after_restart(cfg)
    preset = validate(cfg)
    world_size = join_world(cfg.num_processes, cfg.timeout_s)
    cfg = resolve(cfg, preset, world_size)
    rows, held_out = load_instructions(preset.instruction_data, eval_rows=cfg.eval_rows, seed=cfg.seed,
                                       path=cfg.data_file)
    check_text_columns(rows + held_out, INSTRUCTION_COLUMNS, cfg.data_file or f"the {preset.instruction_data} data")
    check_enough_rows(len(rows), cfg.global_batch(world_size) // cfg.num_generations)
    tokenizer = load_tokenizer(preset)

    from datasets import Dataset
    from transformers import set_seed
    from trl import GRPOConfig, GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """trl's GRPOTrainer, counting the seconds this process spends sampling answers."""

        generation_s = 0.0

        def _generate(self, prompts):
            started = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                self.generation_s += time.perf_counter() - started

    set_seed(cfg.seed)
    device = per_rank_device()
    with run_lifecycle(cfg, world_size, default_dir=RUNS_ROOT / "grpo" / f"{cfg.preset}_{cfg.reward}",
                       checkpoints=post_training.CHECKPOINTS, workflow="grpo") as life:
        write_worker_report(life.folder, worker_report())
        model = add_adapter(build_causal_lm(preset, random_init=cfg.random_init), cfg.adapter)
        params = count_parameters(model)
        print0(f"trainable parameters: {params['trainable']:,} of {params['total']:,}; reward {cfg.reward}; "
               f"{cfg.num_generations} answers per prompt")
        before = generation_eval(cfg, model.to(device), tokenizer, held_out)
        memory_cb, metrics_cb = make_callbacks(life.run, device)
        reliability = reliability_callbacks(world_size)
        # region: trl's GRPO with a formula for the reward
        prompts = Dataset.from_list([{"prompt": format_prompt(r), "output": r["output"]} for r in rows])
        args = GRPOConfig(**post_training.trl_arguments(cfg, life.folder), num_generations=cfg.num_generations,
                          max_completion_length=cfg.max_completion_length, temperature=cfg.temperature,
                          beta=cfg.beta)
        trainer = TimedGRPOTrainer(model=model, reward_funcs=[reward_function(cfg.reward)], args=args,
                                   train_dataset=prompts, processing_class=tokenizer,
                                   callbacks=[c for c in (stop_if_already_trained(), memory_cb, metrics_cb,
                                                          *reliability.values()) if c])
        # endregion
        result, runtime = fit(trainer, life.checkpoint, reliability["stop"])
        generation_s = life.gather(trainer.generation_s)
        quality = {"before": before, "after": generation_eval(cfg, trainer.model, tokenizer, held_out)}
        summary = None
        if life.is_main:
            adapter_bytes = save_adapter(trainer.model, life.folder)
            summary = {"workflow": "grpo", "preset": cfg.preset,
                       **post_training.summary_fields(cfg, world_size, result, life.checkpoint, runtime,
                                                      memory_cb.report, quality, params, adapter_bytes,
                                                      unit="answers"),
                       **grpo_fields(cfg, world_size, trainer, generation_s, runtime)}
            complete_adapter_folder(life.folder / "adapter", tokenizer, life.run.info, summary)
        life.finish(summary)
    return life.summary


def grpo_fields(cfg: Config, world_size: int, trainer, generation_s: list[float], runtime: float) -> dict:
    """GRPO's own summary fields: its settings, the reward logged first and last, and where the time went (the
    seconds each process spent sampling answers, and process 0's share of its training time)."""
    logged = [r for r in trainer.state.log_history if "reward" in r]
    return {
        "prompts_per_step": cfg.global_batch(world_size) // cfg.num_generations,
        "num_generations": cfg.num_generations,
        "reward": cfg.reward,
        "beta": cfg.beta,
        "reward_first": logged[0]["reward"] if logged else None,
        "reward_final": logged[-1]["reward"] if logged else None,
        "generation_s": generation_s,
        "generation_share": generation_s[0] / runtime if runtime else None,
    }


parse_args, main = command_line(Config, train, __name__, DESCRIPTION)
