"""Lesson 15's FSDP2 with QLoRA: the preset's base quantized to 4-bit NF4 by bitsandbytes, LoRA on top, the whole
sharded over N processes by ``fully_shard``; trained against the same model unsharded in every process, on the same
global batches (``reshard.parts`` and ``reshard.step``). Rank 0 writes ``<out>/sharded_qlora.json``:

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m my_utils.lessons.sharded_qlora --preset tiny --out runs/q

The packed 4-bit weights stay in bitsandbytes' uint8 storage: FSDP2 shards each parameter by itself, so, unlike
FSDP1's flat buffers, it does not need them stored as bf16 (``bnb_4bit_quant_storage``). The file also counts how
many of those packed words would read as bf16 NaNs if they were, and how many a cast would change (``as_bf16``).
"""

from __future__ import annotations

import json
from pathlib import Path

STEPS = 3


def qlora_model(preset):
    """The preset's base in 4-bit NF4 on this process's device, with the course's LoRA adapter (seeded)."""
    import torch

    from my_utils.core.adapters import AdapterSpec
    from my_utils.core.devices import per_rank_device, per_rank_device_map
    from my_utils.core.models import add_adapter, build_causal_lm

    model = build_causal_lm(preset, quantize="4bit", device_map=per_rank_device_map())
    torch.manual_seed(0)
    model = add_adapter(model, AdapterSpec().resolved(preset.lora_targets))
    return model.to(per_rank_device())


def packed_weights(model) -> list:
    """The packed 4-bit storage of each quantized layer (two NF4 codes per byte)."""
    import bitsandbytes as bnb

    return [module.weight for module in model.modules() if isinstance(module, bnb.nn.Linear4bit)]


def packed_as_bf16(model) -> dict:
    """The packed 4-bit words (two bytes, four NF4 codes each) read as bf16, as a bf16 storage would hold them: the
    share that are NaNs, and the share that a round trip through float32 (any cast) changes."""
    import torch

    words = torch.cat([w.data.flatten() for w in packed_weights(model)])
    as_bf16 = words[:words.numel() // 2 * 2].view(torch.bfloat16)
    round_trip = as_bf16.float().to(torch.bfloat16)
    return {"nan_share": torch.isnan(as_bf16).float().mean().item(),
            "changed_by_a_cast": (round_trip.view(torch.int16) != as_bf16.view(torch.int16)).float().mean().item(),
            "words": as_bf16.numel()}


def frozen_bytes(model) -> int:
    """The bytes of the frozen base this process holds: its shards where sharded, else the whole."""
    from my_utils.workflows.sharding import local_bytes

    return local_bytes(p for p in model.parameters() if not p.requires_grad)


def weight_bytes(model) -> int:
    """Every weight this process holds, as the planner counts weights: the parameters (their shards where
    sharded) and the quantization constants, which bitsandbytes keeps on each 4-bit module (absmax, and with
    double quantization its own absmax and code tables): outside the parameters, so never sharded."""
    import bitsandbytes as bnb

    from my_utils.workflows.sharding import local_bytes

    constants = []
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = module.quant_state
            constants += [state.absmax, state.code]
            if state.nested:
                constants += [state.state2.absmax, state.state2.code]
    return local_bytes(model.parameters()) + local_bytes(constants)


def shard(model) -> None:
    """FSDP2 over the quantized base and its adapter: each block a unit, the rest (embeddings, norm) the root's."""
    from torch.distributed.fsdp import fully_shard

    from my_utils.core.devices import layer_stack

    for block in layer_stack(model)[1]:
        fully_shard(block)
    fully_shard(model)


def compare(preset_name: str, out: Path) -> dict:
    """Run under torchrun: the unsharded QLoRA model and the sharded one train ``STEPS`` steps on the same global
    batches; rank 0 writes both loss curves, the bytes of the base per process and whole, and the NaN share."""
    import torch
    import torch.distributed as dist

    from my_utils.core.blocks import block_dataset
    from my_utils.core.presets import get_preset
    from my_utils.lessons.reshard import LR, parts, step
    from my_utils.run.launch import check_world_size

    world = check_world_size()
    rank = dist.get_rank()
    preset = get_preset(preset_name)
    dataset = block_dataset(preset, 64)

    # unsharded: every process trains its own copy on the whole batch, in the ranks' parts (the same losses
    # everywhere, so step's average over the processes leaves them as they are)
    whole = qlora_model(preset)
    optimizer = torch.optim.AdamW([p for p in whole.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    unsharded = [step(whole, optimizer, parts(dataset, n, world)) for n in range(1, STEPS + 1)]

    sharded_model = qlora_model(preset)
    shard(sharded_model)
    optimizer = torch.optim.AdamW([p for p in sharded_model.parameters() if p.requires_grad], lr=LR,
                                  weight_decay=0.0)
    sharded = [step(sharded_model, optimizer, parts(dataset, n, world)[rank:rank + 1]) for n in range(1, STEPS + 1)]
    largest = torch.tensor([float(frozen_bytes(sharded_model)), float(weight_bytes(sharded_model))])
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # the process that holds most
    result = {"world_size": world, "unsharded": unsharded, "sharded": sharded, "base_bytes": frozen_bytes(whole),
              "base_bytes_per_process": int(largest[0]),
              "weight_bytes_per_process": int(largest[1]), "as_bf16": packed_as_bf16(whole),
              "packed_dtype": str(packed_weights(whole)[0].dtype)}
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sharded_qlora.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv=None) -> None:
    from my_utils.lessons.reshard import worker_main

    worker_main(compare, "my_utils.lessons.sharded_qlora", __doc__, argv)


if __name__ == "__main__":
    main()
