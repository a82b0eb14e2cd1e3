"""Lessons opened as a learner opens them: JupyterLab in a headless Chromium driven by Playwright, Run All, and what
rendered read back from the page (errors, the closing check's line, widgets, images, text progress frames).

tests/test_browser.py asserts on it; ``python scripts/screenshot_lesson.py`` regenerates the screenshot in the docs.
Chromium comes from the system's packages (``apt-get install chromium``); Playwright drives it and downloads nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from my_utils.run.launch import free_port
from my_utils.core.paths import REPO_ROOT

CHROMIUMS = ("chromium", "chromium-browser", "google-chrome")
# JupyterLab's settings for a test: every cell in the page (no virtual scrolling), no news, no autosave
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": '{"windowingMode": "none"}',
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": '{"fetchNews": "false"}',
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": '{"autosave": false}',
}
_PROMPTS = "[...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent)"
# Run All has begun (a cell queued or running), then ended (none is, and one has run)
_RUN_ALL_STARTED = f"() => {_PROMPTS}.some(p => p.includes('*'))"
_RUN_ALL_DONE = (f"() => {{ const p = {_PROMPTS}; "
                 "return p.some(t => /\\[\\d+\\]/.test(t)) && !p.some(t => t.includes('*')); }")


def find_chromium() -> str | None:
    """The system's Chromium, or None."""
    return next((path for name in CHROMIUMS if (path := shutil.which(name))), None)


def missing_browser() -> str | None:
    """Why the browser test cannot run here (one sentence), or None when it can."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "Playwright is not installed (make installs it from requirements.txt)."
    if find_chromium() is None:
        return "No Chromium on this machine: install it (apt-get install chromium) to open the lessons in a browser."
    return None


@contextmanager
def jupyterlab(lessons: list[str], run_root: Path):
    """JupyterLab on a free local port serving copies of ``lessons`` (names under notebooks/) in a folder of its own,
    their results under ``run_root``; yields its URL and its token."""
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        (folder / "notebooks").mkdir()
        for name in lessons:
            shutil.copy(REPO_ROOT / "notebooks" / f"{name}.ipynb", folder / "notebooks")
        for shared in ("assets", "requirements.txt"):  # what the lessons read by relative path
            (folder / shared).symlink_to(REPO_ROOT / shared)
        for name, text in SETTINGS.items():
            path = folder / "settings" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        port, token = free_port(), os.urandom(12).hex()
        # the kernels draw figures as a learner's do (a headless MPLBACKEND, as the tests set, would show none)
        env = {**{k: v for k, v in os.environ.items() if k != "MPLBACKEND"}, "COURSE_RUN_ROOT": str(run_root),
               "HF_HUB_OFFLINE": "1",
               "JUPYTERLAB_SETTINGS_DIR": str(folder / "settings"),
               "JUPYTERLAB_WORKSPACES_DIR": str(folder / "workspaces"), "JUPYTER_RUNTIME_DIR": str(folder / "runtime"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.port_retries=0",
                   f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={folder}",
                   *(["--allow-root"] if os.getuid() == 0 else [])]
        with open(folder / "server.log", "w") as log:
            server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            base = f"http://127.0.0.1:{port}"
            try:
                _wait_for(f"{base}/api/status?token={token}", server, folder / "server.log")
                yield base, token
            finally:
                server.terminate()
                server.wait(timeout=30)


def _wait_for(url: str, server: subprocess.Popen, log: Path, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with code {server.returncode}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"JupyterLab did not answer within {timeout_s:.0f} s:\n{log.read_text()[-2000:]}")


@dataclass
class LessonSeen:
    """What a lesson's page showed once Run All finished."""

    name: str
    seconds: float
    outputs: list[str] = field(default_factory=list)  # each output's visible text
    tracebacks: int = 0  # outputs showing an error's traceback
    widgets: int = 0  # progress bars drawn as widgets
    text_frames: int = 0  # outputs holding a text progress bar ("40%|####")
    images: int = 0  # outputs that are images (figures, diagrams)


def open_browser(playwright):
    """Chromium from the system, headless."""
    return playwright.chromium.launch(executable_path=find_chromium(), headless=True)


def run_all(browser, lab: tuple[str, str], name: str, screenshot: Path | None = None,
            timeout_s: float = 600) -> LessonSeen:
    """Open lesson ``name`` in a new page (a laptop's screen) of the JupyterLab ``lab`` (from ``jupyterlab``), run
    all its cells from the Run menu, wait until none is queued or running, and read its outputs from the page;
    ``screenshot``: a PNG of the page there, scrolled to the first progress widget (or the last output)."""
    base, token = lab
    started = time.perf_counter()
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    # a workspace of its own: the page shows this lesson alone, not the tabs that earlier pages left open
    page.goto(f"{base}/lab/workspaces/{name}/tree/notebooks/{name}.ipynb?token={token}")
    page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"]', timeout=120_000)
    _click_run_all(page)
    page.wait_for_function(_RUN_ALL_DONE, timeout=timeout_s * 1000, polling=1000)
    page.wait_for_timeout(2000)  # the last outputs (figures) can render a moment after their cell shows it is done
    outputs = page.locator(".jp-OutputArea-output")
    texts = outputs.all_inner_texts()
    widgets = page.locator(".jp-OutputArea-output .widget-hprogress")  # ipywidgets' IntProgress
    seen = LessonSeen(
        name=name, seconds=time.perf_counter() - started, outputs=texts,
        tracebacks=sum("Traceback (most recent call last)" in text for text in texts),
        widgets=widgets.count(), text_frames=sum("%|" in text for text in texts),
        images=page.locator('.jp-OutputArea-output[data-mime-type^="image/"]').count(),
    )
    if screenshot is not None:
        (widgets.first if seen.widgets else outputs.last).evaluate("e => e.scrollIntoView({block: 'center'})")
        page.screenshot(path=str(screenshot))
    page.close()
    return seen


def _click_run_all(page, tries: int = 3) -> None:
    """Run > Run All Cells, until a cell is queued: on a busy machine a click can land while the page is still
    settling, and nothing starts."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for attempt in range(1, tries + 1):
        page.locator(".jp-Notebook .jp-Cell").first.click()  # the Run menu acts on the notebook that has the focus
        page.locator(".lm-MenuBar-item", has_text="Run").first.click()
        page.click('.lm-Menu-item[data-command="runmenu:run-all"]')
        try:
            page.wait_for_function(_RUN_ALL_STARTED, timeout=15_000)
            return
        except PlaywrightTimeout:
            if attempt == tries:
                raise
