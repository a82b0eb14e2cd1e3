"""Regenerate the screenshot of a lesson in JupyterLab that the docs show: the lesson run with Run All in a headless
Chromium (as tests/test_browser.py runs it), the page captured at its first training run's progress bar.

    python scripts/screenshot_lesson.py [--lesson 04_lora] [--output docs/images/lesson_04_jupyterlab.png]

Needs Chromium from the system's packages (apt-get install chromium).
"""

import argparse
import sys
import tempfile
from pathlib import Path

from my_utils.tools.lab_browser import jupyterlab, missing_browser, open_browser, run_all

REPO_ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lesson", default="04_lora", help="the notebook's name, without .ipynb (default: 04_lora)")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "docs" / "images" / "lesson_04_jupyterlab.png",
                        help="the PNG to write (default: docs/images/lesson_04_jupyterlab.png)")
    args = parser.parse_args(argv)
    if not (REPO_ROOT / "notebooks" / f"{args.lesson}.ipynb").is_file():
        print(f"error: there is no lesson notebooks/{args.lesson}.ipynb; name one of notebooks/ without .ipynb.",
              file=sys.stderr)
        return 2
    if args.output.is_dir() or args.output.suffix.lower() != ".png":
        print(f"error: --output {args.output} must name a .png file (the folder it goes in is made if need be).",
              file=sys.stderr)
        return 2
    if reason := missing_browser():
        print(f"error: {reason}", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    args.output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as runs, jupyterlab([args.lesson], Path(runs)) as lab, \
            sync_playwright() as playwright:
        browser = open_browser(playwright)
        seen = run_all(browser, lab, args.lesson, screenshot=args.output)
        browser.close()
    print(f"{args.lesson}: ran in {seen.seconds:.0f} s, {seen.widgets} progress widget(s); wrote {args.output}")
    return 0 if seen.tracebacks == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
