"""Helpers for the fine-tuning course.

Importing this package is cheap and side-effect free: it imports no torch-heavy training libraries
(peft, trl, bitsandbytes, ``transformers.Trainer``) and never touches CUDA. Import the submodules you need::

    from my_utils.core.printing import print0, rank_print
    from my_utils.run.results import create_run
"""

__version__ = "0.1.0"


class UserError(ValueError):
    """Bad input from the user: the message is one sentence saying what is wrong and what to do."""
