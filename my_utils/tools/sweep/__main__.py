"""``python -m my_utils.tools.sweep``: the same as ``python -m my_utils sweep``."""

from my_utils.run.cli import run_main
from my_utils.tools.sweep.cli import main

run_main(main, prefix="sweep")
