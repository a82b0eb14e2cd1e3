"""One progress bar per run: a widget while it runs in JupyterLab, one line once it is done.

In a notebook's kernel with ipywidgets the bar is a widget whose displayed output also carries a text line; when
the run ends that line is replaced by its final state, so an executed notebook file keeps one line per run (not
hundreds of redrawn text frames) and JupyterLab still shows the widget. Anywhere else it is tqdm's text bar,
replaced by the same final line.

    with Progress(total=9, desc="sweep", unit="cell") as bar:
        bar.update(3)                        # three more done
        bar.write("cell 3: complete")        # a line above the bar

``follow_log`` shows the progress a launched process writes into its log file (the last tqdm frame there).
"""

from __future__ import annotations

import re
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def in_kernel_with_widgets() -> bool:
    """True in a Jupyter kernel that can show ipywidgets (not in a terminal, not in a forked training worker)."""
    if "ipykernel" not in sys.modules:
        return False
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _elapsed(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 100 else f"{seconds / 60:.1f} min"


class Progress:
    """A progress bar of ``total`` steps (``None``: unknown yet) named ``desc``; see the module's docstring."""

    def __init__(self, total: int | None, desc: str, unit: str = "it"):
        self.total, self.desc, self.unit, self.n, self.closed = total, desc, unit, 0, False
        self.started = time.perf_counter()
        self._widget = in_kernel_with_widgets()
        if self._widget:
            import ipywidgets
            from IPython.display import display

            self._bar = ipywidgets.IntProgress(min=0, max=max(total or 1, 1), bar_style="" if total is None else "info")
            self._text = ipywidgets.Label(self._state())  # beside the bar and its name
            self._box = ipywidgets.HBox([ipywidgets.Label(desc), self._bar, self._text])
            self._handle = display(self._bundle(), raw=True, display_id=True)
        else:
            from tqdm import tqdm

            # leave=False: the bar is wiped when it ends, and its final line printed in its place
            self._tqdm = tqdm(total=total, desc=desc, unit=unit, file=sys.stdout, leave=False)

    def line(self, done: str = "") -> str:
        """The bar as one line of text: ``sweep: 9/9 cells in 66 s``, or with what ended it (``failed``)."""
        return f"{self.desc}: {self._state(done)}"

    def _state(self, done: str = "") -> str:
        count = (f"{self.n}/{self.total} {self.unit}" if self.total is not None else
                 f"{self.n} {self.unit}" if self.n else "")
        return " ".join(filter(None, [count, done, "in", _elapsed(time.perf_counter() - self.started)]))

    def _bundle(self, text: str | None = None) -> dict:
        view = {"version_major": 2, "version_minor": 0, "model_id": self._box.model_id}
        return {WIDGET_VIEW: view, "text/plain": text or self.line()}

    def update(self, advance: int = 1, *, n: int | None = None, total: int | None = None) -> None:
        """``advance`` steps done, or (``n``) this many done in all; ``total`` once it is known or if it changed."""
        if total is not None and total != self.total:
            self.total = total
            if self._widget:
                self._bar.max, self._bar.bar_style = max(total, 1), "info"
            else:
                self._tqdm.total = total
        new = self.n + advance if n is None else n
        if self._widget:
            self.n = new
            self._bar.value, self._text.value = min(new, self._bar.max), self._state()
        else:
            self._tqdm.update(new - self.n)
            self.n = new

    def write(self, line: str) -> None:
        """A line printed above the bar (in a notebook: in the cell's output, before the bar's final line)."""
        if self._widget:
            print(line, flush=True)
        else:
            self._tqdm.write(line, file=sys.stdout)

    def close(self, failed: bool = False, note: str = "") -> None:
        """End the bar, ``note`` after its final line: in a notebook the widget keeps its last state and the text
        beside it becomes the final line; in a terminal the line is printed where tqdm's bar was."""
        if self.closed:
            return
        self.closed = True
        done = "failed" if failed else ""
        final = self.line(done) + note
        if self._widget:
            self._bar.bar_style = "danger" if failed else "success"
            self._text.value = self._state(done) + note
            self._handle.update(self._bundle(final), raw=True)
        else:
            self._tqdm.close()
            print(final, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        self.close(failed=kind is not None)


# tqdm's frame: "desc: 40%|####      | 60/150 [00:10<00:15, 5.9it/s]"; a frame ends at \r or \n
_FRAME = re.compile(r"([^\r\n|]*?):?\s*\d+%\|[^\r\n|]*\|\s*(\d+)/(\d+)")


def last_frame(text: str) -> tuple[int, int] | None:
    """(done, total) of the training bar's last frame in a log's ``text``: the bar with the most steps (evaluation's
    and weight loading's bars are shorter), or None when the log has no bar yet."""
    frames = [(int(n), int(total)) for desc, n, total in _FRAME.findall(text) if "Loading" not in desc]
    if not frames:
        return None
    longest = max(total for _, total in frames)
    return [frame for frame in frames if frame[1] == longest][-1]


def _log_tail(log: Path, size: int = 65536) -> str:
    """The end of ``log`` (a long run's log holds thousands of frames), or nothing before the process made it."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - size))
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


@contextmanager
def follow_log(log: str | Path, desc: str, note: str = "", every_s: float = 0.5):
    """While the body runs (a launched process writing ``log``), a ``Progress`` named ``desc`` follows the tqdm
    frames that the process writes there; when the body ends, the bar's final line ends with ``note``."""
    log = Path(log)
    stop = threading.Event()
    bar = Progress(None, desc, unit="steps")

    def follow():
        frame = last_frame(_log_tail(log))
        bar.update(0) if frame is None else bar.update(n=frame[0], total=frame[1])  # 0: the time still moves

    def watch():
        while not stop.wait(every_s):
            follow()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    failed = True
    try:
        yield bar
        failed = False
    finally:
        stop.set()
        watcher.join()
        follow()
        bar.close(failed=failed, note=note)
