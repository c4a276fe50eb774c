"""A griffe extension for the API reference: read this project's ``Example:`` sections as examples.

The project's docstrings follow the Google style with ``Example:`` (singular, see the style guide);
griffe's Google parser knows only ``Examples:`` and would render the doctests as prose (``x[0]``
becomes a broken Markdown link). Renaming the section before parsing renders them as code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SINGULAR = re.compile(r"^(\s*)Example:[ \t]*$", flags=re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rewrites a docstring's ``Example:`` section header to ``Examples:`` when its object is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _SINGULAR.sub(r"\1Examples:", obj.docstring.value)
