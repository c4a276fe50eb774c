"""Old name of `lightning_dp.pate.aggregator`, kept for one release: import from `lightning_dp.pate`."""

from lightning_dp.pate.aggregator import *  # noqa: F403
from lightning_dp.pate.aggregator import __all__ as _names

__all__ = list(_names)
