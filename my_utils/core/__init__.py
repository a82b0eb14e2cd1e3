"""The core layer: what any training script can use, with no notion of a run.

printing (rank-prefixed), devices (device maps), memory (measuring it), presets, data, models (building them, LoRA),
evaluation, learning-rate rules, plots. Nothing here imports the run or tools layers.
"""
