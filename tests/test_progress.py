import re
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from my_utils.core.progress import WIDGET_VIEW, Progress, follow_log, last_frame


def test_the_training_bar_is_the_longest_one_in_a_log():
    log = ("Loading weights: 100%|##########| 52/52 [00:00<00:00]\n"
           "  3%|3         | 4/150 [00:01<00:40, 3.50it/s]\r"
           " 40%|####      | 60/150 [00:10<00:15, 5.90it/s]\r"
           "100%|##########| 7/7 [00:00<00:00, 20.0it/s]\n"  # an evaluation's bar, drawn meanwhile
           "ddp: 41%|####      | 61/150 [00:11<00:15, 5.90it/s]")
    assert last_frame(log) == (61, 150)
    assert last_frame("Loading weights: 100%|##########| 52/52 [00:00<00:00]\nno bar here") is None


def test_in_a_terminal_the_bar_ends_as_one_line(capsys):
    with Progress(3, "sweep", unit="cells") as bar:
        bar.update()
        bar.write("cell 1: complete")
        bar.update(n=3)
    shown = capsys.readouterr().out
    assert "cell 1: complete\n" in shown
    assert re.fullmatch(r"sweep: 3/3 cells in \d+ s\n", shown.split("\r")[-1]), shown


def test_a_failed_run_says_so_where_its_log_stops(tmp_path, capsys):
    log = tmp_path / "lora.log"
    with pytest.raises(RuntimeError), follow_log(log, "lora", note="; see its log"):
        log.write_text("  5%|5         | 5/100 [00:01<00:19, 5.00it/s]")
        raise RuntimeError("boom")
    assert re.fullmatch(r"lora: 5/100 steps failed in \d+ s; see its log\n", capsys.readouterr().out.split("\r")[-1])


@pytest.mark.slow
def test_in_a_notebook_a_run_is_one_widget_and_one_final_line_in_the_saved_file():
    """Executed in a kernel as `make demo` executes the lessons: the output a run leaves is one, a widget view with
    the final line as its text; the widget's state (its last value) is saved with the notebook."""
    code = ("from my_utils.core.progress import Progress\n"
            "with Progress(4, 'train', unit='steps') as bar:\n"
            "    for _ in range(4):\n"
            "        bar.update()")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    NotebookClient(nb, kernel_name="python3", timeout=60, resources={"metadata": {"path": str(sys.path[0])}}).execute()
    [output] = nb.cells[0].outputs
    assert output.output_type == "display_data" and WIDGET_VIEW in output.data, output
    assert re.fullmatch(r"train: 4/4 steps in \d+ s", output.data["text/plain"]), output.data["text/plain"]
    states = nb.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"].values()
    bars = [s["state"] for s in states if s["model_name"] == "IntProgressModel"]
    assert [(b["value"], b["max"], b["bar_style"]) for b in bars] == [(4, 4, "success")]
