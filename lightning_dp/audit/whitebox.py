"""White-box step audit (Nasr et al. 2023, "Tight auditing"): a canary of known direction, every release observed.

The audit runs the library's own step machinery — Poisson sampling (`PoissonSampleSampler` /
`PoissonPatientSampler`), per-unit clipping (`clip_coefficients` / `clip_factor`), the sum over DDP
ranks, and the release that draws the noise and charges the ledger (`GaussianRelease`) — on a
fixed toy dataset, once with a canary unit and once without, for many independent runs at once
(each run is one row of the released tensor; the noise is i.i.d. per coordinate, so the rows are
independent runs of the same mechanism, charged once in the ledger as one run is).

The canary's raw contribution is ``10·C·e₀`` (clipping must bring it to C); the other units'
contributions are orthogonal to e₀ (``others="orthogonal"``), or, for full-batch runs,
``−10·C·e₀`` each (``others="opposed"``: a batch-size leak then shows). The auditor sees every
release, computes the likelihood-ratio score of "canary in" that the *configured* mechanism implies,
and turns the scores into an ε lower bound (Clopper–Pearson at a threshold chosen on a separate
split), beside the ε upper bound the accountant reports for the same ledger.

What it tests: that the noise drawn, the sampling rate, the clipping, the normalization and the DDP
reduction are what the accountant assumed. A bug in any of them that leaks more *can* make ε_lower
exceed ε_upper, but need not: ε_lower is a lower bound from one attack and finitely many runs, so a
leak that this attack does not score, or that is below its statistical resolution, passes. What it
does not test: the accept/reject decisions and the noisy-update selection (P3SGD with several noise
scales). A passing audit is not a proof of privacy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from lightning_dp.accounting import AccountantName, PrivacyLedger, get_accountant
from lightning_dp.audit.bounds import ThresholdBound, best_threshold, epsilon_gdp, epsilon_threshold
from lightning_dp.errors import PrivacyConfigError, check_count, check_finite_positive, check_sample_rate
from lightning_dp.sampling.patients import PoissonPatientSampler, secure_seed
from lightning_dp.sampling.samples import PoissonSampleSampler
from lightning_dp.sanitization.per_sample import clip_coefficients
from lightning_dp.sanitization.release import GaussianRelease, Release
from lightning_dp.sanitization.updates import clip_factor
from lightning_dp.schedules import NoiseSchedule, as_schedule

__all__ = ["StepAudit", "StepAuditResult"]

Level = Literal["sample", "patient"]
Others = Literal["orthogonal", "opposed"]

#: The canary's raw contribution is this many times the clip norm: clipping must bring it to C.
CANARY_SCALE = 10.0


@dataclass
class StepAuditResult:
    """What a white-box step audit measured (``passed``: the lower bound did not exceed the upper one)."""

    level: str
    epsilon_lower: float
    epsilon_upper: float
    epsilon_gdp: float
    mu_gdp: float
    delta: float
    significance: float
    accountant: str
    steps: int
    trials: int
    sample_rate: float
    bound: ThresholdBound
    in_scores: NDArray[np.float64] = field(repr=False)
    out_scores: NDArray[np.float64] = field(repr=False)

    @property
    def passed(self) -> bool:
        return self.epsilon_lower <= self.epsilon_upper

    @property
    def tightness(self) -> float:
        """ε_lower / ε_upper (1 is a perfectly tight audit)."""
        return self.epsilon_lower / self.epsilon_upper if self.epsilon_upper > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("in_scores", "out_scores", "bound")}
        out["bound"] = asdict(self.bound)
        out["passed"] = self.passed
        out["tightness"] = self.tightness
        out["kind"] = "white-box step audit"
        return out


class StepAudit:
    """Audits the private step of a configuration with a canary unit (sample or patient).

    Args:
        level: ``"sample"`` (DPSGD's per-sample clipping and sampler) or ``"patient"`` (P3SGD's).
        sample_rate: q of the configuration.
        noise_multiplier: z, or the configuration's `NoiseSchedule`.
        steps: T, the number of steps audited (every one is observed).
        clip_norm: C.
        population: the number of other units in the toy dataset.
        delta: the δ at which both ε are computed.
        accountant: the accountant whose ε is audited (``"rdp"`` or ``"prv"``).
        world_size: simulated DDP ranks (units split as the samplers split them; sums reduced; noise
            drawn from the shared generator on every rank, as the callbacks do).
        trials: runs per world (with and without the canary).
        significance: the bound holds with probability ≥ 1 − significance.
        others: ``"orthogonal"`` or ``"opposed"`` (needs q = 1); see the module docstring.
        dim: dimension of the toy updates (≥ 2).
        calibration: fraction of the runs used to choose the threshold (not used for the bound).
        seed: seeds the samplers and the noise (public; ``None`` draws one from the OS).
        progress: called with (world, step, steps) as the audit runs.

    Example:
        >>> audit = StepAudit(sample_rate=1.0, noise_multiplier=2.0, steps=4, trials=20_000, seed=0)
        >>> result = audit.run()
        >>> result.passed, result.epsilon_lower > 0.4 * result.epsilon_upper
        (True, True)
    """

    def __init__(
        self,
        *,
        level: Level = "sample",
        sample_rate: float,
        noise_multiplier: float | NoiseSchedule,
        steps: int,
        clip_norm: float = 1.0,
        population: int = 20,
        delta: float = 1e-5,
        accountant: AccountantName = "rdp",
        world_size: int = 1,
        trials: int = 100_000,
        significance: float = 0.05,
        others: Others = "orthogonal",
        dim: int = 4,
        calibration: float = 0.2,
        seed: int | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> None:
        owner = "StepAudit"
        if level not in ("sample", "patient"):
            raise PrivacyConfigError(f"`{owner}(level={level!r})`: level must be 'sample' or 'patient'.")
        if others not in ("orthogonal", "opposed"):
            raise PrivacyConfigError(f"`{owner}(others={others!r})`: others must be 'orthogonal' or 'opposed'.")
        self.level: Level = level
        self.sample_rate = check_sample_rate(owner, sample_rate)
        if others == "opposed" and self.sample_rate != 1.0:
            raise PrivacyConfigError(
                f"`{owner}(others='opposed', sample_rate={sample_rate})`: opposed units need a full batch (q = 1): "
                "with q < 1 their random count hides the canary. HINT: others='orthogonal'."
            )
        self.schedule = as_schedule(owner, noise_multiplier)
        self.steps = check_count(owner, "steps", steps, "e.g. 10.", minimum=1)
        self.clip_norm = check_finite_positive(owner, "clip_norm", clip_norm, "e.g. 1.0.")
        self.population = check_count(owner, "population", population, "e.g. 20.", minimum=1)
        self.delta = float(delta)
        if accountant not in ("rdp", "prv"):
            raise PrivacyConfigError(f"`{owner}(accountant={accountant!r})`: the audited accountant is 'rdp' or 'prv'.")
        self.accountant: AccountantName = accountant
        self.world_size = check_count(owner, "world_size", world_size, "1 process.", minimum=1)
        self.trials = check_count(owner, "trials", trials, "e.g. 100_000.", minimum=100)
        self.significance = float(significance)
        self.others: Others = others
        self.dim = check_count(owner, "dim", dim, "e.g. 4.", minimum=2)
        if not 0.0 < calibration < 1.0:
            raise PrivacyConfigError(f"`{owner}(calibration={calibration})`: must be in (0, 1), e.g. 0.2.")
        self.calibration = calibration
        self.seed = secure_seed("audit") if seed is None else int(seed)
        self.progress = progress

    # ------------------------------------------------------------------ the toy dataset
    @property
    def units(self) -> int:
        """Units in the "in" world: the canary (index 0) and the population."""
        return self.population + 1

    @property
    def normalizer(self) -> float:
        """n = q·N, the expected number of units per step (a public constant of the configuration)."""
        return self.sample_rate * self.units

    def raw_contributions(self) -> Tensor:
        """(units, dim) float64: each unit's contribution before clipping; the canary's is row 0."""
        g = torch.Generator().manual_seed(self.seed ^ 0x5EED)
        raw = torch.zeros(self.units, self.dim, dtype=torch.float64)
        raw[0, 0] = CANARY_SCALE * self.clip_norm
        if self.others == "opposed":
            raw[1:, 0] = -CANARY_SCALE * self.clip_norm
        else:
            directions = torch.randn(self.population, self.dim - 1, generator=g, dtype=torch.float64)
            norms = torch.empty(self.population, dtype=torch.float64).uniform_(0.2, 3.0, generator=g)
            raw[1:, 1:] = directions / directions.norm(dim=1, keepdim=True) * norms[:, None] * self.clip_norm
        return raw

    def clipped_contributions(self) -> Tensor:
        """Each unit's contribution clipped by the engine's own function."""
        raw = self.raw_contributions()
        norms = torch.linalg.vector_norm(raw, dim=1)
        if self.level == "sample":
            coeff = clip_coefficients(norms, self.clip_norm)
        else:
            coeff = torch.tensor([clip_factor(float(n), self.clip_norm)[0] for n in norms], dtype=torch.float64)
        return raw * coeff[:, None]

    # ------------------------------------------------------------------ the mechanism
    def _membership(self, world: str) -> Callable[[int], Tensor]:
        """step → (trials, units) bool: which units each run's step samples, by the engine's own sampler."""
        total = self.trials * self.units
        seed = self.seed + (1 if world == "in" else 2)
        if self.level == "sample":
            sampler = PoissonSampleSampler(total, self.sample_rate, seed=seed)

            def sample(step: int) -> Tensor:
                return _mask(sampler.indices(step), total).view(self.trials, self.units)

        else:
            patients = PoissonPatientSampler(total, self.sample_rate, seed=seed)

            def sample(step: int) -> Tensor:
                return _mask(patients.sample(), total).view(self.trials, self.units)

        return sample

    def _releases(self, world: str) -> list[Release]:
        """One release per rank, all with the shared seed (as the callbacks broadcast it)."""
        seed = self.seed + (11 if world == "in" else 12)
        return [
            GaussianRelease(
                PrivacyLedger(self.level, self.delta),
                clip_norm=self.clip_norm,
                sample_rate=self.sample_rate,
                schedule=self.schedule,
                seed=seed,
            )
            for _ in range(self.world_size)
        ]

    def release_step(self, step: int, local_sums: list[Tensor], counts: Tensor, releases: list[Release]) -> Tensor:
        """The step's release as rank 0 sees it, (trials, dim): Σ over ranks, then noise + charge on every rank.

        ``counts`` is the realized number of units per run (not used by a correct step: it normalizes by
        the expected count).
        """
        reduced = torch.stack(local_sums).sum(dim=0)
        updates = [r.release(step, reduced.flatten(), self.normalizer).update for r in releases]
        for other in updates[1:]:
            if not torch.equal(other, updates[0]):
                raise AssertionError("`StepAudit`: ranks released different updates (their noise differs).")
        return updates[0].view(self.trials, self.dim)

    def simulate(self, world: Literal["in", "out"]) -> tuple[NDArray[np.float64], PrivacyLedger]:
        """The auditor's score of every run in one world, and rank 0's ledger."""
        clipped = self.clipped_contributions()
        ranks = [torch.arange(r, self.units, self.world_size) for r in range(self.world_size)]
        sample = self._membership(world)
        releases = self._releases(world)
        offset = self.population if self.others == "opposed" else 0.0
        scores = torch.zeros(self.trials, dtype=torch.float64)
        q = self.sample_rate
        for step in range(self.steps):
            mask = sample(step)
            if world == "out":
                mask[:, 0] = False  # the canary is not in this dataset
            local = [mask[:, idx].to(torch.float64) @ clipped[idx] for idx in ranks]
            update = self.release_step(step, local, mask.sum(dim=1), releases).to(torch.float64)
            # In units of the canary's clipped contribution: N(b, z²) with b = 1 iff the canary was sampled.
            y = update[:, 0] * self.normalizer / self.clip_norm + offset
            z = self.schedule.checked(step)
            log_in = (2 * y - 1) / (2 * z * z)
            scores += log_in if q >= 1.0 else torch.logaddexp(torch.full_like(y, math.log1p(-q)), math.log(q) + log_in)
            if self.progress is not None:
                self.progress(world, step + 1, self.steps)
        ledgers = [r.ledger for r in releases]
        if any(ledger.entries != ledgers[0].entries for ledger in ledgers[1:]):
            raise AssertionError("`StepAudit`: ranks charged different ledgers.")
        return scores.numpy(), ledgers[0]

    # ------------------------------------------------------------------ the audit
    def run(self) -> StepAuditResult:
        """Both worlds, the threshold chosen on the calibration split, the bound on the rest."""
        in_scores, ledger = self.simulate("in")
        out_scores, _ = self.simulate("out")
        cut = int(self.trials * self.calibration)
        threshold, direction = best_threshold(
            in_scores[:cut], out_scores[:cut], delta=self.delta, significance=self.significance
        )
        bound = epsilon_threshold(
            in_scores[cut:],
            out_scores[cut:],
            threshold,
            delta=self.delta,
            significance=self.significance,
            direction=direction,
        )
        mu, eps_gdp = epsilon_gdp(bound, self.delta)
        upper = get_accountant(self.accountant).epsilon(ledger, self.delta)
        return StepAuditResult(
            level=self.level,
            epsilon_lower=bound.epsilon,
            epsilon_upper=float(upper),
            epsilon_gdp=eps_gdp,
            mu_gdp=mu,
            delta=self.delta,
            significance=self.significance,
            accountant=self.accountant,
            steps=self.steps,
            trials=self.trials,
            sample_rate=self.sample_rate,
            bound=bound,
            in_scores=in_scores,
            out_scores=out_scores,
        )


def _mask(indices: Tensor, total: int) -> Tensor:
    mask = torch.zeros(total, dtype=torch.bool)
    mask[indices] = True
    return mask
