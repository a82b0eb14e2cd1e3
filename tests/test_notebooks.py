"""Every numbered notebook executes top to bottom on the tiny preset; each ends with cells that assert what
its lesson claims, so a notebook whose claim stops holding fails here."""

import re

import pytest

from my_utils.tools.demo import declared_parameters, execute_notebook, notebooks


@pytest.mark.slow
@pytest.mark.parametrize("notebook", notebooks(), ids=lambda p: p.stem)
def test_notebook_executes_and_its_claims_hold(notebook, tmp_path):
    import nbformat

    out = tmp_path / notebook.name
    execute_notebook(notebook, out, run_root=tmp_path / "runs", timeout=600)
    unexplained = unexplained_warnings(nbformat.read(out, as_version=4))
    assert not unexplained, f"warnings the lesson does not explain (quote them in its text): {unexplained}"


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
        assert nb.cells[-1].cell_type == "code" and "assert" in nb.cells[-1].source, f"{path.name} must end with checks"


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
