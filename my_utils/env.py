"""``python -m my_utils env``: this machine's devices, the course's library versions, and the accelerate
config that ``accelerate launch`` would use, as tables."""

from __future__ import annotations

import os
from pathlib import Path


def accelerate_default_config() -> Path | None:
    """The user-level accelerate config file, if one exists (it changes what `accelerate launch` does)."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    path = Path(os.environ.get("ACCELERATE_CONFIG_FILE", home / "accelerate" / "default_config.yaml"))
    return path if path.is_file() else None


def main(argv=None) -> None:
    import argparse

    from my_utils.compare import text_table
    from my_utils.devices import device_inventory
    from my_utils.memory import format_bytes
    from my_utils.runs import library_versions

    argparse.ArgumentParser(prog="python -m my_utils env", description=__doc__).parse_args(argv)
    devices = [[d["kind"] if d["index"] is None else f"{d['kind']}:{d['index']}", d["name"],
                str(d["cores"] or "-"), format_bytes(d["total_memory"])] for d in device_inventory()]
    print(text_table(["device", "name", "cores", "memory"], devices), end="\n\n")
    print(text_table(["library", "version"], [[k, str(v)] for k, v in library_versions().items()]), end="\n\n")
    config = accelerate_default_config()
    print(f"accelerate default config: {config or 'none (the course passes --config_file configs/...)'}")
    print(f"HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '')!s}")
