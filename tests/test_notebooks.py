"""Every numbered notebook executes top to bottom on the tiny preset; its cells tagged ``check``, each under the
cell whose claim it asserts, fail when a claim stops holding, and its last cell records the claims that held."""

import re

import pytest

from my_utils.tools.demo import declared_parameters, execute_notebook, notebooks


# What a lesson's check cells must catch: code run in the lesson's kernel after it, each perturbing the figure a
# claim rests on (as if the claim were false) before the check cells run again, in order; the one whose assert fails
# is the check of that claim.
MUTATIONS = {
    "01_data_parallel": ["gradient_gap = one_copy_gap  # the copies' gradients not summed"],
    "02_ddp": ["runs[list(runs)[1]]['metrics'] = [dict(m, loss=m['loss'] * (1 + 1e-4)) for m in "
               "runs[list(runs)[1]]['metrics']]  # 2 x 8 a ten-thousandth off 1 x 16"],
    "03_accelerate": ["filled_in['no_file'] = filled_in['default_file']  # a launch that reads no default config"],
    "04_lora": ["board = {step: loss * 1.01 for step, loss in board.items()}  # a dashboard with other numbers"],
    "05_lora_ddp": [
        "against_one['none'] = difference([1.30, 1.31, 1.29], [1.30, 1.32, 1.28])  # half the steps cost nothing",
        "against_one['linear'] = difference([1.30, 1.31, 1.29], [1.30, 1.32, 1.28])  # the best rule keeps quality",
        "versus['none'] = difference([1.30, 1.31, 1.29], [1.30, 1.32, 1.28])  # keeping the rate as good as linear",
        "more_examples = difference(held_out(single), held_out(single))  # one process's steps on 2 gain nothing",
        "cpu_ratio = 0.95  # two processes no faster",
    ],
    "06_qlora": [
        "versus['4bit'] = difference([x + 2 * margin for x in held_out(seeds['4bit'])], held_out(seeds['none']))"
        "  # 4-bit twice the margin behind",
        "from my_utils.core.stats import Interval; versus['8bit'] = Interval(0.0, -1.5 * margin, 1.5 * margin, 6)"
        "  # centred on zero, but wider than the margin",
        "comparisons['8bit'] = [r._replace(ratio=r.ratio * 1.03) for r in comparisons['8bit']]  # the plan 3% off",
        "seeds['4bit'][1]['summary']['similarity_after'] = 0.0  # a run the fixed scorer says learned nothing",
    ],
    "07_rank_sweep": [
        "placement = difference(attention_cell['eval_losses'], attention_cell['eval_losses'])  # no placement effect",
        "peaks[RANKS[-1]] = peaks[RANKS[0]]  # memory that does not grow with the rank",
        "lines['alpha = 2r (scale 2)'][-1]['eval_loss'] = lines[next(iter(lines))][-1]['eval_loss']"
        "  # alpha = 2r's larger step changes nothing",
        "lines[next(iter(lines))][-1]['eval_loss'] += 0.5  # with alpha fixed the rank moves the loss as the step does",
        "rank_effect = mean_interval([-0.5, -0.6, -0.7])  # sixteen times the rank closing most of the gap to full",
        "at_best[large_label] = {**large_best, 'learning_rate': LORA_RATES[-1]}  # a best rate no seeds ran at",
    ],
    "08_model_pipeline_parallel": [
        "pipes['gpipe', 8] = pipes['gpipe', 1]  # micro-batches that do not overlap the stages",
        "pipes['1f1b', 8]['in_flight'] = pipes['gpipe', 8]['in_flight']  # 1F1B holding every micro-batch",
        "stage_plans['gpipe', 8][1].total_params += 1  # a planner one parameter off a stage's",
        "tables['interleaved zero bubble'] = tables['interleaved 1F1B']  # a split backward that fills nothing",
    ],
    "09_tensor_parallel": [
        "runs['tp']['collectives']['backward'] = {'all_reduce': 21}  # every projection summing its own gradient",
        "runs['tp+sp']['saved_activation_bytes'] = runs['tp']['saved_activation_bytes']  # sequence parallel saving nothing",
        "ring['bytes_sent'][1] = dict(ring['bytes_expected'], backward=0)  # key/value gradients that never travel home",
        "plan_ratio['tp+sp'] = 1.3  # a planner that misses what sequence parallel saves",
    ],
    "10_sharding": ["results['zero3']['memory'][1] = results['ddp']['memory'][1]  # rank 1 holding DDP's memory"],
    "11_classification": [
        "runs['lora', 'pipeline']['accuracy_after'] = 0.5  # LoRA that does not learn",
        "seeds['lora'] = [dict(r, accuracy_after=r['accuracy_after'] - 0.04) for r in seeds['lora']]"
        "  # LoRA 0.04 further behind full fine-tuning",
        "seeds['full'] = [dict(r, accuracy_after=chance + 0.01 * i) for i, r in enumerate(seeds['full'])]"
        "  # full fine-tuning that stays at chance",
    ],
    "12_traps": [
        "gaps[4]['trap'] = gaps[4]['cure']  # averaging means that changes nothing",
        "first['trap']['adapter_spread'] = 0.0  # ranks that stayed in step after evaluating first",
        "saved['trap']['elements'] = saved['expected_elements']  # a naive save that wrote the whole adapter",
        "upcast['trap']['frozen_bytes'] = upcast['cure']['frozen_bytes']  # an upcast that stores no more per rank",
        "upcast['cure']['frozen_bytes'] = upcast['unsharded_frozen_bytes']  # sharding that saves nothing",
    ],
    "13_peft_methods": [
        "forgot['full'] = forgot['lora']  # full fine-tuning that forgets no more than LoRA",
        "placement = noise.difference(seeded['lora']['eval_loss'], seeded['lora']['eval_loss'], 3, 3)"
        "  # placement that changes nothing",
        "counted['ia3'] = (counted['ia3'][0] + 1, counted['ia3'][1])  # a planner count one off peft's",
        "best[2]['rates'][-1] = (best[2]['rates'][-1][0], 0.0)  # a highest rate that beats the middle one",
        "full_gap = noise.difference(best_adapter['eval_loss'] - noise.sd, best_adapter['eval_loss'])"
        "  # full fine-tuning one seed-noise sd ahead of the best adapter",
        "prompt_gaps['p_tuning'] = noise.difference(loss[worst_lora][0] + noise.sd, loss[worst_lora][0], 1, 3)"
        "  # P-tuning one seed-noise sd behind",
        "brackets = {m: (3e-3, 1e-2) for m in brackets}  # every method's optimum between the same two rates",
    ],
    "14_cluster": [
        "seen['accelerate']['n2'] = (0, 2)  # both nodes rank 0",
        "two_node_losses['torchrun'] = [x * (1 + 1e-4) for x in two_node_losses['torchrun']]  # 2 nodes a ten-thousandth off",
        "cells[1]['config']['adapter']['peft']['r'] = 4  # both array tasks at one rank",
        "resumed_losses = resumed_losses[:-1] + [resumed_losses[-1] * (1 + 1e-7)]  # a resume ten-millionths off",
        "resumed_steps = resumed_steps + [STEPS]  # the last step logged twice",
        "traps['no srun']['sentence'] = re.sub(r'waited \\d+ s', 'waited 75 s', traps['no srun']['sentence'])"
        "  # a hang cut after more than a minute",
        "traps['every node machine rank 0']['sentence'] = 'the job failed'  # a trap nobody named",
        "hang['sentence'] = 'a rank stopped (which one could not be told)'  # the stopped rank not named",
        "dumps[1] = dumps[0]  # a dump that does not show where rank 1 stopped",
    ],
    "15_levers": [
        "kept[True, False] = kept[False, False]  # bf16 that keeps float32's bytes",
        "planned[False, True] = 2 * planned[False, True]  # a planner twice off what checkpointing keeps",
        "forwards[True] = forwards[False]  # checkpointing that recomputes nothing",
        "bf16_gap = mean_interval([2 * margin, 2.1 * margin, 1.9 * margin])  # bf16 two seed spreads off float32",
        "ckpt_gap = 1e-3  # checkpointing that moves the loss",
        "compile_gap = 1e-3  # compiled losses a thousandth off eager's",
        "graphs[TRAP] = 1  # a new length that compiles nothing",
        "one['loss'] += 0.01  # a checkpoint that resumes on 1 process off the uninterrupted run",
        "files = files[:-1]  # a checkpoint without rank 1's file",
        "exported['weight_gap'] = 1e-3  # a plain model folder that changed the weights",
        "qlora_gap = 1e-3  # a sharded QLoRA that trains off the unsharded one",
        "base_ratio = 2.0  # every process holding the whole base",
        "qlora_planned *= 1.05  # a planner 5% off the sharded QLoRA's weights",
    ],
    "16_compare": [
        "part_ratios.append(1.3)  # a part the planner misses by 30%",
        "ratios = [0.0 for _ in ratios]  # a planner that predicts no tensors at all",
        "two = dict(two, global_batch_size=2 * one['global_batch_size'])  # a pair of two global batches",
    ],
}


CHECK_TAG = "check"


def check_cells(nb) -> list[tuple[int, str]]:
    """The code cells of a notebook tagged ``check``: (index in the notebook, source) each."""
    return [(i, c.source) for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and CHECK_TAG in c.metadata.get("tags", [])]


def rerun_cell(checks: list[tuple[int, str]], mutation: str) -> str:
    """A cell that perturbs the lesson's state with ``mutation`` (none: ``""``), runs its check cells again in
    order, prints a verdict line (which check cell's assert failed, or that none did), and restores the state."""
    return "\n".join([
        "import copy as _copy",
        "_saved = {}",
        "for _k, _v in list(globals().items()):",
        "    try:",
        "        _saved[_k] = _copy.deepcopy(_v)",
        "    except Exception:  # modules, open files: nothing a mutation changes",
        "        pass",
        "try:",
        f"    exec({mutation!r}, globals())",
        f"    for _cell, _check in {checks!r}:",
        "        exec(_check, globals())",
        f"    print({'VERDICT survived: ' + mutation!r}, flush=True)",
        "except AssertionError:",
        f"    print(f'VERDICT caught by cell {{_cell}}: ' + {mutation!r}, flush=True)",
        "finally:",
        "    globals().update(_saved)",
    ])


VERDICT = re.compile(r"VERDICT (survived|caught by cell (\d+)): ?(.*)")


def test_a_rerun_names_the_check_cell_a_mutation_fails_and_restores_the_state(capsys):
    checks = [(2, "assert x == 1"), (5, "y = x + 1\nassert y == 2")]
    for mutation, verdict in [("", "VERDICT survived: "), ("x = 3", "VERDICT caught by cell 2: x = 3"),
                              ("x = 1.0", "VERDICT survived: x = 1.0")]:
        state = {"x": 1}
        exec(rerun_cell(checks, mutation), state)
        assert capsys.readouterr().out.strip() == verdict.strip() and repr(state["x"]) == "1", (mutation, state["x"])
    assert VERDICT.fullmatch("VERDICT caught by cell 2: x = 3").groups() == ("caught by cell 2", "2", "x = 3")


# The cluster lesson runs on the test worker that runs the cluster tests, one after the other: the scripts take their
# rendezvous port from the job id, and two clusters number their jobs alike.
NOTEBOOKS = [pytest.param(nb, marks=pytest.mark.xdist_group("slurm_cluster")) if nb.stem == "14_cluster" else nb
             for nb in notebooks()]


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_and_its_claims_hold(notebook, tmp_path):
    import nbformat

    from my_utils.tools.cluster import stop_recorded
    from my_utils.tools.demo import LessonSkippedHere

    out = tmp_path / notebook.name
    checks = check_cells(nbformat.read(notebook, as_version=4))
    mutations = MUTATIONS.get(notebook.stem, [])
    # first the check cells again as they are: in the lesson's final state they still pass, so a mutation's failure
    # below is the mutation's doing
    then = [rerun_cell(checks, m) for m in ["", *mutations]]
    try:
        execute_notebook(notebook, out, run_root=tmp_path / "runs", timeout=600, then=then)
    except LessonSkippedHere as e:
        pytest.skip(e.reason)
    finally:
        stop_recorded(tmp_path / "runs")  # a lesson that failed midway leaves no daemon behind
    executed = nbformat.read(out, as_version=4)
    # a cell's stream text joined first: under load one print can reach the notebook in several outputs
    verdicts = [VERDICT.fullmatch(line.strip()).groups() for c in executed.cells[len(executed.cells) - len(then):]
                for line in "".join(o.text for o in c.outputs if o.output_type == "stream").splitlines()
                if line.startswith("VERDICT")]
    assert [mutation for _, _, mutation in verdicts] == ["", *mutations], verdicts
    assert verdicts[0][0] == "survived", f"the check cells fail in the lesson's final state: {verdicts[0]}"
    survived = [mutation for outcome, _, mutation in verdicts[1:] if outcome == "survived"]
    assert not survived, f"mutations no check cell caught: {survived}"
    executed.cells = executed.cells[:len(executed.cells) - len(then)]
    unexplained = unexplained_warnings(executed)
    assert not unexplained, f"warnings the lesson does not explain (quote them in its text): {unexplained}"
    noisy = noisy_outputs(executed)
    assert not noisy, f"output a learner should not have to read: {noisy}"


# What one cell may show a learner: lines (as they finally read: a redrawn progress bar is one line), the same line
# repeated, and the text outputs of the whole notebook.
CELL_LINES, REPEATS, OUTPUT_BYTES = 60, 3, 30_000
PROGRESS_BAR = re.compile(r"\d+%\|")


def shown_lines(text: str) -> list[str]:
    """The non-empty lines of an output as a terminal or a notebook finally shows them (after carriage returns)."""
    return [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n") if line.rsplit("\r", 1)[-1].strip()]


def noisy_outputs(nb) -> list[str]:
    """What breaks the output budget: a cell over ``CELL_LINES`` lines or repeating a line more than ``REPEATS``
    times, a library notice on stderr the text does not quote (progress bars aside), text outputs over
    ``OUTPUT_BYTES`` in all."""
    from collections import Counter

    quoted = [q for c in nb.cells if c.cell_type == "markdown" for q in re.findall(r'"([^"]{12,})"', c.source)]
    problems, total = [], 0
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        streams = [o for o in cell.outputs if o.output_type == "stream"]
        text = "".join(o.text for o in streams)
        total += len(text.encode()) + sum(len(o.get("data", {}).get("text/plain", "")) for o in cell.outputs)
        lines = shown_lines(text)
        if len(lines) > CELL_LINES:
            problems.append(f"code cell {i}: {len(lines)} lines")
        # a diff's added and removed lines are code the lesson shows (lesson 03's markers repeat), not chatter
        repeated = [(line, n) for line, n in Counter(lines).items() if n > REPEATS and not line.startswith(("+", "-"))]
        if repeated:
            problems.append(f"code cell {i}: {repeated[0][0][:80]!r} {repeated[0][1]} times")
        notices = [line for o in streams if o.name == "stderr" for line in shown_lines(o.text)
                   if not PROGRESS_BAR.search(line) and not any(q in line for q in quoted)]
        if notices:
            problems.append(f"code cell {i}: a notice the lesson does not quote: {notices[0][:120]!r}")
    if total > OUTPUT_BYTES:
        problems.append(f"{total:,} bytes of text output")
    return problems


# A warning in a cell's output: Python's (UserWarning: ...), torch's C++ ones ([W... or W1126 ...), and the library
# notices known to appear in these lessons.
WARNING_LINE = re.compile(r"\w+Warning: |^\[?W\d{4}|^\[W |Removed shared tensor")


def unexplained_warnings(nb) -> list[str]:
    """The warning lines of an executed notebook's outputs that its text does not quote (in double quotes)."""
    quoted = [q for c in nb.cells if c.cell_type == "markdown" for q in re.findall(r'"([^"]{12,})"', c.source)]
    lines = [line.strip() for c in nb.cells if c.cell_type == "code" for o in c.outputs
             if o.output_type == "stream" for line in o.text.splitlines()]
    return [line for line in lines if WARNING_LINE.search(line) and not any(q in line for q in quoted)]


def test_notebooks_are_committed_without_outputs():
    import nbformat

    for path in notebooks():
        nb = nbformat.read(path, as_version=4)
        dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
        assert not dirty, f"{path.name} has outputs in cells {dirty}; strip them before committing"


def test_a_lessons_asserts_sit_in_its_check_cells_and_its_last_cell_records_the_claims():
    """The harness re-runs only the cells tagged ``check``: an assert elsewhere would go unmutated; the claims are
    recorded last, so that the file exists only when every check cell before it passed."""
    import nbformat

    for path in notebooks():
        nb = nbformat.read(path, as_version=4)
        checks = [source for _, source in check_cells(nb)]
        assert checks and all(re.search(r"^\s*assert\b", s, re.M) for s in checks), f"{path.name}: check cells assert"
        untagged = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source not in checks
                    and re.search(r"^\s*assert\b", c.source, re.M)]
        assert not untagged, f"{path.name}: cells {untagged} assert a claim but are not tagged {CHECK_TAG!r}"
        last = nb.cells[-1]
        assert last.cell_type == "code" and "record_claims(" in last.source and CHECK_TAG not in last.metadata.get(
            "tags", []), f"{path.name} must end with the cell that records its claims"


def test_every_region_a_notebook_shows_exists():
    import re

    import nbformat

    from my_utils.core.source import regions

    call = re.compile(r"show_region\(\s*\"([\w.]+)\",\s*\"([^\"]+)\"\s*\)")
    shown = [(path.name, *m.groups()) for path in notebooks()
             for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"
             for m in call.finditer(cell.source)]
    assert shown, "the lessons show module code through show_region"
    for notebook, module, name in shown:
        assert name in regions(module), f"{notebook} shows region {name!r} of {module}, which has no such region"


def test_a_lesson_with_a_preset_declares_its_settings_in_one_parameters_cell():
    """papermill's convention, which the demo follows: the settings a run changes (PRESET, PROCESSES, STEPS) are
    assigned in one cell tagged ``parameters`` and nowhere else."""
    import re

    import nbformat

    for path in notebooks():
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
        if not any(re.search(r"\bPRESET\b", c.source) for c in code):
            assert not tagged, path.name
            continue
        assert len(tagged) == 1 and "PRESET" in declared_parameters(nb), f"{path.name}: PRESET in a parameters cell"
        for name in declared_parameters(nb):
            others = [c for c in code if c not in tagged and re.search(rf"^{name} =", c.source, re.M)]
            assert not others, f"{path.name} assigns {name} outside its parameters cell"


@pytest.mark.slow
def test_the_demo_sets_the_parameters_a_lesson_declares_and_only_those(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell('PRESET = "tiny"\nSTEPS = 3', metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell('print(PRESET, STEPS, "PROCESSES" in globals())')])
    nbformat.write(nb, tmp_path / "lesson.ipynb")
    execute_notebook(tmp_path / "lesson.ipynb", tmp_path / "out.ipynb", run_root=tmp_path / "runs",
                     parameters={"PRESET": "gpt2", "PROCESSES": 4})
    executed = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert [c.metadata.get("tags") for c in executed.cells] == [["parameters"], ["injected-parameters"], None]
    assert executed.cells[-1].outputs[0]["text"] == "gpt2 3 False\n"


def test_a_warning_counts_as_explained_only_when_the_lesson_quotes_it():
    import nbformat

    output = nbformat.v4.new_output("stream", name="stderr", text="x.py:3: FutureWarning: `foo` is deprecated\nok\n")
    cell = nbformat.v4.new_code_cell("run()", outputs=[output])
    silent = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("We run it."), cell])
    assert unexplained_warnings(silent) == ["x.py:3: FutureWarning: `foo` is deprecated"]
    explained = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell('It prints "FutureWarning: `foo` is deprecated", which is harmless.'), cell])
    assert unexplained_warnings(explained) == []


@pytest.mark.slow
def test_the_demo_runs_a_waiting_lesson_beside_its_partner_and_the_next_after_both(tmp_path, monkeypatch):
    import json

    import nbformat

    from my_utils.tools import demo

    lessons = tmp_path / "notebooks"
    lessons.mkdir()
    for name in ("01_partner", "02_waiting", "03_next"):  # each records when it ran and the run root it was given
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
            "import json, os, time\nstart = time.time()\ntime.sleep(4)\n"
            f"json.dump([start, time.time(), os.environ['COURSE_RUN_ROOT']], open({str(tmp_path / name)!r}, 'w'))")]),
            lessons / f"{name}.ipynb")
    monkeypatch.setattr(demo, "NOTEBOOKS", lessons)
    monkeypatch.setattr(demo, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(demo, "next_run_root", lambda device, count: tmp_path / "runs" / "run_1")
    monkeypatch.setattr(demo, "BESIDE", {"02_waiting.ipynb": "01_partner.ipynb"})
    root = demo.main([])
    (start_1, end_1, root_1), (start_2, end_2, root_2), (start_3, _, root_3) = (
        json.loads((tmp_path / name).read_text()) for name in ("01_partner", "02_waiting", "03_next"))
    assert start_2 < end_1 and start_1 < end_2, "the waiting lesson ran while its partner did"
    assert start_3 > max(end_1, end_2), "the next lesson waited for both"
    assert root_1 == root_2 == root_3 == str(root)
    summary = json.loads((root / "demo" / "summary.json").read_text())
    assert sorted(summary["notebook_seconds"]) == ["01_partner.ipynb", "02_waiting.ipynb", "03_next.ipynb"]
    assert summary["wall_seconds"] < sum(summary["notebook_seconds"].values())
