"""A results folder's records read one way whatever version of the course wrote them: the run's adapter (peft's
config), what it trained (``method``) and what tables call it (``label``), the process a per-process entry
belongs to, and the batch (per process, and global). ``compare``, the sweep and the lessons read records through
these functions.

run.json records the adapter once, as peft's resolved config and the file it came from
(``config["adapter"] == {"adapter_config": ..., "peft": {...}}``), and summary.json repeats none of it. Older folders
(the committed reference until it is regenerated) recorded LoRA's flag fields (``rank``, ``alpha``...) in run.json,
copied them into summary.json, put the table's label (``qlora-4bit``) in summary.json's ``method`` and named the
process index ``rank``; they are read here, and only here.
"""

from __future__ import annotations

from my_utils.core.adapters import LORA, LORA_KEYS, AdapterSpec, method_label

# what older summary.json files repeated of run.json's adapter, or held with another meaning (method: the label)
_REPEATED_IN_OLD_SUMMARIES = ("adapter", "peft_type", *LORA_KEYS, "targets", "method")


def adapter_of(run_info: dict) -> dict | None:
    """peft's config of the run's adapter (``peft_type``, ``r``, ``lora_alpha``, ``target_modules``...); None for a
    run that trained no adapter."""
    config = run_info.get("config") or {}
    adapter = config.get("adapter")
    if not adapter or config.get("method") == "full":
        return None
    if adapter.get("peft") is not None:
        return adapter["peft"]
    # an older run.json: LoRA's flag fields alone
    return {"peft_type": LORA, **{key: adapter[name] for name, key in LORA_KEYS.items() if name in adapter},
            "target_modules": adapter.get("targets")}


def adapter_spec_of(run_info: dict) -> AdapterSpec | None:
    """The run's adapter as the resolved ``AdapterSpec`` it trained; None for a run that trained no adapter."""
    peft = adapter_of(run_info)
    if peft is None:
        return None
    settings = lora_settings(peft)
    targets = settings.pop("targets")
    return AdapterSpec(**settings, targets=None if targets is None else tuple(targets),
                       adapter_config=adapter_file_of(run_info), peft=peft)


def adapter_file_of(run_info: dict) -> str | None:
    """The peft config file the run's adapter was read from (``--adapter-config``); None for LoRA from the flags."""
    return ((run_info.get("config") or {}).get("adapter") or {}).get("adapter_config")


def lora_settings(peft: dict | None) -> dict:
    """An adapter in the flags' vocabulary (``rank``, ``alpha``, ``dropout``, ``rslora``, ``dora``, ``targets``), as
    tables and a sweep's grids name it: read from peft's config, never recorded apart from it. A field the method
    does not have (or no adapter) is None."""
    peft = peft or {}
    targets = peft.get("target_modules")
    return {**{name: peft.get(key) for name, key in LORA_KEYS.items()},
            "targets": [targets] if isinstance(targets, str) else targets}


def method_of(run_info: dict, summary: dict | None = None) -> str | None:
    """What the run trained, as its ``--method`` says: ``lora`` (a peft adapter, whichever method its config names),
    ``full``...; None for a run that names none. What a table shows is ``label_of``."""
    config = run_info.get("config") or {}
    return config["method"] if config.get("method") else (summary or {}).get("method")


def label_of(run_info: dict, summary: dict | None = None) -> str | None:
    """The run's method as tables show it (``method_label``): full, lora, dora, ia3, qlora-4bit..."""
    method = method_of(run_info, summary)
    if method is None:
        return None
    return method_label(method, (run_info.get("config") or {}).get("quantize"), adapter_of(run_info))


def settings_of(run_info: dict) -> dict:
    """The run's settings flat, as a sweep's grids name them: its config, the adapter in the flags' vocabulary
    (``lora_settings``) with its file (``adapter_config``) and ``peft_type`` beside them."""
    config = {k: v for k, v in (run_info.get("config") or {}).items() if k != "adapter"}
    peft = adapter_of(run_info)
    return {**config, **lora_settings(peft), "adapter_config": adapter_file_of(run_info),
            "peft_type": peft["peft_type"] if peft else None}


def row_of(run_info: dict, summary: dict) -> dict:
    """One run as a flat row: its settings (``settings_of``) with its summary's figures over them, and its
    ``method`` and ``label`` as every version of the records means them."""
    figures = {k: v for k, v in summary.items() if k not in _REPEATED_IN_OLD_SUMMARIES}
    return {**settings_of(run_info), **figures, "method": method_of(run_info, summary),
            "label": label_of(run_info, summary)}


def process_of(entry: dict, default: int | None = None) -> int | None:
    """The process index of a per-process entry: summary.json's ``memory[]`` and ``first_batches[]``, a worker's
    report."""
    return entry.get("process", entry.get("rank", default))  # older records named the process index "rank"


def local_batch_of(summary: dict) -> int | None:
    """Examples per process (per model replica) per micro-batch, as the summary records it: ``local_batch_size``
    (older summaries: ``batch_size_per_process``); None where the summary has none."""
    return summary.get("local_batch_size", summary.get("batch_size_per_process"))


def global_batch_of(run_info: dict, summary: dict) -> int | None:
    """Examples per optimizer step over all processes: the summary's ``global_batch_size`` (older summaries:
    ``effective_batch``), else from the config: its ``global_batch_size``, or its per-process batch
    (``local_batch_size``, older configs ``batch_size``) x ``grad_accum`` x processes; None where neither says."""
    if recorded := summary.get("global_batch_size", summary.get("effective_batch")):
        return recorded
    config = run_info.get("config") or {}
    if isinstance(config.get("global_batch_size"), int):
        return config["global_batch_size"]
    local = config.get("local_batch_size", config.get("batch_size"))
    if isinstance(local, int):
        processes = summary.get("world_size") or run_info.get("world_size") or 1
        return local * (config.get("grad_accum") or 1) * int(processes)
    return None
