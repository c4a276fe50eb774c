"""What the ``lightning-dp`` command and its sub-commands share: their one-line help texts and their parser.

Here rather than in ``lightning_dp.cli`` (which imports ``lightning_dp.audit.cli`` to run ``audit``) or in
``lightning_dp.audit.cli`` (which imports torch): both import this module, and ``lightning-dp --help`` lists every
command without torch. It imports nothing of the package.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["AUDIT_DESCRIPTION", "LIGHTNING_COMMANDS", "PLAN_DESCRIPTION", "TUNE_DESCRIPTION", "OneLineParser"]

#: The LightningCLI subcommands, with the one-line descriptions ``lightning-dp --help`` shows.
LIGHTNING_COMMANDS = {
    "fit": "Train a model from a config (LightningCLI); its DPSGD/P3SGD callback makes it private.",
    "validate": "Run one evaluation epoch over the validation set (LightningCLI).",
    "test": "Run one evaluation epoch over the test set (LightningCLI).",
    "predict": "Run inference on your data (LightningCLI).",
}
PLAN_DESCRIPTION = (
    "Privacy planning: ε for a configuration, the noise / steps that fit a target ε, or a consortium's sites alone "
    "and together."
)
AUDIT_DESCRIPTION = (
    "Empirical privacy audit: an ε lower bound from a canary, beside the accountant's ε; or, with --observer, "
    "neighbouring worlds replayed end to end."
)
TUNE_DESCRIPTION = (
    "Private hyperparameter search: K random trials of a config, the best kept, the whole search charged."
)


class OneLineParser(argparse.ArgumentParser):
    """The parser of a sub-command (``lightning-dp plan``, ``lightning-dp audit``).

    Bad arguments: one line on stderr that names the sub-command's ``--help``, exit status 2.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
