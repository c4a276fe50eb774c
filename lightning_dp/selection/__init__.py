"""Old name of `lightning_dp.acceptance` (the accept/reject rules), kept for one release.

The rules live in `lightning_dp.acceptance` (`lightning_dp/acceptance/rules.py`); this package re-exports
them, so ``class_path: lightning_dp.selection.AnnealedAcceptance`` in an older config still resolves to the
same class. Import from `lightning_dp.acceptance`: this alias is removed in the release after the next one.
"""

from lightning_dp.acceptance import *  # noqa: F403
from lightning_dp.acceptance import __all__ as _names

__all__ = list(_names)
