"""``python -m my_utils env``: this machine's devices, the course's library versions, the accelerate config that
``accelerate launch`` would use, and the environment variables that change how runs behave, as tables.

    python -m my_utils env                              # tables
    python -m my_utils env --config configs/cpu_x2.yaml  # the settings of a shipped config instead
    python -m my_utils env --json                       # the same, as JSON (e.g. to attach to a bug report)
    python -m my_utils env --config configs/multi_node.yaml --machine-rank 1   # can this machine join machine 0?

A launch over several machines whose ``main_process_ip`` is wrong waits in torch's rendezvous for many minutes
before it fails, and no course code runs before that; ``--machine-rank`` checks the address within seconds.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import socket
from pathlib import Path

from my_utils import UserError
from my_utils.core.devices import cuda_available, device_inventory
from my_utils.core.memory import format_bytes
from my_utils.core.tables import text_table
from my_utils.run.config import OneLineParser
from my_utils.run.launch import accelerate_default_config, is_loopback
from my_utils.run.results import library_versions

# Variables that change what a launch does or what a run measures.
ENV_VARS = ("ACCELERATE_USE_CPU", "ACCELERATE_CONFIG_FILE", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
            "HF_HUB_OFFLINE", "HF_HOME", "COURSE_RUN_ROOT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
# The settings of an accelerate config that decide how many processes start, where, and in which precision.
CONFIG_KEYS = ("distributed_type", "num_processes", "num_machines", "use_cpu", "mixed_precision", "gpu_ids",
               "main_process_ip", "main_process_port", "fsdp_config", "deepspeed_config")


def read_accelerate_config(path: str | Path) -> dict:
    """The settings of an accelerate YAML (or JSON) config file."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UserError(f"Accelerate config {path} does not exist; pass one of the files in configs/.")
    try:
        settings = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError:
        raise UserError(f"Accelerate config {path} is not valid YAML; fix it or run `accelerate config`.") from None
    if not isinstance(settings, dict):
        raise UserError(f"Accelerate config {path} is not a mapping of settings; run `accelerate config` to write one.")
    return settings


def names_one_machine(ip: str) -> bool:
    """Whether ``ip`` can name the one machine that hosts a rendezvous: not unspecified (0.0.0.0, ::, which means
    any address of whichever machine reads it), broadcast (255.255.255.255) or multicast."""
    address = ipaddress.ip_address(ip.split("%")[0])
    return not (address.is_unspecified or address.is_multicast or address == ipaddress.ip_address("255.255.255.255"))


def check_rendezvous(config_path: str | Path, settings: dict, machine_rank: int, timeout_s: float = 3.0) -> str:
    """Whether this machine, as ``machine_rank``, can take part in the config's rendezvous at
    ``main_process_ip:main_process_port``: machine 0 hosts it, so the address must be one of its own and the port
    free; the other machines must reach it. Returns what was found; a problem is one sentence (UserError)."""
    machines = int(settings.get("num_machines") or 1)
    if machines < 2:
        raise UserError(f"{config_path} is a config for one machine; --machine-rank checks configs of several "
                        "(num_machines: 2 or more), such as configs/multi_node.yaml.")
    if not 0 <= machine_rank < machines:
        raise UserError(f"--machine-rank must be from 0 to {machines - 1} for the {machines} machines of "
                        f"{config_path}, got {machine_rank}.")
    host, port = settings.get("main_process_ip"), int(settings.get("main_process_port") or 29500)
    if not host:
        raise UserError(f"{config_path} sets no main_process_ip; set it to the address of machine 0.")
    try:
        address = socket.getaddrinfo(str(host), port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError):
        raise UserError(f"main_process_ip {host} in {config_path} is not an address (it does not resolve); set it "
                        "to the address of machine 0 (`hostname -I` there lists them).") from None
    family, _, _, _, (ip, *_) = address
    if not names_one_machine(ip):
        raise UserError(f"main_process_ip {host} in {config_path} is an unspecified, broadcast or multicast address, "
                        "which names no one machine to meet at; set it to machine 0's network address (`hostname -I` "
                        "there lists them).")
    if machine_rank > 0 and is_loopback(ip):
        raise UserError(f"main_process_ip {host} in {config_path} is a loopback address, which every machine takes for "
                        "itself: machine 0 cannot be reached there from another; set it to machine 0's network "
                        "address (`hostname -I` there lists them).")
    if machine_rank == 0:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((ip, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise UserError(f"Port {port} is in use on this machine; set main_process_port in {config_path} "
                                    "to a free port, on every machine.") from None
                raise UserError(f"main_process_ip {host} in {config_path} is not an address of this machine, yet "
                                "machine 0 hosts the rendezvous there; set it to this machine's address (`hostname "
                                "-I` lists them), or pass this machine's own --machine-rank.") from None
        return f"rendezvous: this machine (0) can host it at {host}:{port}"
    try:
        socket.create_connection((ip, port), timeout=timeout_s).close()
        return f"rendezvous: machine 0 answers at {host}:{port}"
    except ConnectionRefusedError:
        return (f"rendezvous: {host} answers but nothing listens on port {port} yet; the launch on this machine "
                "will wait until machine 0's starts")
    except OSError:
        raise UserError(f"Machine 0 at {host}:{port} (main_process_ip in {config_path}) cannot be reached from this "
                        f"machine within {timeout_s:g} s; set its address as this machine sees it, and open the "
                        "port between the machines.") from None


def torch_build() -> dict:
    """What torch was built for: its CUDA version (None on a CPU build) and whether bf16 runs on the GPU."""
    import torch

    build = {"torch cuda": torch.version.cuda, "cudnn": None, "bf16 on GPU": None}
    if cuda_available():
        build["cudnn"] = torch.backends.cudnn.version()
        build["bf16 on GPU"] = torch.cuda.is_bf16_supported()
    return build


def environment(config_file: str | Path | None = None) -> dict:
    """Everything the command shows, as plain data."""
    config_path = Path(config_file) if config_file else accelerate_default_config()
    return {
        "devices": device_inventory(),
        "versions": library_versions(),
        "torch_build": torch_build(),
        "accelerate_config": {"path": str(config_path) if config_path else None,
                              "settings": read_accelerate_config(config_path) if config_path else None},
        "environment": {k: os.environ.get(k) for k in ENV_VARS},
    }


def render(env: dict) -> str:
    devices = [[d["kind"] if d["index"] is None else f"{d['kind']}:{d['index']}", d["name"], str(d["cores"] or "-"),
                format_bytes(d["total_memory"])] for d in env["devices"]]
    build = env["torch_build"]
    versions = [[k, str(v)] for k, v in env["versions"].items()]
    versions.append(["torch build", f"CUDA {build['torch cuda']}" if build["torch cuda"] else "CPU only"])
    versions += [[k, str(v)] for k, v in build.items() if k != "torch cuda" and v is not None]
    config = env["accelerate_config"]
    if config["path"]:
        settings = config["settings"]
        rows = [[k, json.dumps(settings[k]) if isinstance(settings[k], (dict, list)) else str(settings[k])]
                for k in CONFIG_KEYS if k in settings]
        config_text = f"accelerate config: {config['path']}\n" + text_table(["setting", "value"], rows)
    else:
        config_text = ("accelerate config: none (no default config file; the course passes --config_file "
                       "configs/...)")
    variables = [[k, v] for k, v in env["environment"].items() if v is not None]
    variables_text = (text_table(["variable", "value"], variables) if variables
                      else "environment variables: none of " + ", ".join(ENV_VARS) + " is set")
    return "\n\n".join([text_table(["device", "name", "cores", "memory"], devices),
                        text_table(["library", "version"], versions), config_text, variables_text,
                        *filter(None, [env.get("rendezvous")])])


def main(argv=None) -> None:
    import argparse

    p = OneLineParser(prog="python -m my_utils env", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="show this accelerate config file instead of the default one")
    p.add_argument("--machine-rank", type=int, help="with a config of several machines: check within seconds that "
                   "this machine, as this rank, can host (0) or reach (others) the rendezvous at main_process_ip")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = p.parse_args(argv)
    if args.machine_rank is not None and not args.config:
        raise UserError("--machine-rank checks a config of several machines; pass it with --config, e.g. --config "
                        "configs/multi_node.yaml.")
    env = environment(args.config)
    if args.machine_rank is not None:
        env["rendezvous"] = check_rendezvous(args.config, env["accelerate_config"]["settings"], args.machine_rank)
    print(json.dumps(env, indent=2, default=str) if args.json else render(env))
