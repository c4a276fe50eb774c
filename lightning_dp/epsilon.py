"""ε in one call, from whatever holds a ledger: a DP callback, a `PrivacyLedger` or a training checkpoint.

The counterpart of Opacus' ``privacy_engine.get_epsilon(delta)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from lightning_dp.accounting import PrivacyLedger, get_accountant
from lightning_dp.accounting.accountants import AccountantName
from lightning_dp.errors import PrivacyConfigError, PrivacyStateError

Source = Union["PrivacyLedger", str, Path, dict, Any]


def _ledger_of_checkpoint(checkpoint: dict[str, Any], where: str) -> PrivacyLedger:
    states = {
        key: state
        for key, state in checkpoint.get("callbacks", {}).items()
        if isinstance(state, dict) and isinstance(state.get("ledger"), dict)
    }
    if len(states) != 1:
        found = "no DP callback state" if not states else f"{len(states)} of them ({sorted(states)})"
        raise PrivacyStateError(
            f"`get_epsilon({where})`: expected the privacy state of one DP callback (P3SGD or DPSGD) in the "
            f"checkpoint, found {found}. HINT: pass a checkpoint written during trainer.fit with a DP callback, or "
            "the callback or its ledger."
        )
    ledger = PrivacyLedger("sample", 1e-5)
    ledger.load_state_dict(next(iter(states.values()))["ledger"])
    return ledger


def get_epsilon(source: Source, delta: float | None = None, accountant: AccountantName | None = None) -> float:
    """The ε that ``source``'s ledger has spent, at ``delta``, for the unit the ledger names.

    Args:
        source: a `P3SGD` or `DPSGD` callback (after or during fit), a `PrivacyLedger`, a training checkpoint
            (its path, or the dict ``torch.load`` gives) with one DP callback's state.
        delta: the δ to report ε at; ``None``: the ledger's own δ (the one the run was planned and logged with).
        accountant: ``"rdp"``, ``"prv"`` or ``"moments"``; ``None``: the callback's own accountant (the one
            behind ``privacy/epsilon`` and a `PrivacyBudget`), ``"rdp"`` for a ledger or a checkpoint.

    Raises:
        PrivacyStateError: a callback that has not trained yet, or a checkpoint without exactly one DP
            callback's privacy state.
        PrivacyConfigError: an unknown accountant or a δ outside (0, 1).

    Example:
        >>> from lightning_dp.accounting import GaussianEvent, PoissonSampledEvent
        >>> ledger = PrivacyLedger(unit="patient", delta=1e-5)
        >>> ledger.record(PoissonSampledEvent(0.1, GaussianEvent(1.0)), count=100)
        >>> round(get_epsilon(ledger), 2), round(get_epsilon(ledger, delta=1e-3), 2)
        (7.9, 5.64)
    """
    name: AccountantName | None = accountant
    if isinstance(source, PrivacyLedger):
        ledger = source
    elif isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise PrivacyConfigError(f"`get_epsilon({str(source)!r})`: no such file. HINT: pass a checkpoint's path.")
        import torch  # here, not at module level: `import lightning_dp` stays torch-free

        ledger = _ledger_of_checkpoint(torch.load(path, map_location="cpu", weights_only=False), repr(str(source)))
    elif isinstance(source, dict):
        ledger = _ledger_of_checkpoint(source, "checkpoint")
    elif hasattr(source, "ledger") and hasattr(source, "accountant"):
        if source.ledger is None:
            raise PrivacyStateError(
                f"`get_epsilon({type(source).__name__})`: the callback has no ledger yet: it is made when "
                "trainer.fit sets the callback up. HINT: call it after (or during) fit, or pass a checkpoint."
            )
        ledger = source.ledger
        name = name or source.accountant.name
    else:
        raise PrivacyConfigError(
            f"`get_epsilon`: cannot read a ledger from a {type(source).__name__}. HINT: pass a P3SGD or DPSGD "
            "callback, a PrivacyLedger, or a training checkpoint (path or dict)."
        )
    if delta is not None and delta != ledger.delta:
        at_delta = PrivacyLedger(ledger.unit, delta)  # checks δ
        for event, count in ledger.entries:
            at_delta.record(event, count)
        ledger = at_delta
    return float(get_accountant(name or "rdp").epsilon(ledger))
