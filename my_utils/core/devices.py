"""Which devices this machine has, and where each process should put its model.

    python -m my_utils env            # prints the inventory as a table

``per_rank_device_map`` is the DDP rule: every process holds a whole copy of the model on the device of
its *local* rank (the rank within its machine, so that it is right on several machines too).
``device_map="auto"`` spreads one model over all devices and must not be used with several processes.
"""

from __future__ import annotations

import os
import platform

from my_utils import UserError


def cuda_available() -> bool:
    """True when CUDA devices exist. Safe before ``notebook_launcher``: it does not create a CUDA context."""
    import torch

    return torch.cuda.is_available()


def fast_bf16() -> bool:
    """True when bf16 mixed precision trains faster than fp32 on the training device: a CUDA GPU that supports
    bf16, or a CPU with AMX, its bf16 matrix unit. A CPU with AVX-512 BF16 alone computes bf16 natively but
    trains slower: on the reference machine the tiny model's LoRA trained at 0.61 of fp32's useful tokens/s
    (``python -m my_utils bench precision``), autocast's casts and the upcast attention costing more than its
    dot products save. On a GPU this initialises CUDA: ask inside the launched worker, as the workflows do."""
    import torch

    if cuda_available():
        return torch.cuda.is_bf16_supported()
    return getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()  # private in torch 2.x; missing: no


def device_kind() -> str:
    """'cuda' when GPUs are present, else 'cpu' (used in run-folder names)."""
    return "cuda" if cuda_available() else "cpu"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """CPU cores this process may run on (respects affinity masks and container limits where visible)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def device_inventory() -> list[dict]:
    """One dict per device: kind, index, name, total memory in bytes (CPU: system memory and core count)."""
    import psutil

    devices = [
        {
            "kind": "cpu",
            "index": None,
            "name": cpu_name(),
            "cores": usable_cores(),
            "total_memory": psutil.virtual_memory().total,
        }
    ]
    if cuda_available():
        import torch

        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append(
                {"kind": "cuda", "index": i, "name": props.name, "cores": None, "total_memory": props.total_memory}
            )
    return devices


def local_rank() -> int:
    """This process's rank within its machine (LOCAL_RANK from the launcher; 0 when not launched)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def per_rank_device(rank: int | None = None) -> str:
    """The device string for one process: 'cuda:<local rank>' on GPUs, 'cpu' otherwise."""
    rank = local_rank() if rank is None else rank
    return f"cuda:{rank}" if cuda_available() else "cpu"


def per_rank_device_map(rank: int | None = None) -> dict:
    """A ``device_map`` that puts the whole model on this process's device: ``{"": "cuda:<local rank>"}``.

    Use it with ``from_pretrained(..., device_map=per_rank_device_map())`` under DDP, and for QLoRA, whose
    quantized weights must be placed at load time.
    """
    return {"": per_rank_device(rank)}


def check_device_map(device_map, world_size: int) -> None:
    """Refuse ``device_map="auto"`` (or any map over several devices) when several processes train."""
    if world_size > 1 and (device_map == "auto" or (isinstance(device_map, dict) and len(set(device_map.values())) > 1)):
        raise UserError(
            f'device_map={device_map!r} spreads one model over several devices, which cannot be combined with '
            f"{world_size} data-parallel processes; use my_utils.core.devices.per_rank_device_map() instead."
        )


def meta_model(config):
    """The model a transformers config (or a folder with a config.json) describes, built on PyTorch's meta
    device: every module and parameter shape, no memory, so a 7B model costs nothing."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModel

    if isinstance(config, (str, os.PathLike)):
        config = AutoConfig.from_pretrained(config)
    architecture = getattr(transformers, (config.architectures or ["AutoModel"])[0], AutoModel)
    with torch.device("meta"):
        return architecture.from_config(config) if architecture is AutoModel else architecture(config)


def layer_stack(model) -> tuple[str, list]:
    """The model's stack of repeated blocks, as (name, blocks): the ModuleList holding the most parameters
    (``transformer.h`` in GPT-2, ``model.decoder.layers`` in OPT, ``roberta.encoder.layer`` in RoBERTa)."""
    import torch

    stacks = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    if not stacks:
        raise UserError(f"{type(model).__name__} has no stack of repeated layers to split; pass a transformer model.")
    name, blocks = max(stacks, key=lambda s: sum(p.numel() for p in s[1].parameters()))
    return name, list(blocks)


def _contiguous_partition(costs: list[int], parts: int) -> list[int]:
    """Sizes of ``parts`` non-empty contiguous groups of ``costs`` that are as even as possible: the smallest sum
    of squared group totals (a dynamic programme over where each group ends)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest sum of squares when the first i costs form k groups; start[k][i]: where the last begins
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    start = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = best[k - 1][j] + (prefix[i] - prefix[j]) ** 2
                if value < best[k][i]:
                    best[k][i], start[k][i] = value, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        sizes.append(i - start[k][i])
        i = start[k][i]
    return sizes[::-1]


def balanced_layer_split(model_or_config, devices) -> dict:
    """A ``device_map`` that cuts a model into ``len(devices)`` consecutive stages holding about equal numbers of
    parameters: what a naive model-parallel split (``from_pretrained(..., device_map=...)``) or a pipeline needs.

    ``model_or_config``: a model, a transformers config, or a folder with a config.json (built on the meta device,
    so a 7B model costs nothing). ``devices``: one entry per stage, e.g. ``["cuda:0", "cuda:1"]`` or ``[0, 1]``.
    Everything registered before the layer stack (embeddings) goes with the first stage, everything after it
    (final norm, head) with the last; a weight shared by two modules (tied embeddings) is counted once, where it
    first appears. Returns ``{module name: device}`` in execution order.
    """
    import torch

    devices = list(devices)
    model = model_or_config if isinstance(model_or_config, torch.nn.Module) else meta_model(model_or_config)
    stack_name, blocks = layer_stack(model)
    if not devices or len(devices) > len(blocks):
        raise UserError(
            f"Cannot split {len(blocks)} layers over {len(devices)} devices; give between 1 and {len(blocks)} devices."
        )
    seen = set()

    def cost(module) -> int:
        # unique parameters only: a tied weight belongs to the first module that holds it
        fresh = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        return sum(p.numel() for p in fresh)

    # Walk from the root down to the stack: siblings registered before the path go first, those after go last.
    before, after = [], []
    parent, parts = model, stack_name.split(".")
    for depth, part in enumerate(parts):
        prefix = ".".join(parts[:depth])
        names = [n for n, _ in parent.named_children()]
        for n in names[: names.index(part)]:
            before.append(f"{prefix}.{n}" if prefix else n)
        for n in names[names.index(part) + 1 :]:
            after.insert(0, f"{prefix}.{n}" if prefix else n)  # outer levels run after inner ones
        parent = getattr(parent, part)
    modules = dict(model.named_modules())
    before_cost = sum(cost(modules[n]) for n in before)
    block_costs = [cost(b) for b in blocks]
    after_cost = sum(cost(modules[n]) for n in after)
    costs = block_costs.copy()
    costs[0] += before_cost
    costs[-1] += after_cost
    sizes = _contiguous_partition(costs, len(devices))

    device_map = {n: devices[0] for n in before}
    index = 0
    for device, size in zip(devices, sizes):
        for _ in range(size):
            device_map[f"{stack_name}.{index}"] = device
            index += 1
    device_map.update({n: devices[-1] for n in after})
    return device_map


def parameters_per_device(model, device_map: dict) -> dict:
    """How many parameters each device of ``device_map`` holds (a tied weight counted once)."""
    modules = dict(model.named_modules())
    counts, seen = {}, set()
    for name, device in device_map.items():
        fresh = [p for p in modules[name].parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        counts[device] = counts.get(device, 0) + sum(p.numel() for p in fresh)
    return counts


def compiler_missing() -> str | None:
    """Why ``torch.compile`` cannot build code for this machine's CPU (no C++ compiler, which Inductor needs there),
    or None when it can."""
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as e:  # torch raises its own error with the compilers it looked for
        return f"torch.compile needs a C++ compiler on a CPU ({str(e).strip().splitlines()[0]}); install g++ or clang"
    return None
