"""`PrivacyBudget`: a hard stop before the step that would exceed a target ε."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_info
from typing_extensions import override

from lightning_dp.accounting import Accountant, PrivacyEvent, PrivacyLedger, get_accountant
from lightning_dp.accounting.accountants import AccountantName
from lightning_dp.errors import PrivacyConfigError, check_finite_positive, check_in_interval

__all__ = ["PrivacyBudget"]


class PrivacyBudget(pl.Callback):
    """Stops training *before* the step (round) whose ε would exceed ``target_epsilon``.

    The DP callback asks `allows` before every step with the most expensive event that step can
    be charged; if the answer is no, the step is not taken — no noise, no update, no charge — and
    the trainer stops. The reason is logged and kept in ``stop_reason``.

    Args:
        target_epsilon: the budget ε.
        delta: the δ of the budget; the DP callback's ledger uses it. ``None``: the DP callback's δ.
        accountant: which accountant decides. ``None`` (default): the DP callback's own accountant, the
            one it calibrates with and logs — so the run stops where the logged ε says it should.
            Name one (``rdp``, ``prv``, ``moments``) to budget with another on purpose.

    Example:
        >>> from lightning_dp.accounting import GaussianEvent, PoissonSampledEvent
        >>> budget = PrivacyBudget(target_epsilon=1.0, delta=1e-5)
        >>> ledger = PrivacyLedger("patient", 1e-5)
        >>> budget.allows(ledger, PoissonSampledEvent(0.01, GaussianEvent(1.0)))
        True
    """

    def __init__(
        self, target_epsilon: float, delta: float | None = None, accountant: AccountantName | None = None
    ) -> None:
        self.target_epsilon = check_finite_positive("PrivacyBudget", "target_epsilon", target_epsilon, "e.g. 8.0.")
        self.delta = (
            None
            if delta is None
            else check_in_interval(
                "PrivacyBudget", "delta", delta, 0.0, 1.0, low_closed=False, high_closed=False, hint="e.g. 1e-5."
            )
        )
        self.accountant: Accountant | None = None if accountant is None else get_accountant(accountant)
        self.stop_reason: str | None = None

    def allows(self, ledger: PrivacyLedger, next_event: PrivacyEvent, default: Accountant | None = None) -> bool:
        """Whether recording ``next_event`` keeps ε ≤ target (for the ledger's unit and δ).

        ``default`` is the DP callback's accountant, used unless this budget names its own (else RDP).
        """
        accountant = self.accountant or default or get_accountant("rdp")
        trial = ledger.copy()
        trial.record(next_event)
        eps_next = accountant.epsilon(trial)
        if eps_next <= self.target_epsilon:
            return True
        self.stop_reason = (
            f"PrivacyBudget: stopped before step {ledger.steps + 1}: it would raise ε [{accountant.name}, "
            f"unit={ledger.unit}, δ={ledger.delta:.3g}] from {accountant.epsilon(ledger):.4f} to {eps_next:.4f}, "
            f"above the target {self.target_epsilon:g}."
        )
        rank_zero_info(self.stop_reason)
        return False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        engines = [cb for cb in trainer.callbacks if hasattr(cb, "attach_budget")]  # type: ignore[attr-defined]
        if not engines:
            raise PrivacyConfigError(
                "`PrivacyBudget`: no DP training callback (P3SGD, DPSGD) in the Trainer's callbacks, so nothing "
                "would be stopped. HINT: add the DP callback next to PrivacyBudget."
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"stop_reason": self.stop_reason}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.stop_reason = state_dict.get("stop_reason")
