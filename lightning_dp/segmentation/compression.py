"""Old name of `lightning_dp.pate.compression`, kept for one release: import from `lightning_dp.pate`."""

from lightning_dp.pate.compression import *  # noqa: F403
from lightning_dp.pate.compression import __all__ as _names

__all__ = list(_names)
