"""The lessons as a learner meets them: JupyterLab in a real browser, Run All, and what renders."""

import pytest

from my_utils.tools.lab_browser import jupyterlab, missing_browser, open_browser, run_all

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("browser")]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if reason := missing_browser():
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with jupyterlab(["00_setup", "04_lora"], tmp_path_factory.mktemp("runs")) as lab, sync_playwright() as playwright:
        browser = open_browser(playwright)
        yield browser, lab
        browser.close()


@pytest.mark.parametrize("lesson, closing_line, progress_bars", [("00_setup", "setup OK", 0),
                                                                  ("04_lora", "all claims hold", 3)])
def test_run_all_in_jupyterlab_shows_the_lesson_as_written(lab, tmp_path, lesson, closing_line, progress_bars):
    """Run All from the Run menu: no error, the closing check's line, each training run's progress as one widget
    (not text frames), and the figures as images. Lesson 04 trains three runs and shows a diagram and two plots."""
    browser, server = lab
    seen = run_all(browser, server, lesson, screenshot=tmp_path / f"{lesson}.png")
    print(f"{lesson}: {seen.seconds:.0f} s in the browser; screenshot {tmp_path / f'{lesson}.png'}")
    assert seen.tracebacks == 0, [text for text in seen.outputs if "Traceback" in text]
    assert seen.outputs[-1].strip() == closing_line
    assert seen.widgets == progress_bars and seen.text_frames == 0, seen
    assert seen.images >= (3 if lesson == "04_lora" else 0), seen
    assert (tmp_path / f"{lesson}.png").stat().st_size > 10_000
