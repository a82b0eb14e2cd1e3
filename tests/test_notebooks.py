"""Every numbered notebook executes top to bottom on the tiny preset; each ends with cells that assert what
its lesson claims, so a notebook whose claim stops holding fails here."""

import pytest

from my_utils.tools.demo import execute_notebook, notebooks


@pytest.mark.slow
@pytest.mark.parametrize("notebook", notebooks(), ids=lambda p: p.stem)
def test_notebook_executes_and_its_claims_hold(notebook, tmp_path):
    out = tmp_path / notebook.name
    execute_notebook(notebook, out, run_root=tmp_path / "runs", timeout=600)
    assert out.is_file()


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
