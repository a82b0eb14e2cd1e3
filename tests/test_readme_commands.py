"""Every command the README shows still names a module, flags, values, presets and configs that exist, so the
README cannot rot: workflows' command lines are parsed (nothing trains), the planner and ``env`` run for real, the
long-running tools (demo, sweep, bench) have their options parsed, and the configs named exist. The CPU launches
themselves run in tests/test_configs.py."""

import re
import shlex
from importlib import import_module

import pytest

from my_utils.run.results import REPO_ROOT

LAUNCHERS = ("accelerate launch", "torchrun", "python -m my_utils")


def readme_commands() -> list[str]:
    """The commands of the README's bash blocks and of its inline code that starts with a launcher."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    lines = [line.split("  #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.splitlines() if line.strip() and not line.startswith("#")]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    inline = [" ".join(code.split()) for code in re.findall(r"`([^`]+)`", prose)]
    return [c for c in dict.fromkeys(lines + inline)
            if re.sub(r"^(\w+=\S+ )+", "", c).startswith(LAUNCHERS) and " -m " in c]


def split(command: str) -> tuple[str, list[str], list[str]]:
    """(the module that runs, its arguments, the launcher's arguments)."""
    words = [w for w in shlex.split(command) if not re.fullmatch(r"[A-Z_]+=\S*", w)]
    if words[:3] == ["python", "-m", "my_utils"]:
        return "my_utils", words[3:], []
    at = words.index("-m")
    return words[at + 1], words[at + 2:], words[:at]


COMMANDS = readme_commands()


def test_the_readme_shows_commands_of_every_kind():
    kinds = {split(c)[0] for c in COMMANDS}
    assert {"my_utils", "my_utils.workflows.lora", "my_utils.workflows.ddp", "my_utils.workflows.sharding"} <= kinds
    assert len(COMMANDS) >= 15


@pytest.mark.parametrize("command", COMMANDS)
def test_every_readme_command_names_what_exists(command, tmp_path, monkeypatch):
    from my_utils.core.presets import get_preset

    module, args, launcher = split(command)
    for i, word in enumerate(launcher):
        if word == "--config_file":
            assert (REPO_ROOT / launcher[i + 1]).is_file(), f"{command}: no config {launcher[i + 1]}"
    if module != "my_utils":  # a workflow: its command line parses and names a known preset
        cfg = import_module(module).parse_args(args) if hasattr(import_module(module), "parse_args") else \
            import_module("my_utils.workflows.accelerate_steps.common").parse_args(args, prog=module)
        get_preset(cfg.preset)
        return
    tool, options = args[0], args[1:]
    monkeypatch.chdir(tmp_path)  # nothing a tool writes lands in the checkout
    if tool in ("plan", "env"):  # fast: run them as shown
        import_module("my_utils.__main__").main(args)
    elif tool == "sweep":
        import_module("my_utils.tools.sweep").parse_args(options)
    elif tool == "bench":
        if options[:1] == ["run-qlora"] or "--help" in options:
            assert options[0] in import_module("my_utils.tools.bench").workers() or "--help" in options
        else:
            import_module("my_utils.tools.bench").parse_args(options)
    else:  # demo, compare: the command exists and its options are known to its --help
        with pytest.raises(SystemExit) as e:
            import_module("my_utils.__main__").main([tool, "--help"])
        assert e.value.code == 0
