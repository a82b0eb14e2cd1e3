"""The core layer: what any training script can use, with no notion of a run.

printing (rank-prefixed), devices (device maps), memory (measuring it), presets, data, models (building them, LoRA),
evaluation, learning-rate rules, plots, the block dataset, pipeline schedules, the repository's paths. Nothing here
imports the layers above it.
"""
