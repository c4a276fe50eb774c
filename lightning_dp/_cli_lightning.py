"""The LightningCLI half of ``lightning-dp`` (fit, validate, test, predict), kept apart from ``cli.py``.

Importing this module imports torch and Lightning (seconds), so ``lightning_dp.cli`` imports it only when one of
these commands runs: ``lightning-dp plan`` and ``lightning-dp --help`` never pay for it.

Two kinds of error are one line on stderr with exit status 2 instead of a traceback or a page of usage:

* an error of the library (every exception class of `lightning_dp.errors` and `lightning_dp.data.errors`), raised
  while the config is instantiated or during the run;
* a mistyped config key (``clip_nrom`` under a callback's ``init_args``, ``--model.init_args.lrr``,
  ``trainer: {max_stepz: ...}``): the class, the key and the closest valid key.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from typing import Any, NoReturn

from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

import lightning_dp.data.errors as data_errors
import lightning_dp.errors as core_errors
from lightning_dp._quiet import drop_lightning_tips

__all__ = ["LIBRARY_ERRORS", "library_error", "mistyped_key", "run_lightning"]

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


class _MistypedKey(Exception):
    """A config key no class accepts, summarized in one line (raised out of the parser, printed by `run_lightning`)."""


# jsonargparse's messages for a key nobody accepts: under a class_path's init_args (YAML or --model.init_args.x), in
# a section such as trainer (YAML), on the command line, or at the top of the config.
_CLASS_OPTION = re.compile(
    r"Problem with given class_path '(?P<cls>[\w.]+)':\s*Option '(?P<key>[\w.]+)' is not accepted"
)
_SECTION_OPTION = re.compile(r"(?:Subcommand '\w+'|Group '(?P<group>[\w.]+)') does not accept option '(?P<key>[\w.]+)'")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: --(?P<key>[\w.]+)")
_TOP_OPTION = re.compile(r"^Option '(?P<key>[\w.]+)' is not accepted")


def _closest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    return f"the valid ones are {', '.join(valid)}." if valid else "see --help."


def _class_arguments(class_path: str) -> tuple[str, list[str]] | None:
    """(the class's name, its constructor's named arguments) or None when the class cannot be imported."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        parameters = inspect.signature(cls).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return name, [p.name for p in parameters if p.kind in kinds]


#: The class behind a config section that is not a class_path (the others name their class in the config).
_SECTION_CLASSES = {"trainer": "Trainer"}


def _path_suggestion(path: str, parsers: list[Any]) -> str:
    """A key path no parser knows (``trainer.max_stepz``): where it goes wrong and the closest valid key there."""
    dests = sorted({str(a.dest) for p in parsers for a in getattr(p, "_actions", ()) if str(a.dest) != "help"})
    known = [d.split(".") for d in dests if not d.endswith(".help")]
    parts = path.split(".")
    for depth, part in enumerate(parts):
        prefix = parts[:depth]
        here = sorted({k[depth] for k in known if len(k) > depth and k[:depth] == prefix})
        if part in here:
            continue
        if depth == 0:
            return f"the config has no section or option '{part}' (in '{path}'). HINT: {_closest(part, here)}"
        section = ".".join(prefix)
        owner = _SECTION_CLASSES.get(section, section)
        return f"`{owner}` has no argument '{part}' (under {section}). HINT: {_closest(part, here)}"
    return f"'{path}' is not accepted here. HINT: see --help."


def mistyped_key(message: str, parsers: list[Any]) -> str | None:
    """One line for jsonargparse's message about a config key nobody accepts; None for other errors.

    Args:
        message: jsonargparse's error message (tens of lines for a key under a ``class_path``).
        parsers: the parsers whose options are the valid keys (the command's parser and its subcommands').

    Example:
        >>> message = "Problem with given class_path 'lightning_dp.accounting.PrivacyLedger': Option 'deltta' is not"
        >>> mistyped_key(message + " accepted", [])
        "`PrivacyLedger` has no argument 'deltta'. HINT: did you mean 'delta'?"
    """
    found = _CLASS_OPTION.search(message)
    if found is not None:
        key = found["key"].split(".")[-1]
        arguments = _class_arguments(found["cls"])
        if arguments is None:
            return f"`{found['cls']}` has no argument '{key}'. HINT: check the spelling of the class_path and the key."
        name, valid = arguments
        where = re.search(r"Parser key \"(?P<section>[\w.]+)\"", message)
        section = f" (under {where['section']})" if where else ""
        return f"`{name}` has no argument '{key}'{section}. HINT: {_closest(key, valid)}"
    for pattern in (_SECTION_OPTION, _UNRECOGNIZED, _TOP_OPTION):
        found = pattern.search(message)
        if found is not None:
            group = found.groupdict().get("group")
            path = f"{group}.{found['key']}" if group else found["key"]
            return _path_suggestion(path, parsers)
    return None


class _OneLineParser(LightningArgumentParser):
    """LightningCLI's parser, whose error for a mistyped key is one line (other errors: jsonargparse's own)."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        # Nested parsers (a class_path's init_args, tried against each type of a Union) raise instead of exiting;
        # their messages are collected into the top-level one, which is the one summarized.
        if self.exit_on_error and not os.environ.get("LIGHTNING_DP_TRACEBACK"):
            parsers: list[Any] = [self]
            sub = getattr(ex, "subcommand_parser", None)
            if sub is not None:
                parsers.append(sub)
            action = getattr(self, "_subcommands_action", None)
            if action is not None:
                parsers.extend(action.choices.values())
            line = mistyped_key(message, parsers)
            if line is not None:
                raise _MistypedKey(line) from ex
        super().error(message, ex)


class _CLI(LightningCLI):
    """LightningCLI whose default TensorBoard logger writes no ``hp_metric = -1`` (a placeholder, not a measurement).

    A config that names its own logger (or ``logger: false``) keeps what it asks for; the default logger's folder is
    the Trainer's ``default_root_dir``, as Lightning's own default would be.
    """

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.get("trainer")
        if trainer is not None and trainer.get("logger") in (None, True):
            trainer["logger"] = {
                "class_path": "pytorch_lightning.loggers.TensorBoardLogger",
                "init_args": {"save_dir": trainer.get("default_root_dir") or ".", "default_hp_metric": False},
            }


def run_lightning(argv: list[str] | None, command: str) -> int:
    """Runs LightningCLI on ``argv`` (None: it reads sys.argv); returns the exit status.

    Args:
        argv: the arguments after ``lightning-dp``; None when run from the console (LightningCLI reads sys.argv itself:
            given args as well, it warns that both were given).
        command: the subcommand, for the messages.
    """
    drop_lightning_tips()
    try:
        _CLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=argv,
            parser_kwargs={"prog": "lightning-dp"},
            parser_class=_OneLineParser,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
        )
    except _MistypedKey as err:
        print(f"lightning-dp {command}: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        ours = library_error(err)
        if ours is None or os.environ.get("LIGHTNING_DP_TRACEBACK"):
            raise
        print(f"lightning-dp {command}: error: {ours}\n{TRACEBACK_HINT}", file=sys.stderr)
        return 2
    return 0
