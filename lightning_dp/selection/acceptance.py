"""Old name of `lightning_dp.acceptance.rules`, kept for one release: import from `lightning_dp.acceptance`."""

from lightning_dp.acceptance.rules import *  # noqa: F403
from lightning_dp.acceptance.rules import FORMAT_VERSION
from lightning_dp.acceptance.rules import __all__ as _names

__all__ = [*_names, "FORMAT_VERSION"]
