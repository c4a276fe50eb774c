"""PrivateStep without a Trainer: what it charges, what a rejection restores, and non-finite energies."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_dp.acceptance import AnnealedAcceptance, StepAcceptance, ThresholdAcceptance
from lightning_dp.accounting import (
    ComposedEvent,
    ExponentialMechanismEvent,
    GaussianEvent,
    PoissonSampledEvent,
    PrivacyLedger,
    PRVAccountant,
    RDPAccountant,
)
from lightning_dp.sanitization import GaussianRelease
from lightning_dp.training.step import OptimizerTarget, PrivateStep


class _Vector:
    def __init__(self) -> None:
        self.w = torch.zeros(3)

    def snapshot(self) -> torch.Tensor:
        return self.w.clone()

    def apply(self, update: torch.Tensor) -> None:
        self.w.add_(update)

    def restore(self, saved: object) -> None:
        assert isinstance(saved, torch.Tensor)
        self.w.copy_(saved)


def _step(rule: StepAcceptance) -> tuple[PrivateStep, PrivacyLedger]:
    ledger = PrivacyLedger("patient", 1e-5)
    return PrivateStep(GaussianRelease(ledger, clip_norm=1.0, sample_rate=0.1, schedule=1.0, seed=0), rule), ledger


@pytest.mark.parametrize(
    "make",
    [
        lambda: AnnealedAcceptance(q0=10.0, mu0=5, energy_clip=1.0, energy_noise_multiplier=1.0),
        lambda: ThresholdAcceptance(threshold=0.0, energy_clip=1.0, energy_noise_multiplier=1.0),
    ],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_unit_with_a_non_finite_loss_does_not_change_whether_the_step_completes(make, bad: float) -> None:  # type: ignore[no-untyped-def]
    # Found by review: NaN survived clamp(), the noisy energy was NaN and the rule raised — only in steps where
    # that unit was sampled, an output no charge covered. Its change now counts as a value in [−C_E, C_E].
    for present in (False, True):
        step, ledger = _step(make())
        losses = torch.tensor([0.5, 0.7] + ([bad] if present else []), dtype=torch.float64)
        result = step(0, torch.ones(3), 10.0, _Vector(), unit_losses=lambda losses=losses: losses)
        assert result.energy_change is not None and math.isfinite(result.energy_change)
        assert ledger.steps == 1


def test_the_energy_is_charged_with_the_step_and_every_proposal_counts() -> None:
    rule = ThresholdAcceptance(threshold=-1e9, energy_clip=0.5, energy_noise_multiplier=2.0)
    step, ledger = _step(rule)
    target = _Vector()
    for t in range(3):
        announced = step.event(t)
        result = step(t, torch.ones(3), 10.0, target, unit_losses=lambda: torch.zeros(4, dtype=torch.float64))
        assert not result.accepted and ledger.entries[-1][0] == announced
    assert torch.equal(target.w, torch.zeros(3)), "rejected steps leave the target as it was"
    assert ledger.steps == 3
    assert announced == PoissonSampledEvent(0.1, ComposedEvent((GaussianEvent(1.0), GaussianEvent(2.0))))


def test_optimizer_target_restores_parameters_optimizer_and_scheduler_bit_for_bit() -> None:
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    params = list(net.parameters())
    target = OptimizerTarget(net, params, [optimizer], optimizer.step, scheduler.step, [scheduler])
    target.apply(torch.ones(10))  # some history first
    saved = target.snapshot()
    before = [p.detach().clone() for p in params]
    state = {k: v.clone() for k, v in optimizer.state[params[0]].items()}
    target.apply(torch.randn(10))
    target.restore(saved)
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert all(torch.equal(state[k], optimizer.state[params[0]][k]) for k in state)
    assert scheduler.last_epoch == 1 and optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize("epsilon", [1500.0, 3000.0])
def test_a_selection_with_a_huge_epsilon_gives_a_valid_epsilon_not_a_crash(epsilon: float) -> None:
    # Found by review: the conditional sampling rate underflowed to 0 and log(0) raised.
    ledger = PrivacyLedger("patient", 1e-5)
    selection = ExponentialMechanismEvent(epsilon, 2)
    ledger.record(PoissonSampledEvent(0.1, ComposedEvent((GaussianEvent(1.0), selection))))
    rdp, prv = RDPAccountant().epsilon(ledger), PRVAccountant().epsilon(ledger)
    floor = selection.pure_epsilon + math.log(0.1)  # the subsampled selection alone, roughly
    assert rdp >= floor - 5 and prv >= floor - 5
