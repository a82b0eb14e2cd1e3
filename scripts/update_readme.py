"""Regenerate the README's series table and demo time, the fits table (docs/planner.md), the GPU check
(docs/running.md) and the reference runs' tables (runs/reference/README.md), from the committed reference runs and
the planner (never typed by hand).

    python scripts/update_readme.py     # reads runs/reference/, rewrites those pages in place

The series table (between ``<!-- series:start -->`` and ``<!-- series:end -->``) lists every notebook with what it
teaches and the claims its closing cell checked, with their measured figures, read from the ``claims.json`` each
lesson wrote in the reference demo run (``runs/reference/cpu_x2``). ``runs/reference/README.md`` holds the
markdown tables of ``python -m my_utils compare runs/reference/<folder> --markdown`` for each reference folder, or,
for a folder of benchmarks written by ``python -m my_utils bench``, their table of ratios; the README's section
between ``<!-- results:start -->`` and ``<!-- results:end -->`` points there. The table between ``<!-- fits:start -->`` and
``<!-- fits:end -->`` is the memory planner's ``fits_table``, the one between ``<!-- splits:start -->`` and
``<!-- splits:end -->`` its ``split_fits_table``. The section between ``<!-- gpu:start -->`` and
``<!-- gpu:end -->`` is the report of the GPU check (``python -m my_utils gpucheck``) in ``runs/reference/gpu_x1``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from my_utils.run.results import CLAIMS_FILE, read_json  # noqa: E402
from my_utils.tools.bench import BENCHMARKS, render_table  # noqa: E402
from my_utils.tools.compare import overview  # noqa: E402
from my_utils.tools.gpucheck import report as gpucheck_report  # noqa: E402
from my_utils.tools.planner import fits_table, split_fits_table  # noqa: E402

REFERENCE = REPO_ROOT / "runs" / "reference"
DEMO_REFERENCE = REFERENCE / "cpu_x2"  # the reference `make demo` run
START, END = "<!-- results:start -->", "<!-- results:end -->"
SERIES_START, SERIES_END = "<!-- series:start -->", "<!-- series:end -->"
FITS_START, FITS_END = "<!-- fits:start -->", "<!-- fits:end -->"
SPLITS_START, SPLITS_END = "<!-- splits:start -->", "<!-- splits:end -->"
GPU_START, GPU_END = "<!-- gpu:start -->", "<!-- gpu:end -->"
DEMO_START, DEMO_END = "<!-- demo:start -->", "<!-- demo:end -->"
GPU_REFERENCE = REFERENCE / "gpu_x1"  # the reference GPU check
# What each notebook teaches; what it showed comes from the reference run.
LESSONS = {
    "00_setup": ("setup", "versions, devices, presets, what runs where on this machine"),
    "01_data_parallel": ("data parallel", "`torch.nn.DataParallel`: scatter, replicate, gather, and why one process "
                         "limits it"),
    "02_ddp": ("DDP", "process groups, `DistributedSampler` + `set_epoch`, gradient all-reduce; raw torch and the "
               "Trainer under `torchrun`"),
    "03_accelerate": ("accelerate", "a plain loop turned into an accelerate loop one feature at a time "
                      "(`# New Code #`); `accelerate config`, `accelerate env` and the config file a launch reads"),
    "04_lora": ("LoRA", "adapters, trainable parameters, LoRA beside full fine-tuning, a run in TensorBoard, adapter "
                "size, merging"),
    "05_lora_ddp": ("LoRA + DDP", "one function, two launchers; per-rank device map and memory; the learning-rate "
                    "rule for a bigger batch, measured; speed and quality against one process"),
    "06_qlora": ("QLoRA", "8-bit and 4-bit NF4 base weights, the memory breakdown against the arithmetic, quality "
                 "with one fixed scorer"),
    "07_rank_sweep": ("rank sweep", "what a bigger LoRA rank buys and costs, rank apart from scaling and learning "
                      "rate; one fresh process per run"),
    "08_model_pipeline_parallel": ("model and pipeline parallel", "a balanced layer split, its idle time, a GPipe "
                                   "schedule with `torch.distributed.pipelining`"),
    "09_tensor_parallel": ("tensor, sequence, context and 2D parallel", "Megatron's column and row splits with "
                           "`parallelize_module` on a tiny Llama, ring attention, a dp x tp mesh: each step equal to the "
                           "whole model's, collectives and bytes counted against the arithmetic, memory per process"),
    "10_sharding": ("sharded data parallel", "ZeRO-1, 2 and 3 (`ZeroRedundancyOptimizer`, FSDP2 `fully_shard`) beside "
                    "DDP: same losses, memory per process measured against the formulas, communication per step; LoRA "
                    "on a sharded base, its adapter saved whole"),
    "11_classification": ("classification", "full vs LoRA on one device, with DDP and as a pipeline"),
    "12_traps": ("traps", "failures people hit in distributed fine-tuning, each sprung and cured: loss "
                 "normalisation, checkpointing a frozen base, reentrant checkpointing under DDP, sharded adapter saves, "
                 "an upcast frozen base, `device_map=\"auto\"` under DDP, `notebook_launcher` refusing, evaluating "
                 "before training"),
    "13_peft_methods": ("PEFT methods", "LoRA, DoRA, IA3, prompt, P- and prefix tuning, VeRA and LN tuning beside full "
                        "fine-tuning, each a peft config file at its better learning rate: quality, parameters, "
                        "step time, forgetting, merging"),
    "14_compare": ("compare runs", "tables and plots from results folders, the memory planner beside measurement"),
}


def machine(folder: Path) -> str:
    """The CPU or GPU names recorded in the folder's first run.json."""
    run_json = next(folder.rglob("run.json"), None)
    if run_json is None:
        return "unknown machine"
    devices = read_json(run_json).get("devices") or []
    return ", ".join(f"{d['name']}" + (f" ({d['cores']} cores)" if d.get("cores") else "") for d in devices)


def bench_runs(folder: Path) -> list[dict]:
    """The complete benchmarks directly under ``folder`` (what ``python -m my_utils bench`` wrote), in the order the
    command runs them: each as {"run": run.json, "summary": summary.json}."""
    found = []
    for summary in folder.glob("*/summary.json"):
        run = read_json(summary.parent / "run.json")
        if run.get("status") == "complete" and "ratios" in read_json(summary):
            found.append({"run": run, "summary": read_json(summary)})
    return sorted(found, key=lambda b: BENCHMARKS.index(b["summary"]["benchmark"]))


RESULTS_FILE = REFERENCE / "README.md"  # the reference runs' tables, generated: too long for the README itself
RESULTS_POINTER = "\n".join([
    START, "", "The tables of the reference runs (each run's settings, speedup, memory per device, batch and learning "
    "rate,", "quality) are generated into [runs/reference/README.md](runs/reference/README.md) by "
    "`python scripts/update_readme.py`.", "", END])


def results_section() -> str:
    parts = [START, "", "Generated by `python scripts/update_readme.py` from the folders under `runs/reference/`;",
             "regenerate them with `make demo` (and `python -m my_utils bench`) and compare yours with",
             "`python -m my_utils compare runs/reference/<folder> runs/<yours>`.", ""]
    for folder in sorted(p for p in REFERENCE.iterdir() if p.is_dir() and not p.name.startswith(".")
                         and p != GPU_REFERENCE):  # the GPU check has a section of its own in README.md
        parts += [f"### `runs/reference/{folder.name}` — {machine(folder)}", ""]
        benchmarks = bench_runs(folder)
        if benchmarks:
            command = " ".join(benchmarks[0]["run"]["command"])
            parts += [f"`{command}`: each ratio is of medians of runs taken side by side with its baseline; the "
                      "CPU-time estimate is the same ratio from CPU seconds.", "",
                      render_table([row for b in benchmarks for row in b["summary"]["ratios"]], markdown=True), ""]
        else:
            parts += [overview(folder, root=folder, markdown=True), ""]
    parts.append(END)
    return "\n".join(parts)


def demo_sentence() -> str:
    """The reference demo's time, as its summary.json recorded it."""
    demo = read_json(DEMO_REFERENCE / "demo" / "summary.json")
    return (f"{DEMO_START}the reference run (`runs/reference/cpu_x2/demo/summary.json`) took "
            f"{demo['total_seconds']:.0f} s for its\n{len(demo['notebook_seconds'])} notebooks on an idle 2-core "
            f"machine{DEMO_END}")


def series_section() -> str:
    """The series table: each notebook, what it teaches, and each claim it checked with the figure measured in
    the reference demo run ("not recorded" where the reference run has no claims file for it)."""
    rows = [SERIES_START, "| # | notebook | what it teaches | what the reference run showed (checked by its last cell) |",
            "|---|---|---|---|"]
    for stem, (title, teaches) in LESSONS.items():
        claims_file = DEMO_REFERENCE / stem / CLAIMS_FILE
        shown = "<br>".join(f"{c['claim']}: {c['figure']}" for c in read_json(claims_file)) \
            if claims_file.is_file() else "not recorded"
        rows.append(f"| {stem[:2]} | [{title}](notebooks/{stem}.ipynb) | {teaches} | {shown} |")
    rows.append(SERIES_END)
    return "\n".join(rows)


def gpu_section() -> str:
    """The GPU check's report: the device, the command, the versions, then its tables and checks."""
    run, summary = read_json(GPU_REFERENCE / "run.json"), read_json(GPU_REFERENCE / "summary.json")
    versions = run["versions"]
    return "\n".join([
        GPU_START, "",
        f"Generated by `python scripts/update_readme.py` from `runs/reference/gpu_x1`: `python -m my_utils gpucheck "
        f"--output-dir runs/reference/gpu_x1` on one {summary['device']} ({run['started'][:10]}, "
        f"{summary['seconds']:.0f} s; torch {versions['torch']}, transformers {versions['transformers']}, "
        f"bitsandbytes {versions['bitsandbytes']}).", "",
        gpucheck_report(summary["parts"], summary["checks"], markdown=True), "", GPU_END])


def replace_section(text: str, start: str, end: str, section: str) -> str:
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    return pattern.sub(lambda _: section, text)


def main() -> None:
    sections = {(SERIES_START, SERIES_END): series_section(),
                (FITS_START, FITS_END): "\n".join([FITS_START, fits_table(), FITS_END]),
                (SPLITS_START, SPLITS_END): "\n".join([SPLITS_START, split_fits_table(), SPLITS_END]),
                (GPU_START, GPU_END): gpu_section(), (START, END): RESULTS_POINTER,
                (DEMO_START, DEMO_END): demo_sentence()}
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    found = set()
    for page in pages:  # each generated section where its markers are: the README or a page of docs/
        text = page.read_text(encoding="utf-8")
        for (start, end), section in sections.items():
            if start in text:
                text = replace_section(text, start, end, section)
                found.add(start)
        page.write_text(text, encoding="utf-8")
    missing = [start for start, _ in sections if start not in found]
    if missing:
        raise SystemExit(f"No page has the {missing[0]} section to replace.")
    RESULTS_FILE.write_text(f"# Reference results\n\n{results_section()}\n", encoding="utf-8")
    print("The generated sections of README.md and docs/, and runs/reference/README.md, regenerated from",
          REFERENCE.relative_to(REPO_ROOT))


if __name__ == "__main__":
    main()
