"""The README and the pages of docs/ cannot rot: every command they show names a module, flags, values, presets and
configs that exist (workflows' command lines are parsed, the planner and ``env`` run for real, the long-running
tools' options are parsed), and every shell line that runs on a CPU (``--preset tiny``) runs as written, in each
page's order, from a copy of the repository, with ``--max-steps 2`` added to keep it short. Their hand-written lines
stay readable (160 characters at most), and every page of docs/ is linked from the README."""

import re
import shlex
from importlib import import_module
from pathlib import Path

import pytest

from my_utils.core.paths import REPO_ROOT

LAUNCHERS = ("accelerate launch", "torchrun", "python -m my_utils")
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
GENERATED = re.compile(r"<!-- (\w+):start -->.*?<!-- \1:end -->", re.S)  # sections scripts/update_readme.py writes


def pages_text() -> str:
    return "\n".join(page.read_text(encoding="utf-8") for page in PAGES)


def readme_shell_lines() -> list[str]:
    """The lines of the bash blocks of the README and docs/, in order, without comments."""
    text = pages_text().replace("\\\n", " ")  # a line continued with a backslash is one line
    return [line.split("  #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
            for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


def readme_commands() -> list[str]:
    """The commands of the README's bash blocks (each side of ``&&``) and of its inline code that starts with a
    launcher."""
    text = pages_text()
    lines = [command for line in readme_shell_lines() for command in line.split(" && ")]
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


def test_every_page_of_docs_is_linked_from_the_readme_and_its_lines_are_readable():
    readme = PAGES[0].read_text(encoding="utf-8")
    assert [p for p in PAGES[1:] if f"](docs/{p.name})" not in readme] == [] and len(PAGES) >= 5
    for page in PAGES:
        written = GENERATED.sub("", page.read_text(encoding="utf-8"))
        long = [line[:60] for line in written.splitlines() if len(line) > 160]
        assert long == [], f"{page.name}: lines over 160 characters: {long}"


README_BYTES = 10_240  # the README is the front page: a quick start and the tables; detail lives in docs/


def test_the_readme_stays_short():
    size = len(PAGES[0].read_bytes())
    assert size <= README_BYTES, f"README.md is {size:,} bytes, over {README_BYTES:,}: move detail to a page of docs/"


def test_every_script_the_pages_name_exists_and_its_help_answers():
    import importlib.util
    import inspect

    named = sorted(set(re.findall(r"python (scripts/\w+\.py)", pages_text())))
    assert {"scripts/update_readme.py", "scripts/check_colossalai_pins.py", "scripts/screenshot_lesson.py"} <= set(named)
    for path in named:
        spec = importlib.util.spec_from_file_location(Path(path).stem, REPO_ROOT / path)
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        if inspect.signature(script.main).parameters:  # a command line of its own: --help says what it does
            with pytest.raises(SystemExit) as e:
                script.main(["--help"])
            assert e.value.code == 0, path


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
        cfg = import_module(module).parse_args(args)
        get_preset(cfg.preset)
        return
    tool, options = args[0], args[1:]
    monkeypatch.chdir(tmp_path)  # nothing a tool writes lands in the checkout
    if "--machine-rank" in options:  # stops at the shipped placeholder address: the test below
        assert (REPO_ROOT / options[options.index("--config") + 1]).is_file()
    elif tool in ("plan", "env"):  # fast: run them as shown
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


# ------------------------------------------------------------------------------ the CPU lines, run as written

def processes_asked(line: str) -> int:
    """How many processes a shell line starts: torchrun's --nproc_per_node, the config's num_processes, else 1."""
    words = shlex.split(line)
    if "--nproc_per_node" in words:
        return int(words[words.index("--nproc_per_node") + 1])
    if "--config_file" in words:
        import yaml

        return yaml.safe_load((REPO_ROOT / words[words.index("--config_file") + 1]).read_text())["num_processes"]
    return 1


@pytest.fixture
def repository_copy(tmp_path):
    """The package and the configs copied, the assets linked: the README's commands run from its root and
    write their default results folders under its runs/, not the checkout's."""
    import shutil

    copy = tmp_path / "repository"
    copy.mkdir()
    shutil.copytree(REPO_ROOT / "my_utils", copy / "my_utils", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO_ROOT / "configs", copy / "configs")
    (copy / "assets").symlink_to(REPO_ROOT / "assets")
    return copy


@pytest.mark.slow
def test_the_readme_cpu_lines_run_as_written(repository_copy, subprocess_env):
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in subprocess_env.items() if k not in ("ACCELERATE_USE_CPU", "PYTHONPATH")}
    env["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{env['PATH']}"  # python, accelerate, torchrun
    lines = [line for line in readme_shell_lines() if "--preset tiny" in line]
    assert len(lines) >= 8, lines  # the CPU launches and the resume block
    seen = set()
    for line in lines:
        proc = subprocess.run(f"{line} --max-steps 2", shell=True, env=env, cwd=repository_copy,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{line}\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr, f"{line}\n{proc.stderr[-3000:]}"
        runs = {p.parent for p in (repository_copy / "runs").rglob("run.json")} - seen
        if "--resume" in line:  # the run it resumes finished: one sentence, exit 0, nothing new
            assert not runs and proc.stderr.count("is already complete; there is nothing to resume") == 1, line
            continue
        assert len(runs) == 1, f"{line}: one new results folder expected, found {sorted(runs)}"
        info = json.loads((runs.pop() / "run.json").read_text())
        assert info["status"] == "complete" and info["world_size"] == processes_asked(line), (line, info)
        seen = {p.parent for p in (repository_copy / "runs").rglob("run.json")}
    for workers in (repository_copy / "runs").rglob("workers"):  # what every worker saw: the run's world, every rank
        world = json.loads((workers.parent / "run.json").read_text())["world_size"]
        assert sorted(json.loads(p.read_text())["world_size"] for p in workers.glob("rank_*.json")) == [world] * world


@pytest.mark.slow
def test_the_readme_multi_node_line_stops_at_the_shipped_placeholder_in_seconds(subprocess_env):
    import subprocess
    import sys

    (line,) = [line for line in readme_shell_lines() if "multi_node.yaml" in line]
    check = line.split(" && ")[0]
    assert check.startswith("python -m my_utils env") and "--machine-rank 0" in check
    proc = subprocess.run([sys.executable, *check.split()[1:]], env=subprocess_env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "is not an address of this machine" in lines[0], proc.stderr
