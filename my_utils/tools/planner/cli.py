"""``python -m my_utils plan``: the plan for one run, and whether it fits a device."""

from __future__ import annotations

import json
from dataclasses import asdict, fields

from my_utils import UserError
from my_utils.core.adapters import AdapterSpec
from my_utils.core.memory import format_bytes
from my_utils.core.pipeline import SCHEDULES
from my_utils.core.presets import PRESETS
from my_utils.core.tables import text_table
from my_utils.run.config import OneLineParser, add_arguments, build_config
from my_utils.tools.planner.arithmetic import DTYPES, ZERO_STAGES, Plan
from my_utils.tools.planner.runtime import DEVICES, device_memory, measure_baseline_rss, parse_size, with_runtime
from my_utils.tools.planner.settings import plan


def render(p: Plan, limit: float | None = None, limit_name: str = "") -> str:
    rows = [[part, format_bytes(size), how] for part, size, how in p.parts()]
    devices = p.processes * p.tp * p.pp
    layout = " x ".join([f"{p.processes} data parallel"] + [f"{n} {kind}" for n, kind in
                                                              ((p.tp, "tensor"), (p.pp, "pipeline")) if n > 1])
    rows.append(["peak per process", format_bytes(p.peak), (f"x {devices} process(es), one per device"
                 + (f": {layout}" if devices > p.processes else "") + (f", ZeRO-{p.zero}" if p.zero else ""))
                 if devices > 1 else "one process"])
    title = (f"{p.preset}, {p.method}" + (f" r={p.rank}" if p.rank else "") + f", {p.dtype}, batch {p.batch} x seq "
             f"{p.seq}" + (" per replica" if devices > p.processes else "") + f", {devices} process(es): "
             f"{p.trainable_params:,} trainable of {p.total_params:,} parameters"
             + (" on this process" if devices > p.processes else ""))
    lines = [title, text_table(["part", "memory", "from"], rows)]
    if limit is not None:
        verdict = "fits" if p.peak <= limit else "does NOT fit"
        lines.append(f"{verdict} {limit_name} ({format_bytes(limit)}): {100 * p.peak / limit:.0f}% used")
    return "\n".join(lines)


def main(argv=None) -> Plan:
    import argparse

    ap = OneLineParser(prog="python -m my_utils plan", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)}")
    ap.add_argument("--method", default="lora", help="full, lora or qlora (4-bit; qlora-8bit for 8-bit)")
    ap.add_argument("--quantize", choices=("4bit", "8bit"), help="QLoRA's weight format (default 4bit)")
    add_arguments(ap.add_argument_group("the adapter (LoRA, QLoRA)"), AdapterSpec)
    ap.add_argument("--local-batch-size", dest="batch_size", type=int, help="batch per process (default: the preset's)")
    ap.add_argument("--max-length", type=int, help="tokens per example after padding (default: the preset's)")
    ap.add_argument("--processes", type=int, default=1, help="data-parallel processes (replicas), one per device "
                    "unless --tp or --pp split each replica over more")
    ap.add_argument("--zero", type=int, default=0, choices=ZERO_STAGES,
                    help="ZeRO stage over the processes: 1 shards the optimizer states, 2 also the gradients and "
                    "stored weights (gathered whole from forward to backward), 3 gathers one block at a time")
    split = ap.add_argument_group("the model split over more processes per replica (model_parallel.py)")
    split.add_argument("--tp", type=int, default=1, help="tensor-parallel processes (Megatron's plan, as lesson 09 "
                       "trains it; full fine-tuning)")
    split.add_argument("--sequence-parallel", action="store_true", help="with --tp: the norms split by position too")
    split.add_argument("--pp", type=int, default=1, help="pipeline stages (lesson 08)")
    split.add_argument("--microbatches", type=int, help="micro-batches per batch through the pipeline (default: --pp)")
    split.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                       help="gpipe holds every micro-batch's activations; 1f1b at most the stages' (default 1f1b)")
    # the workflows' names too (--mixed-precision no|bf16, and transformers 5's activation checkpointing), so that
    # a run's flags can be planned as they are
    ap.add_argument("--dtype", "--mixed-precision", default="fp32", choices=tuple(DTYPES),
                    type=lambda name: {"no": "fp32"}.get(name, name),
                    help="compute dtype (bf16: mixed precision, autocast over fp32 weights; as --mixed-precision, "
                    "no is fp32)")
    ap.add_argument("--gradient-checkpointing", "--activation-checkpointing", action="store_true",
                    help="keep only each layer's input")
    ap.add_argument("--plain-loss", action="store_true",
                    help="the whole logits at once (the workflow's --no-chunked-loss), not its chunked loss")
    ap.add_argument("--device", help=f"the device to fit: {', '.join(DEVICES)}, or cpu (this machine's memory "
                    "shared by the processes; adds the measured process baseline)")
    ap.add_argument("--memory", help="the memory to fit per device instead, e.g. 24GiB")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    on_cpu = (args.device or "").lower() == "cpu"
    limit, limit_name = None, ""
    if args.memory:
        limit, limit_name = parse_size(args.memory), args.memory
    elif on_cpu:
        import psutil

        devices = args.processes * args.tp * args.pp
        limit, limit_name = psutil.virtual_memory().total / devices, f"this machine's memory / {devices}"
    elif args.device:
        limit_name, limit = device_memory(args.device)
    adapter = build_config(AdapterSpec, vars(args))
    if args.method == "full" and adapter != AdapterSpec():
        changed = next(f.name for f in fields(AdapterSpec) if getattr(adapter, f.name) != getattr(AdapterSpec(), f.name))
        raise UserError(f"--{changed.replace('_', '-')} sets the LoRA adapter, which --method full has none of; drop "
                        "it, or plan --method lora.")
    p = plan(args.preset, args.method, adapter=adapter, batch_size=args.batch_size,
             max_length=args.max_length,
             processes=args.processes, dtype=args.dtype, quantize=args.quantize,
             gradient_checkpointing=args.gradient_checkpointing, device="cpu" if on_cpu else "cuda", zero=args.zero,
             chunked_loss=not args.plain_loss, tp=args.tp, pp=args.pp, microbatches=args.microbatches,
             schedule=args.schedule, sequence_parallel=args.sequence_parallel)
    quantize = p.method.split("-", 1)[1] if p.method.startswith("qlora") else "none"
    with_runtime(p, "cpu" if on_cpu else "cuda", measure_baseline_rss(quantize) if on_cpu else None)
    if args.json:
        print(json.dumps({**asdict(p), "activations": p.activations, "peak": p.peak, "limit": limit,
                          "fits": None if limit is None else p.peak <= limit}, indent=2))
    else:
        print(render(p, limit, limit_name))
    return p
