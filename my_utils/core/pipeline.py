"""Pipeline schedules: one stage of a model per process and a schedule over micro-batches (GPipe, 1F1B), what a
stage holds in flight, torch's multi-stage schedules as tables of actions, and timelines of who computed when (a
naive split's and a pipeline's) with their idle time. The pipeline workflow, lesson 08 and the planner use them."""

from __future__ import annotations

import time

from my_utils.core.plots import new_figure, save

SCHEDULES = ("gpipe", "1f1b")


# region: one stage per process, and a schedule
def pipeline_stage(model, n_stages: int, stage_index: int, device, example_args: tuple, example_kwargs=None):
    """This process's stage of ``model`` cut into ``n_stages`` (a ``PipelineStage``), and the split's device map.

    The cut points come from ``balanced_layer_split``; ``pipeline()`` traces the model with one micro-batch of
    example inputs (so every micro-batch must have that shape) and keeps the original parameters, so the stage
    trains the very weights of ``model``.
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    from my_utils.core.devices import balanced_layer_split

    device_map = balanced_layer_split(model, range(n_stages))
    starts = {}
    for name, stage in device_map.items():
        starts.setdefault(stage, name)
    split_spec = {starts[s]: SplitPoint.BEGINNING for s in range(1, n_stages)}
    pipe = pipeline(model, mb_args=example_args, mb_kwargs=example_kwargs or {}, split_spec=split_spec)
    return pipe.build_stage(stage_index, device), device_map


def make_schedule(name: str, stage, microbatches: int, loss_fn=None):
    """A GPipe or 1F1B schedule over ``stage`` (gradients averaged over micro-batches, as for one whole batch)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name](stage, n_microbatches=microbatches, loss_fn=loss_fn)
# endregion


def in_flight(schedule: str, stages: int, microbatches: int, stage: int) -> int:
    """Micro-batches stage ``stage`` (0 first) holds between their forward and their backward at its peak: GPipe
    runs every forward first (all M), 1F1B starts a backward as soon as one can (S - s of them, at most M). The
    planner (``my_utils.tools.planner.model_parallel``) plans pipeline memory with it."""
    return microbatches if schedule == "gpipe" else min(stages - stage, microbatches)


MULTI_STAGE_SCHEDULES = {  # torch's schedules with several stages per process, by the names their papers use
    "interleaved 1F1B": "ScheduleInterleaved1F1B", "interleaved zero bubble": "ScheduleInterleavedZeroBubble",
    "zero bubble V": "ScheduleZBVZeroBubble"}


# The zero-bubble paper's cost model: a forward, an input gradient (I) and a weight gradient (W) take one unit of time
# each, a whole backward (B = I + W) two.
ACTION_COST = {"FORWARD": 1, "BACKWARD_INPUT": 1, "BACKWARD_WEIGHT": 1, "FULL_BACKWARD": 2}


def action_table(schedule: str, processes: int, microbatches: int, stages_per_process: int = 2) -> tuple[str, float]:
    """The order of work a multi-stage schedule gives each process, as torch formats it ("2F1": stage 2's forward of
    micro-batch 1; B a backward, or I and W: a backward split into its input and weight gradients), and the share of
    the processes' time left idle. torch computes the order at construction from each stage's place alone, so
    stand-in stages (no process group, no model) are enough. The idle share reads the table as a pipeline in lock
    step: each column lasts as long as its longest action (``ACTION_COST``), and a process idles for the rest of
    it, or the whole of it when it has no action there."""
    from types import SimpleNamespace

    import torch
    from torch.distributed.pipelining import schedules

    n_stages = processes * stages_per_process
    # rank 0's stages: round robin (0, P, 2P...), or a V for the zero-bubble V schedule (0 and 2P - 1)
    mine = (0, n_stages - 1) if schedule == "zero bubble V" else range(0, n_stages, processes)
    stages = [SimpleNamespace(stage_index=i, num_stages=n_stages, group_size=processes, group_rank=0, is_first=i == 0,
                              is_last=i == n_stages - 1, submod=torch.nn.Identity()) for i in mine]
    order = getattr(schedules, MULTI_STAGE_SCHEDULES[schedule])(stages, n_microbatches=microbatches).pipeline_order
    length = max(len(actions) for actions in order.values())
    lanes = [[ACTION_COST[a.computation_type.name] if a is not None else 0 for a in actions]
             + [0] * (length - len(actions)) for actions in order.values()]
    elapsed = sum(max(column) for column in zip(*lanes))
    return schedules._format_pipeline_order(order), 1 - sum(map(sum, lanes)) / (elapsed * len(lanes))


def record_timeline(stage, events: list) -> None:
    """Append ``{kind, microbatch, start, end}`` to ``events`` each time ``stage`` computes a micro-batch's forward
    or backward (communication waits are outside these calls, so the gaps are idle time)."""
    def timed(kind, method):
        def wrapper(chunk, *args, **kwargs):
            start = time.time()  # wall clock: comparable between processes of one machine
            try:
                return method(chunk, *args, **kwargs)
            finally:
                events.append({"kind": kind, "microbatch": chunk, "start": start, "end": time.time()})

        return wrapper

    stage.forward_one_chunk = timed("forward", stage.forward_one_chunk)
    stage.backward_one_chunk = timed("backward", stage.backward_one_chunk)


def busy_fraction(events: list[dict], start: float, end: float) -> float:
    """The share of [start, end] a lane spent computing."""
    return sum(e["end"] - e["start"] for e in events) / (end - start)


def concurrent_time(lanes: dict[str, list[dict]]) -> float:
    """Seconds during which two or more lanes computed at once (0 for a naive split, > 0 for a pipeline)."""
    edges = sorted(edge for events in lanes.values() for e in events for edge in ((e["start"], 1), (e["end"], -1)))
    busy, total, previous = 0, 0.0, None
    for t, step in edges:
        if busy >= 2:
            total += t - previous
        busy, previous = busy + step, t
    return total


def naive_split_timeline(model, device_map: dict, batches) -> dict[str, list[dict]]:
    """Run ``model`` on ``batches`` and time each stage of ``device_map``: what a naive model-parallel split does
    on several devices (stage after stage, one busy at a time), measured here on one device.

    Returns ``{"stage <device>": [{kind, microbatch, start, end}, ...]}``: a forward pre-hook on a stage's first
    module starts its interval, a forward hook on its last module ends it.
    """
    import torch

    modules = dict(model.named_modules())
    stages: dict = {}
    for name, device in device_map.items():
        stages.setdefault(device, []).append(name)
    lanes = {f"stage {d}": [] for d in stages}
    current = {}
    handles = []
    for device, names in stages.items():
        lane = f"stage {device}"
        handles.append(modules[names[0]].register_forward_pre_hook(
            lambda m, a, lane=lane: current.update({lane: time.time()})))
        handles.append(modules[names[-1]].register_forward_hook(
            lambda m, a, o, lane=lane: lanes[lane].append(
                {"kind": "forward", "microbatch": current["batch"], "start": current[lane], "end": time.time()})))
    try:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                current["batch"] = i
                model(**batch)
    finally:
        for h in handles:
            h.remove()
    return lanes


def plot_timeline(lanes: dict[str, list[dict]], path, title: str):
    """A Gantt chart: one row per stage or rank, a bar per forward (blue) or backward (orange), numbered by
    micro-batch; white space is idle time."""
    t0 = min(e["start"] for events in lanes.values() for e in events)
    fig = new_figure(9, 1.0 + 0.7 * len(lanes))
    ax = fig.add_subplot()
    colors = {"forward": "C0", "backward": "C1"}
    for row, (lane, events) in enumerate(lanes.items()):
        for e in events:
            left, width = (e["start"] - t0) * 1000, (e["end"] - e["start"]) * 1000
            ax.barh(row, width, left=left, color=colors[e["kind"]], edgecolor="white")
            ax.text(left + width / 2, row, str(e["microbatch"]), ha="center", va="center", color="white",
                    fontsize="small")
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.invert_yaxis()
    ax.set(xlabel="time (ms)", title=title)
    from matplotlib.patches import Patch

    kinds = [k for k in colors if any(e["kind"] == k for events in lanes.values() for e in events)]
    ax.legend(handles=[Patch(color=colors[k], label=k) for k in kinds], loc="upper right", fontsize="small")
    return save(fig, path)


def peak_in_flight(events: list[dict]) -> int:
    """The most micro-batches a stage held at once between their forward and their backward (each one's
    activations wait in memory for its backward): GPipe holds all of them, 1F1B at most the stages after it."""
    held, peak = 0, 0
    for event in sorted(events, key=lambda e: e["start"]):
        held += 1 if event["kind"] == "forward" else -1
        peak = max(peak, held)
    return peak
