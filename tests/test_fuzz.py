"""Hostile input, generated (Hypothesis): the options of the LoRA workflow and the planner, sweep specs, data files and
results folders, drawn at random around the edges (zero, negative, huge, not a number, empty, unicode, paths into
results folders, files where folders belong). Every time the contract holds: the input is accepted, or refused with
one sentence (exit code 2 from the command line), never with a traceback; and nothing outside a fresh folder is
written, renamed or changed."""

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from my_utils import UserError
from my_utils.core.presets import PRESETS
from my_utils.run.results import Run

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
NUMBERS = st.one_of(st.sampled_from(["0", "-1", "1e309", "nan", "inf", "-inf", "1e-300", "99999999999", "0x10", "",
                                     "  3", "2.5", "True"]),
                    st.integers(-10**12, 10**12).map(str), st.floats(allow_nan=True).map(repr))
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A folder with what a user has around: a finished run, a crashed one, a folder inside a run, a plain file, a
    folder of their own with a file in it."""
    root = tmp_path_factory.mktemp("world")
    done = Run.create(root / "done", config={"seed": 0})
    done.finish({"loss": 1.0})
    Run.create(root / "crashed", config={"seed": 0}).fail("crashed")
    (root / "crashed" / "inside").mkdir()
    (root / "plain.txt").write_text("mine")
    (root / "mine").mkdir()
    (root / "mine" / "keep.txt").write_text("mine")
    return root


def snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def paths(root: Path):
    return st.sampled_from(["done", "crashed", "crashed/inside", "crashed/inside/new", "plain.txt", "mine",
                            "mine/keep.txt", "fresh", "", ".", "/", "/dev/null", "x" * 300]).map(
        lambda p: p if p.startswith("/") or not p else str(root / p))


def one_sentence(message: str) -> None:
    """One line, ending with a full stop, no traceback."""
    assert "\n" not in message.strip() and "Traceback" not in message, message
    assert message.strip().endswith("."), message


def outcome(call, capsys) -> None:
    """``call()`` accepted the input, or refused it as the contract says (UserError, or exit 2 with one line)."""
    try:
        call()
    except UserError as e:
        one_sentence(str(e))
    except SystemExit as e:
        assert e.code in (0, 2), e.code
        said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(said) == 1 and "error: " in said[0], said
        one_sentence(said[0])


LORA_FLAGS = ["--rank", "--alpha", "--dropout", "--local-batch-size", "--max-steps", "--max-length", "--learning-rate",
              "--seed", "--eval-rows", "--timeout-s", "--grad-accum", "--logging-steps", "--save-steps",
              "--max-new-tokens", "--targets"]


@SETTINGS
@given(data=st.data())
def test_the_lora_workflows_options(world, capsys, data):
    from my_utils.workflows.lora import parse_args, validate

    argv = []
    for flag in data.draw(st.lists(st.sampled_from(LORA_FLAGS), max_size=4, unique=True)):
        argv += [flag, data.draw(st.one_of(NUMBERS, TEXT))]
    if data.draw(st.booleans()):
        argv += ["--output-dir", data.draw(paths(world))]
    if data.draw(st.booleans()):
        argv += ["--data-file", data.draw(paths(world))]
    argv += ["--resume"] if data.draw(st.booleans()) else []
    before = snapshot(world)
    outcome(lambda: validate(parse_args(argv)), capsys)
    assert snapshot(world) == before, argv


@SETTINGS
@given(data=st.data())
def test_the_planners_options(world, capsys, data):
    from my_utils.tools import planner

    argv = ["--preset", data.draw(st.sampled_from([*PRESETS, "tinyy", ""]))]
    for flag in data.draw(st.lists(st.sampled_from(["--rank", "--local-batch-size", "--max-length", "--processes", "--zero",
                                                    "--memory", "--alpha", "--dropout"]), max_size=3, unique=True)):
        argv += [flag, data.draw(NUMBERS)]
    argv += ["--method", data.draw(st.sampled_from(["full", "lora", "qlora", "qlora-8bit", "dora", ""]))]
    argv += ["--quantize", data.draw(st.sampled_from(["4bit", "8bit"]))] if data.draw(st.booleans()) else []
    argv += ["--device", data.draw(st.sampled_from(["T4", "H100", "K80", "t4"]))] if data.draw(st.booleans()) else []
    before = snapshot(world)
    outcome(lambda: planner.main(argv), capsys)
    assert snapshot(world) == before, argv


JSON_VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 10**9), st.floats(), TEXT),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8)


@SETTINGS
@given(spec=st.one_of(JSON_VALUES, st.fixed_dictionaries({}, optional={
    "preset": st.one_of(st.sampled_from(["tiny", "gpt2"]), JSON_VALUES),
    "args": st.one_of(st.fixed_dictionaries({}, optional={"max_steps": JSON_VALUES, "rank": JSON_VALUES}), JSON_VALUES),
    "grids": st.one_of(st.lists(st.dictionaries(st.sampled_from(["rank", "alpha", "learning_rate", "targets", "seed",
                                                                 "data_file", "ranks"]),
                                                st.lists(JSON_VALUES, max_size=3), max_size=3), max_size=2),
                       JSON_VALUES),
    "num_processes": JSON_VALUES})))
def test_sweep_specs(tmp_path_factory, capsys, spec):
    from my_utils.tools import sweep

    path = tmp_path_factory.mktemp("spec") / "sweep.json"
    path.write_text(json.dumps(spec, allow_nan=True))
    outcome(lambda: sweep.SweepSpec(**sweep.read_spec(path)), capsys)


@SETTINGS
@given(content=st.one_of(st.binary(max_size=200), st.lists(JSON_VALUES, max_size=4).map(
    lambda rows: "\n".join(json.dumps(r, allow_nan=True) for r in rows).encode())))
def test_data_files(tmp_path_factory, capsys, content):
    from my_utils.core.data import INSTRUCTION_COLUMNS, check_text_columns, read_jsonl

    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_bytes(content)
    outcome(lambda: check_text_columns(read_jsonl(path, INSTRUCTION_COLUMNS), INSTRUCTION_COLUMNS, path), capsys)


@SETTINGS
@given(run=st.dictionaries(st.sampled_from(["status", "config", "world_size", "pid", "host", "versions", "commit"]),
                           JSON_VALUES),
       summary=st.one_of(JSON_VALUES, st.dictionaries(st.sampled_from(["samples_per_s", "eval_loss", "memory",
                                                                      "world_size", "tokens_per_s", "method"]),
                                                      JSON_VALUES)))
@example(run={}, summary={"memory": True})  # found by this test: a memory that is not a list stopped compare
def test_results_folders_that_compare_reads(tmp_path_factory, capsys, run, summary):
    """A results folder written by hand, cut short or from another version: compare reads it or leaves it out in a
    line; the folder is never changed."""
    from my_utils.tools.compare import overview

    root = tmp_path_factory.mktemp("runs")
    folder = root / "odd"
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps(run, allow_nan=True))
    (folder / "summary.json").write_text(json.dumps(summary, allow_nan=True))
    before = snapshot(root)
    outcome(lambda: overview(root, root=root), capsys)
    assert snapshot(root) == before

