"""Memory planner: predict the peak memory of one training process before running it, and say whether it fits.

    python -m my_utils plan --preset opt-350m --method qlora --rank 8 --local-batch-size 16 --max-length 128 --device T4
    python -m my_utils plan --preset gpt2 --method full --dtype bf16 --processes 4 --memory 24GiB
    python -m my_utils plan --preset opt-350m --method full --processes 8 --zero 3 --device A100-40GB
    python -m my_utils plan --preset tiny --method lora --local-batch-size 16 --max-length 64 --device cpu   # a CPU process
    python -m my_utils plan --preset opt-350m --method full --dtype bf16 --tp 2 --pp 2 --microbatches 8 --processes 2

The architecture comes from the preset's shipped ``config.json``, built on PyTorch's ``meta`` device (shapes,
no memory) for exact parameter counts (tied embeddings counted once); the LoRA parameters are counted from the
target modules' shapes. The planner knows the module layouts of the GPT-2, OPT, RoBERTa and Llama families
(``MODELLED``: LayerNorm or RMSNorm, a plain or a gated (SwiGLU) MLP, fused, separate or grouped-query attention)
and refuses, in one sentence, a model it cannot lay out rather than print a wrong number. The
peak is split into parts, each computed from a stated rule, each comparable with what a run measures from its
tensors (``compare_with_run``):

- weights: every parameter at its stored size: fp32 4 bytes (the workflows load the base model in fp32; bf16
  is autocast, which computes in bf16 from fp32 weights), NF4 (QLoRA, double quantization) 0.5 byte + 1/64
  byte of block constants, and each layer's code tables (``NF4_LAYER_BYTES``), int8 1 byte + an fp32 scale per
  output row. Quantization covers the linear layers except the output embedding; the other weights stay in fp32
  (peft's k-bit preparation), as do the adapters.
- gradients: 4 bytes per trainable parameter; with several processes DDP adds its gradient buckets, a flat
  copy of the gradients to all-reduce, as a line of their own.
- optimizer states: AdamW keeps two fp32 tensors per trainable parameter: 8 bytes per parameter.
- saved activations: what autograd keeps for the backward pass, layer by layer, from hidden size, intermediate
  size, heads, layers, sequence and batch (see ``layer_activations``), plus what the loss keeps: with the
  workflow's chunked loss (``my_utils.core.chunked_loss``) the gradients it computed in forward, of the hidden
  states and, in full fine-tuning, of the output layer's weight; with the plain loss (``--plain-loss``) the
  log-probabilities over the vocabulary. Under bf16 autocast also the bf16 weight copies the matrix products
  keep. With gradient checkpointing only each layer's input is kept.
- transient: what comes on top while the saved activations are all held: one chunk of the chunked loss's
  logits, or the plain loss's gradients over the vocabulary (and with gradient checkpointing, the one layer being
  recomputed).

With ``--zero`` the data-parallel processes shard what DDP replicates (ZeRO, as lesson 10 measures it with torch's
ZeroRedundancyOptimizer and FSDP2): stage 1 divides the optimizer states by the number of processes, stage 2 also the
gradients and the stored weights, but gathers every weight whole from forward to backward (FSDP2's
``reshard_after_forward=False``), stage 3 gathers only the unit at work: the root (embeddings, norms outside the
blocks) and one block. Over a 4-bit base (QLoRA with stage 2 or 3) FSDP2 shards the packed weights, while the
quantization constants, which bitsandbytes keeps on each module outside the parameters, stay whole in every
process (lesson 15 measures it).

With ``--tp`` and ``--pp`` each data-parallel replica is itself split, over tensor-parallel processes (Megatron's
plan, as lesson 09 trains it) and pipeline stages with micro-batches in flight (lesson 08); the plan is then the
busiest stage's process (``model_parallel``).

The sum is the planned peak of tensor memory per process (= per device: without ZeRO, data-parallel processes each
hold a full replica). On a GPU the plan adds the CUDA context (``CUDA_CONTEXT``, outside torch's counters); on a CPU
the process also holds Python, torch and the libraries (``--device cpu`` measures them here, in a fresh
process, and adds them).
"""
from my_utils.tools.planner.activations import RESIDUAL_BYTES, layer_activations
from my_utils.tools.planner.arithmetic import (ADAMW_STATE_BYTES, DTYPES, METHODS, NF4_BYTES, NF4_LAYER_BYTES,
                                               TRAINABLE_BYTES,
                                               ZERO_STAGES, Plan, estimate, shard)
from my_utils.core.pipeline import SCHEDULES, in_flight
from my_utils.tools.planner.model_parallel import split_estimate, tensor_shard
from my_utils.tools.planner.cli import main, render
from my_utils.tools.planner.fits import FITS_CARDS, FITS_PRESETS, fits_table, largest_batch, split_fits_table
from my_utils.tools.planner.layout import (ACTIVATIONS, MODELLED, Architecture, adapter_parameters, architecture,
                                           architecture_from_config, lora_modules, lora_parameters)
from my_utils.tools.planner.runs import Row, compare_with_run, plan_for_run
from my_utils.tools.planner.settings import check_adapter_modelled, check_zero, plan
from my_utils.tools.planner.runtime import (CUDA_CONTEXT, DEVICES, device_memory, measure_baseline_rss, parse_size,
                                            with_runtime)

__all__ = [
    "ACTIVATIONS",
    "RESIDUAL_BYTES",
    "layer_activations",
    "ADAMW_STATE_BYTES",
    "DTYPES",
    "METHODS",
    "NF4_BYTES",
    "NF4_LAYER_BYTES",
    "TRAINABLE_BYTES",
    "ZERO_STAGES",
    "Plan",
    "check_adapter_modelled",
    "check_zero",
    "estimate",
    "plan",
    "shard",
    "main",
    "render",
    "FITS_CARDS",
    "FITS_PRESETS",
    "fits_table",
    "largest_batch",
    "split_fits_table",
    "MODELLED",
    "Architecture",
    "adapter_parameters",
    "architecture",
    "architecture_from_config",
    "lora_modules",
    "lora_parameters",
    "Row",
    "compare_with_run",
    "plan_for_run",
    "SCHEDULES",
    "in_flight",
    "split_estimate",
    "tensor_shard",
    "CUDA_CONTEXT",
    "DEVICES",
    "device_memory",
    "measure_baseline_rss",
    "parse_size",
    "with_runtime",
]
