"""Old name of `lightning_dp.audit.callback_audit` (`CallbackAudit`), kept for one release.

"Engine" names the per-sample engine (`lightning_dp.sanitization.per_sample`); the white-box audit of the training
callback lives in `lightning_dp.audit.callback_audit`. Import `CallbackAudit` from `lightning_dp.audit`: this alias
is removed in the release after the next one.
"""

from lightning_dp.audit.callback_audit import *  # noqa: F403
from lightning_dp.audit.callback_audit import (
    NOISE_CHECK_SIGNIFICANCE,
    POWER,
    VERDICT_RULE,
    check_units,
    fit_world,
    gdp_mu_lower,
)
from lightning_dp.audit.callback_audit import __all__ as _names

__all__ = [*_names, "NOISE_CHECK_SIGNIFICANCE", "POWER", "VERDICT_RULE", "check_units", "fit_world", "gdp_mu_lower"]
