"""The benchmarks: every module found, their command line, the FLOP count behind MFU (checked against the planner's independent
count of the same architecture), the table, and (slow) a quick run of two benchmarks that must leave complete
results folders with every ratio and its baseline. No timing thresholds here: speed targets are the benchmarks'
own business, measured side by side in one run."""

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from my_utils import UserError
from my_utils.tools import bench
from my_utils.core.paths import REPO_ROOT


@pytest.mark.slow
def test_every_benchmark_module_is_found_and_listed(subprocess_env):
    # The names are read from the files, not through the harness: a module it failed to find would be missing from
    # its list and from --help alike.
    declared = set()
    for path in Path(bench.__file__).parent.glob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NAME" for t in node.targets):
                declared.add(ast.literal_eval(node.value))
    assert {"overhead", "memory", "mfu"} <= declared
    assert set(bench.BENCHMARKS) == declared
    out = subprocess.run([sys.executable, "-m", "my_utils", "bench", "--help"], env=subprocess_env, cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True).stdout
    block = out.split("\nbenchmarks:\n")[1].split("\n\n")[0]
    assert {line.split()[0] for line in block.splitlines() if not line.startswith("   ")} == declared


def test_names_and_quick_settings():
    names, settings = bench.parse_args([])
    assert names == list(bench.BENCHMARKS) and not settings.quick
    names, quick = bench.parse_args(["memory", "overhead", "memory", "--quick", "--steps", "20"])
    assert names == ["memory", "overhead"]
    assert quick.steps < 20 and quick.memory_preset == quick.qlora_preset == "tiny"
    assert quick.repeats_for("overhead") == 1 and settings.repeats_for("overhead") == bench.REPEATS["overhead"]


@pytest.mark.parametrize("argv, message", [
    (["speed"], "Unknown benchmark 'speed'"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--preset", "tiniest"], "Unknown preset"),
    (["--threads", "100000"], "--threads 100000 is more than this machine's"),
    (["--data-file", "/no/such.jsonl"], "does not exist"),  # before any measured run starts
])
def test_bad_input_is_one_sentence(argv, message):
    with pytest.raises(UserError, match=message):
        bench.parse_args(argv)


def test_precision_follows_where_bf16_is_faster(monkeypatch):
    monkeypatch.setattr(bench, "fast_bf16", lambda: False)
    assert not bench.parse_args([])[1].bf16
    assert bench.parse_args(["--precision", "bf16"])[1].bf16  # measured anyway, when asked
    monkeypatch.setattr(bench, "fast_bf16", lambda: True)
    assert bench.parse_args([])[1].bf16 and not bench.parse_args(["--precision", "fp32"])[1].bf16


def test_ratio_rows_and_table():
    rows = [bench.ratio_row("overhead", "useful tokens/s", "workflow", "bare loop", 0.99, target=0.98, cpu_ratio=1.0),
            bench.ratio_row("memory", "peak", "LoRA", "full", 0.6, target=0.5, at_most=True, if_missed="adapters too big"),
            bench.ratio_row("mfu", "model FLOP/s", "loop", "matmul peak", 0.3)]
    assert [r["met"] for r in rows] == [True, False, None]
    table = bench.render_table(rows)
    assert "met: at least 0.98" in table and "MISSED: above 0.5 (adapters too big)" in table
    assert "workflow against bare loop" in table and "loop against matmul peak" in table


@pytest.mark.slow
def test_model_flops_count_lora_backward_without_base_weight_gradients(subprocess_env):
    # In a fresh process: building a LoRA model imports peft, which must stay out of the test process.
    code = (
        "import json\n"
        "from my_utils.tools.bench import model_flops_per_token\n"
        "from my_utils.core.adapters import AdapterSpec\n"
        "from my_utils.core.models import add_adapter, build_causal_lm\n"
        "from my_utils.core.presets import get_preset\n"
        "p = get_preset('tiny')\n"
        "full = model_flops_per_token(build_causal_lm(p, random_init=True), 64, 'full')\n"
        "spec = AdapterSpec(rank=8).resolved(p.lora_targets)\n"
        "lora = model_flops_per_token(add_adapter(build_causal_lm(p, random_init=True), spec), 64, 'lora')\n"
        "print(json.dumps({'full': full, 'lora': lora}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env, cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    flops = json.loads(out.stdout.strip().splitlines()[-1])

    from my_utils.core.presets import get_preset
    from my_utils.tools.planner import architecture, lora_parameters

    arch = architecture("tiny")
    n = sum(d_in * d_out for d_in, d_out, _ in arch.linears.values())  # every linear layer, the output layer too
    n_adapters = lora_parameters(arch, 8, get_preset("tiny").lora_targets)
    attention = 12 * arch.layers * arch.hidden * 64
    assert flops["full"]["matmul_weights"] == flops["lora"]["matmul_weights"] == n
    assert flops["lora"]["adapter_weights"] == n_adapters
    assert flops["full"]["flops_per_token"] == 6 * n + attention
    assert flops["lora"]["flops_per_token"] == 4 * n + 6 * n_adapters + attention
    assert flops["lora"]["flops_per_token_as_6n"] == 6 * (n + n_adapters) + attention


@pytest.mark.slow
def test_quick_run_writes_results_folders_with_every_ratio(tmp_path, subprocess_env):
    out = subprocess.run([sys.executable, "-m", "my_utils", "bench", "overhead", "memory", "--quick",
                          "--output-root", str(tmp_path)], env=subprocess_env, cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for name in ("overhead", "memory"):
        folder = tmp_path / name
        run = json.loads((folder / "run.json").read_text())
        summary = json.loads((folder / "summary.json").read_text())
        assert run["status"] == "complete" and summary["benchmark"] == name
        for row in summary["ratios"]:
            assert row["baseline"] and math.isfinite(row["ratio"]) and row["ratio"] > 0, row
            assert f"{row['ratio']:.3f}" in out.stdout and row["baseline"] in out.stdout
    # overall progress, the duration, and a word on any target a smoke run misses
    assert "[1/2] overhead" in out.stdout and "[2/2] memory done" in out.stdout and "2 benchmark(s) in" in out.stdout
    missed = [r for name in ("overhead", "memory")
              for r in json.loads((tmp_path / name / "summary.json").read_text())["ratios"] if r["met"] is False]
    assert ("MISSED under --quick says nothing" in out.stdout) == bool(missed)
    overhead = json.loads((tmp_path / "overhead" / "summary.json").read_text())
    # the workflow and the bare loop trained on the same batching, each in its own fresh process
    assert overhead["sampling"] == overhead["course"][0]["settings"]["sampling"] == overhead["bare"][0]["sampling"]
    pids = [json.loads((tmp_path / "overhead" / f"{name}_1" / "run.json").read_text())["pid"]
            for name in ("course", "bare")]
    assert len(set(pids)) == 2
    memory = json.loads((tmp_path / "memory" / "summary.json").read_text())
    steps = memory["steps"]
    assert steps["lora"]["gradient_bytes"] < steps["full"]["gradient_bytes"] / 10  # only adapters train
    assert steps["lora_ckpt"]["saved_activation_bytes"] < steps["lora"]["saved_activation_bytes"]
    assert [r["target"] for r in memory["ratios"] if r["target"]] == ["<= 0.5"] + ["<= 0.15"] * 6 + ["<= 0.35"]
    # the chunked loss is the default, and the plain one measured beside it keeps the whole logits
    assert steps["lora"]["chunked_loss"] and not steps["lora_plain"]["chunked_loss"]
    assert steps["lora"]["saved_activation_bytes"] < steps["lora_plain"]["saved_activation_bytes"]
    # the planner's parts, each beside the tensors measured
    assert all(abs(r - 1) <= 0.15 for ratios in memory["planned_over_measured"].values() for r in ratios.values())


@pytest.mark.slow
def test_a_folder_left_by_a_stopped_bench_is_replaced_and_nothing_else_is(tmp_path, capsys, held_elsewhere):
    from my_utils.run.locks import release_folder
    from my_utils.run.results import Run
    from my_utils.tools.bench.harness import benchmark_folder

    def left(folder, status, benchmark="trainer"):
        run = Run.create(folder, config={}, benchmark=benchmark)
        if status == "complete":
            run.finish({})
        else:  # its writer is gone: the lock with it
            run.update(status=status)
            release_folder(folder)
        return run

    left(tmp_path / "trainer", "complete")
    assert benchmark_folder(tmp_path, "trainer") == tmp_path / "trainer_2"  # a finished one is kept
    killed = left(tmp_path / "trainer_2", "running")  # its process is gone: crashed
    (killed.path / "marker").write_text("x")
    assert benchmark_folder(tmp_path, "trainer") == tmp_path / "trainer_2"
    assert not (tmp_path / "trainer_2").exists() and "replacing" in capsys.readouterr().out
    left(tmp_path / "trainer_2", "interrupted")
    measured = left(tmp_path / "trainer_2" / "measured", "running", benchmark=None)
    with held_elsewhere(measured.path):  # a measured run that outlived the killed bench still writes inside it
        assert benchmark_folder(tmp_path, "trainer") == tmp_path / "trainer_3"
    left(tmp_path / "memory", "running", benchmark="something else")  # not this benchmark's folder
    assert benchmark_folder(tmp_path, "memory") == tmp_path / "memory_2"


@pytest.mark.slow
def test_alternate_adds_repeats_until_settled_or_the_cap(tmp_path):
    from my_utils.tools.bench.harness import alternate, paired_ratio

    def variants():
        return {name: (lambda out: [sys.executable, "-c", "pass"]) for name in ("a", "b")}

    calls = []
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()

    def settled(done):
        calls.append(len(done["a"]))
        return len(done["a"]) >= 4

    runs = alternate(variants(), 2, tmp_path / "one", {}, "test", settled=settled, max_repeats=6)
    assert [len(runs["a"]), len(runs["b"])] == [4, 4] and calls == [2, 3, 4]  # asked only after the minimum
    assert runs["a"][-1].name == "a_4"
    capped = alternate(variants(), 2, tmp_path / "two", {}, "test", settled=lambda done: False, max_repeats=3)
    assert len(capped["a"]) == 3
    # paired ratios: one disturbed pair moves the median little, and the standard error says how settled it is
    pair = paired_ratio([{"r": 1.0}, {"r": 1.02}, {"r": 0.5}], [{"r": 1.0}, {"r": 1.0}, {"r": 1.0}], "r")
    assert pair["ratios"] == [1.0, 1.02, 0.5] and pair["median"] == 1.0
    assert pair["standard_error"] == pytest.approx(1.2533 * 1.4826 * 0.02 / 3 ** 0.5)


def test_process_scaling_pairs_run_i_on_two_processes_with_run_i_on_one():
    from my_utils.tools.bench.harness import scaling_ratios

    # the machine slowed down for the second pair: each pair still says 1.9, a ratio of medians would not
    x1 = [{"rate": 100.0, "cpu_rate": 100.0}, {"rate": 50.0, "cpu_rate": 100.0}, {"rate": 100.0, "cpu_rate": 100.0}]
    x2 = [{"rate": 190.0, "cpu_rate": 200.0}, {"rate": 95.0, "cpu_rate": 180.0}, {"rate": 160.0, "cpu_rate": 190.0}]
    found = scaling_ratios(x2, x1)
    assert found["ratios"] == [1.9, 1.9, 1.6] and found["ratio"] == 1.9 and found["cpu_time_ratio"] == 1.9
    assert found["standard_error"] == 0  # two of three pairs agree exactly: the median is settled
