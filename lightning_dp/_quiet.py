"""Silencing Lightning's warnings about what this library does on purpose — only those, only while they can arise.

Never a privacy warning: a `WarningWindow` matches one message of Lightning's, and only between the hooks that
open and close it (e.g. ``on_fit_start`` → ``on_train_start``, where Lightning checks the loaders and module modes).

Importing this module (which ``lightning_dp.callbacks`` and ``lightning_dp.models`` do) also drops Lightning's
advertising tips ("💡 Tip: … litlogger …") from its log, for Python runs as for the command line: Lightning prints
the first one while the ``Trainer`` is built, before any hook of a callback or module could act, so the filter must
be in place at import. So is the filter of a deprecation warning Lightning's data loading triggers in newer torch
(`ignore_lightnings_pytree_deprecation`), which no user can act on.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any


class WarningWindow:
    """Ignores warnings whose message matches ``message`` (a regex matched at the start) between `open` and `close`."""

    def __init__(self, message: str) -> None:
        self.message = message
        self._entry: Any = None

    def open(self) -> None:
        if self._entry is None:
            warnings.filterwarnings("ignore", message=self.message)
            self._entry = warnings.filters[0]

    def close(self) -> None:
        if self._entry is not None:
            if self._entry in warnings.filters:
                warnings.filters.remove(self._entry)  # type: ignore[attr-defined]
                getattr(warnings, "_filters_mutated", lambda: None)()  # invalidate the per-module caches
            self._entry = None


class QuietFrozenModes:
    """LightningModule hooks that silence Lightning's "modules in eval mode" warning for a model trained in part.

    A model with a ``trainable`` selection other than ``("all",)`` keeps its frozen (BatchNorm) layers in eval
    mode by design, so that their statistics never move; Lightning warns about such modules at the start of
    training. Put this class before ``pl.LightningModule`` in the bases; the model sets ``self.trainable``.
    """

    trainable: tuple[str, ...]

    def on_fit_start(self) -> None:
        if "all" not in self.trainable:
            self._eval_mode_window().open()

    def on_train_start(self) -> None:
        self._eval_mode_window().close()

    def teardown(self, stage: str) -> None:
        self._eval_mode_window().close()

    def _eval_mode_window(self) -> WarningWindow:
        window = self.__dict__.get("_quiet_eval_mode")
        if window is None:
            window = WarningWindow(r"Found \d+ module\(s\) in eval mode at the start of training")
            self.__dict__["_quiet_eval_mode"] = window
        return window


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith("💡 Tip")


def drop_lightning_tips() -> None:
    """Drops Lightning's advertising tips (e.g. "💡 Tip: … litlogger …") from its rank-zero log (idempotent).

    Only records that start with "💡 Tip" on the logger Lightning's ``rank_zero_info`` writes to; every other line of
    Lightning's (devices, model summary, warnings) is kept. ``logging.getLogger`` only names the logger: this does not
    import Lightning.
    """
    log = logging.getLogger("pytorch_lightning.utilities.rank_zero")
    if not any(isinstance(f, _DropTips) for f in log.filters):
        log.addFilter(_DropTips())


def ignore_lightnings_pytree_deprecation() -> None:
    """Ignores the FutureWarning Lightning's own ``_pytree`` module triggers in newer torch (idempotent).

    "`isinstance(treespec, LeafSpec)` is deprecated": Lightning's CombinedLoader, which wraps every data loader, uses
    an API torch deprecated; the line comes once per run and names no file of the user's. Matched on the message and
    on Lightning's module that triggers it, so the same warning from any other code still shows.
    """
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"pytorch_lightning\.utilities\._pytree",
    )


drop_lightning_tips()
ignore_lightnings_pytree_deprecation()
