"""Helpers for the fine-tuning course.

Importing this package is cheap: it imports no torch-heavy training libraries (peft, trl, bitsandbytes,
``transformers.Trainer``), never touches CUDA, only hides four library notices and shows two repeated notices once
(below). Import the submodules you need::

    from my_utils.core.printing import print0, rank_print
    from my_utils.run.results import Run
"""

import logging
import os
import sys
import warnings

__version__ = "0.1.0"

# Notices from inside the libraries that a reader of the course can do nothing about (the calls are the
# libraries' own); hidden here so that they do not bury the lessons' output. tqdm's: without ipywidgets (a kernel
# installed without them) it draws text progress bars, which serve as well.
for _notice in (r"`is_gradient_checkpointing` is deprecated", r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                r"IProgress not found"):
    warnings.filterwarnings("ignore", message=_notice)
# In a notebook's kernel with the hub offline (as `make` runs it), the libraries' own bars (weights loaded from disk in
# a moment) would each leave a widget that a saved notebook shows at 0%; the course draws one bar per run
# (core/progress.py). Online, downloads keep their bars.
if "ipykernel" in sys.modules and os.environ.get("HF_HUB_OFFLINE") == "1":
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# bitsandbytes, on CPUs with AVX512-BF16, tries to fetch an optional kernel from the hub when it is imported and logs
# its absence; it then uses its own CPU kernel, which is what the course measures.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: "kernels-community" not in record.getMessage())


class _FirstTimeOnly(logging.Filter):
    """Lets a log record that contains ``text`` through the first time in this process, and drops the repeats."""

    def __init__(self, text: str):
        super().__init__()
        self.text, self.seen = text, False

    def filter(self, record) -> bool:
        if self.text not in record.getMessage():
            return True
        first, self.seen = not self.seen, True
        return first


# accelerate's save_state says, at every checkpoint, that GPT-2's output layer shares the embedding's weights and is
# saved once; harmless (a resume ties them again), and lesson 03 explains it after its first appearance.
logging.getLogger("accelerate.utils.other").addFilter(_FirstTimeOnly("Removed shared tensor"))
# bitsandbytes' 8-bit matmul on CUDA says at every call that it casts its input to fp16 (over 5,000 lines in a 250-step
# tiny run on a GPU); once says it.
logging.getLogger("bitsandbytes.autograd._functions").addFilter(
    _FirstTimeOnly("MatMul8bitLt: inputs will be cast from"))


class UserError(ValueError):
    """Bad input from the user: the message is one sentence saying what is wrong and what to do."""


class JobFailed(RuntimeError):
    """Work that ran and failed, not bad input (a sweep's cells that crashed): one line saying what failed and where
    its output is, and exit code 1."""


class NothingToDo(UserError):
    """What was asked is already done (``--resume`` of a complete run): one sentence, and exit code 0, so that a
    retry loop around the command ends."""
