"""Empirical privacy audits: lower bounds on ε that a correct implementation must not exceed.

* `bounds`: ε lower bounds from attack scores (Clopper–Pearson, Gaussian-DP reading, one-run).
* `StepAudit`: the white-box step audit — a canary of known direction, every release observed.
* `MembershipAudit`: black-box membership inference on final models trained through the private step.
"""

from lightning_dp.audit.blackbox import MembershipAudit, MembershipAuditResult
from lightning_dp.audit.bounds import (
    ThresholdBound,
    best_threshold,
    clopper_pearson,
    epsilon_gdp,
    epsilon_one_run,
    epsilon_threshold,
    gdp_epsilon,
    one_run_ceiling,
    one_run_p_value,
)
from lightning_dp.audit.whitebox import StepAudit, StepAuditResult

__all__ = [
    "MembershipAudit",
    "MembershipAuditResult",
    "StepAudit",
    "StepAuditResult",
    "ThresholdBound",
    "best_threshold",
    "clopper_pearson",
    "epsilon_gdp",
    "epsilon_one_run",
    "epsilon_threshold",
    "gdp_epsilon",
    "one_run_ceiling",
    "one_run_p_value",
]
