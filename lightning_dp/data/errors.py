"""Errors raised by the data layer.

Both are rooted in built-ins (and `DataError` in `PrivacyConfigError`'s base, `ValueError`), so
``except ValueError`` catches a broken manifest just as it catches a bad argument.
"""

from __future__ import annotations

__all__ = ["DataError", "DataNotReadyError"]


class DataError(ValueError):
    """The data on disk (a manifest, an image, a split) is malformed or inconsistent.

    Example:
        >>> issubclass(DataError, ValueError)
        True
    """


class DataNotReadyError(RuntimeError):
    """A datamodule attribute was read before ``setup()`` built it.

    Example:
        >>> issubclass(DataNotReadyError, RuntimeError)
        True
    """
