"""The one private step both engines share: release → apply → accept or restore (plain torch, no Lightning).

`PrivateStep` is what `DPSGD` and `P3SGD` (and a loop without a Trainer) call once their clipping is
done: per sample for DPSGD, per patient for P3SGD. It keeps the three invariants of the design:

1. Noise is drawn and the ledger charged in one call (`Release.release`); what a budget checks before
   the step (`PrivateStep.event`) is, by construction, what the step charges.
2. A rejected step has still been charged; its rollback restores everything the proposal changed
   (`UpdateTarget.restore`: parameters, buffers, optimizer and LR-scheduler state) bit for bit.
3. The decision sees only a public energy or a private one released with noise and charged with the
   step (`StepAcceptance`, `EnergyNoise`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_dp.acceptance.rules import AlwaysAccept, StepAcceptance
from lightning_dp.accounting import PrivacyEvent
from lightning_dp.errors import PrivacyConfigError
from lightning_dp.sanitization.release import Release, StepRelease
from lightning_dp.sanitization.updates import ModelState

__all__ = ["ModelStateTarget", "OptimizerTarget", "PrivateStep", "StepResult", "UpdateTarget", "clip_energy"]


class UpdateTarget(Protocol):
    """Where a released update goes, and how to take it back."""

    def snapshot(self) -> object:
        """Everything `apply` may change, copied."""
        ...

    def apply(self, update: Tensor) -> None:
        """Applies the released (noised) update."""
        ...

    def restore(self, snapshot: object) -> None:
        """Puts back what `snapshot` saved, bit for bit."""
        ...


class OptimizerTarget:
    """DPSGD's target: the released gradient goes to the module's optimizer (and its step-interval LR schedulers).

    Args:
        module: the model (its parameters and float buffers are snapshotted).
        params: the parameters the update is laid out over, in order.
        optimizers: the optimizers to step (only the released gradient reaches them).
        step_schedulers: called after the optimizer step (LR schedulers with a step interval).
        schedulers: LR schedulers whose state a rejection restores.
        step_optimizers: steps the optimizers (the callback routes this through Lightning's step counter).
    """

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[nn.Parameter],
        optimizers: Sequence[torch.optim.Optimizer],
        step_optimizers: Callable[[], None],
        step_schedulers: Callable[[], None] = lambda: None,
        schedulers: Sequence[Any] = (),
    ) -> None:
        self.module = module
        self.params = list(params)
        # Lightning hands out wrappers that copy the optimizer's attributes: state is read from and loaded into
        # the wrapped optimizer itself, or a restore would only reach the wrapper's copy.
        self.optimizers = [getattr(o, "optimizer", o) for o in optimizers]
        self.step_optimizers = step_optimizers
        self.step_schedulers = step_schedulers
        self.schedulers = list(schedulers)

    def snapshot(self) -> object:
        with torch.no_grad():
            tensors = [t.detach().clone() for t in _state_tensors(self.module)]
        return (
            tensors,
            [copy.deepcopy(o.state_dict()) for o in self.optimizers],
            [copy.deepcopy(s.state_dict()) for s in self.schedulers],
        )

    def apply(self, update: Tensor) -> None:
        released = {id(p) for p in self.params}
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if id(param) not in released:
                        param.grad = None  # only the released, noised gradient may reach the optimizer
        offset = 0
        for param in self.params:
            n = param.numel()
            param.grad = update[offset : offset + n].view_as(param).to(param.dtype)
            offset += n
        self.step_optimizers()
        self.step_schedulers()

    def restore(self, snapshot: object) -> None:
        assert isinstance(snapshot, tuple)
        tensors: list[Tensor] = snapshot[0]
        optimizer_states: list[dict[str, Any]] = snapshot[1]
        scheduler_states: list[dict[str, Any]] = snapshot[2]
        with torch.no_grad():
            for t, saved in zip(_state_tensors(self.module), tensors):
                t.copy_(saved)
        for optimizer, state in zip(self.optimizers, optimizer_states):
            optimizer.load_state_dict(state)
        for scheduler, state in zip(self.schedulers, scheduler_states):
            scheduler.load_state_dict(state)


def _state_tensors(module: nn.Module) -> list[Tensor]:
    return [p.data for p in module.parameters()] + list(module.buffers())


class ModelStateTarget:
    """P3SGD's target: θ_{t+1} = θ_t + server_lr·Δ̃ on the released tensors; other buffers kept.

    Args:
        state: the module's released tensors (`ModelState`), refreshed by the caller for the round.
        theta: θ_t, as read at the start of the round.
        other_buffers: the buffers that are not released, as at the start of the round.
        server_lr: the server learning rate.
    """

    def __init__(self, state: ModelState, theta: Tensor, other_buffers: list[Tensor], server_lr: float) -> None:
        self.state = state
        self.theta = theta
        self.other_buffers = other_buffers
        self.server_lr = server_lr

    def snapshot(self) -> object:
        return None  # θ_t and the other buffers are already held, unchanged, by this target

    def apply(self, update: Tensor) -> None:
        self.state.load(self.theta, self.other_buffers, add=update, alpha=self.server_lr)

    def restore(self, snapshot: object) -> None:
        self.state.load(self.theta, self.other_buffers)


def clip_energy(changes: Tensor, clip: float) -> Tensor:
    """Each unit's loss change in [−C_E, C_E]; a non-finite change (a NaN image, inf − inf) counts as +C_E.

    Like every other per-unit value that is released, a non-finite one must not change what happens: a
    NaN carried into the noisy energy would abort the step only when that unit is sampled.

    Example:
        >>> clip_energy(torch.tensor([0.25, -5.0, float("nan"), float("inf")]), 1.0).tolist()
        [0.25, -1.0, 1.0, 1.0]
    """
    changes = torch.nan_to_num(changes.double(), nan=clip, posinf=clip, neginf=-clip)
    return changes.clamp(-clip, clip)


@dataclass
class StepResult:
    """What a private step did: its release, whether it was kept, and the energy change it was judged by."""

    released: StepRelease
    accepted: bool
    energy_change: float | None


class PrivateStep:
    """One private step: release (noise + charge) → apply → accept or restore.

    Args:
        release: the step's release (its schedule holds the noise multiplier).
        acceptance: the accept/reject rule (default: keep every step).

    Example:
        >>> from lightning_dp.accounting import PrivacyLedger
        >>> from lightning_dp.sanitization import GaussianRelease
        >>> ledger = PrivacyLedger("sample", 1e-5)
        >>> step = PrivateStep(GaussianRelease(ledger, clip_norm=1.0, sample_rate=0.1, schedule=1.0, seed=0))
        >>> w = torch.zeros(3)
        >>> class Target:
        ...     def snapshot(self): return w.clone()
        ...     def apply(self, update): w.add_(update)
        ...     def restore(self, saved): w.copy_(saved)
        >>> result = step(0, torch.ones(3), 10.0, Target())
        >>> result.accepted, ledger.steps, step.event(1) == ledger.entries[0][0]
        (True, 1, True)
    """

    def __init__(self, release: Release, acceptance: StepAcceptance | None = None) -> None:
        self.release = release
        self.acceptance = acceptance or AlwaysAccept()

    def event(self, step: int) -> PrivacyEvent:
        """What ``step`` will be charged: the budget checks this before the step."""
        return self.release.event(step, self.acceptance.energy_noise)

    def __call__(
        self,
        step: int,
        clipped_sum: Tensor,
        normalizer: float,
        target: UpdateTarget,
        *,
        loss_of: Callable[[Tensor], float] | None = None,
        unit_losses: Callable[[], Tensor] | None = None,
        public_energy: Callable[[], float] | None = None,
        reduce: Callable[[Tensor], Tensor] = lambda t: t,
    ) -> StepResult:
        """Runs the step.

        Args:
            step: the step (0-based).
            clipped_sum: Σ of the clipped per-unit contributions (summed over ranks).
            normalizer: n, the expected number of units.
            target: where the update goes.
            loss_of: the round's loss for a candidate update (P3SGD's selection).
            unit_losses: the per-unit losses of this rank's units in the step's sample, at the current
                weights (a private energy: called before and after the update).
            public_energy: the loss on public data at the current weights (a public energy).
            reduce: sums a tensor over DDP ranks.
        """
        rule = self.acceptance
        before_units = before_public = None
        if rule.energy == "private":
            if unit_losses is None:
                raise PrivacyConfigError(f"`{rule!r}`: a private energy needs the step's per-unit losses.")
            before_units = unit_losses()
        elif rule.energy == "public":
            if public_energy is None:
                raise PrivacyConfigError(f"`{rule!r}`: a public energy needs a public loader.")
            before_public = public_energy()
        saved = target.snapshot() if rule.can_reject else None
        released = self.release.release(step, clipped_sum, normalizer, loss_of=loss_of, energy=rule.energy_noise)
        target.apply(released.update)
        change: float | None = None
        if before_units is not None:
            assert unit_losses is not None and released.noisy_energy is not None and rule.energy_noise is not None
            clipped = clip_energy(unit_losses() - before_units, rule.energy_noise.clip).sum()
            change = released.noisy_energy(float(reduce(clipped)))
        elif before_public is not None:
            assert public_energy is not None
            change = public_energy() - before_public
        accepted = rule.decide(change) if rule.can_reject else True
        if not accepted:
            target.restore(saved)
        return StepResult(released, accepted, change)
