"""Empirical privacy audits: lower bounds on ε that a correct implementation must not exceed.

* `bounds`: ε lower bounds from attack scores (Clopper–Pearson, Gaussian-DP reading, one-run).
* `noise`: the white-box audit's noise checks (fresh at every lag; nowhere below the ledger's multiplier).
* `CallbackAudit` (`callback_audit`): the white-box audit of the code that trains — the user's own `DPSGD` or
  `P3SGD` callback fits a real model with and without a canary unit, every released update observed (`scenarios`
  has ready set-ups; `mutants` the planted bugs it is checked against).
* `SensitivityAudit`: the paired-world audit of coupling between units — the same seed in every world, so the
  noise cancels and one canary must move the clipped sum by its own clipped share alone (crafted cancelling samples,
  randomness drawn in processing order, shared clip groups).
* `StepAudit`: the simulated white-box step audit — the library's sampler, clip functions and release on toy
  contributions, for many runs at once (covers subsampling, q < 1, and DDP ranks).
* `FederatedAudit` (`federated`): the white-box audit of federated P3SGD through Flower's messages — a canary
  patient at one site, every released θ observed at the server; sensitivity, noise and sampling rate checked per
  round.
* `MembershipAudit`: black-box membership inference on final models trained through the private step.
* `OneRunAudit` (`one_run`): one P3SGD run with m ≥ 1,000 canary patients, each in by a secret coin; lower bounds by
  Steinke–Nasr–Jagielski and by the f-DP tail bound of Mahloujifar et al. (2025), scores joined to coins by patient id.
  `FederatedOneRunAudit` (`one_run_federated`): the same for federated P3SGD through Flower's messages, the canary
  patients spread over the sites (noise at the server, or shares at the sites); `LossOneRunAudit` (`one_run_loss`):
  the black-box one-run audit, input-space canary patients scored by the released model's loss alone.
"""

from lightning_dp.audit.blackbox import MembershipAudit, MembershipAuditResult
from lightning_dp.audit.bounds import *  # noqa: F403
from lightning_dp.audit.bounds import __all__ as _bounds
from lightning_dp.audit.callback_audit import CallbackAudit, CallbackAuditResult
from lightning_dp.audit.federated import FederatedAudit, FederatedAuditResult
from lightning_dp.audit.one_run import OneRunAudit, OneRunAuditResult, join_by_id, one_run_fdp
from lightning_dp.audit.one_run_federated import FederatedOneRunAudit
from lightning_dp.audit.one_run_loss import LossOneRunAudit
from lightning_dp.audit.sensitivity import SensitivityAudit, SensitivityAuditResult
from lightning_dp.audit.whitebox import StepAudit, StepAuditResult

__all__ = [
    *_bounds,
    "CallbackAudit",
    "CallbackAuditResult",
    "FederatedAudit",
    "FederatedAuditResult",
    "FederatedOneRunAudit",
    "LossOneRunAudit",
    "MembershipAudit",
    "MembershipAuditResult",
    "OneRunAudit",
    "OneRunAuditResult",
    "SensitivityAudit",
    "SensitivityAuditResult",
    "StepAudit",
    "StepAuditResult",
    "join_by_id",
    "one_run_fdp",
]
