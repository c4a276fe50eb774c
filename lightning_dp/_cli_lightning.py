"""The LightningCLI half of ``lightning-dp`` (fit, validate, test, predict), kept apart from ``cli.py``.

Importing this module imports torch and Lightning (seconds), so ``lightning_dp.cli`` imports it only when one of
these commands runs: ``lightning-dp plan`` and ``lightning-dp --help`` never pay for it.

An error of the library (every exception class of `lightning_dp.errors` and `lightning_dp.data.errors`), raised while
the config is instantiated or during the run, is one line on stderr with exit status 2.
"""

from __future__ import annotations

import os
import sys

from pytorch_lightning.cli import LightningCLI

import lightning_dp.data.errors as data_errors
import lightning_dp.errors as core_errors
from lightning_dp._quiet import drop_lightning_tips

__all__ = ["LIBRARY_ERRORS", "library_error", "run_lightning"]

#: Every error class of the library (a class added to either module is included): each is one line and exit status
#: 2 through the command line.
LIBRARY_ERRORS: tuple[type[BaseException], ...] = tuple(
    obj
    for module in (core_errors, data_errors)
    for obj in (getattr(module, name) for name in module.__all__)
    if isinstance(obj, type) and issubclass(obj, BaseException) and not issubclass(obj, Warning)
)

TRACEBACK_HINT = "(the full traceback: set LIGHTNING_DP_TRACEBACK=1)"


def library_error(err: BaseException) -> BaseException | None:
    """The library's own error behind ``err`` (jsonargparse and Lightning wrap what __init__ and hooks raise)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, LIBRARY_ERRORS):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def run_lightning(argv: list[str] | None, command: str) -> int:
    """Runs LightningCLI on ``argv`` (None: it reads sys.argv); returns the exit status.

    Args:
        argv: the arguments after ``lightning-dp``; None when run from the console (LightningCLI reads sys.argv itself:
            given args as well, it warns that both were given).
        command: the subcommand, for the messages.
    """
    drop_lightning_tips()
    try:
        LightningCLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=argv,
            parser_kwargs={"prog": "lightning-dp"},
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
        )
    except Exception as err:
        ours = library_error(err)
        if ours is None or os.environ.get("LIGHTNING_DP_TRACEBACK"):
            raise
        print(f"lightning-dp {command}: error: {ours}\n{TRACEBACK_HINT}", file=sys.stderr)
        return 2
    return 0
