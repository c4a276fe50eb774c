"""Black-box membership inference on final models trained through the private step.

Many small models are trained without a Trainer, each through the same `PrivateStep` as the
callbacks, on a fixed dataset plus canaries — mislabeled outliers, each included with probability ½.
The attacker sees only the final model and scores each canary by its negative loss (a loss-threshold
attack). Two privacy units (``level``):

* ``"sample"`` (DPSGD): a canary is one image. Training is DP-SGD: the library's
  `PoissonSampleSampler`, per-sample gradients of the tiny MLP from ``torch.func`` (fast at this
  size), `clip_coefficients`, the sum, `GaussianRelease` (ledger unit ``"sample"``).
* ``"patient"`` (P3SGD): a canary is a patient of ``images_per_patient`` images near one point, all
  with one wrong label, and it is scored by the mean negative loss over its images. Training is a
  P3SGD round: `PoissonPatientSampler`, each sampled patient's local SGD from θ_t over its own images
  (``local_steps`` full-batch steps; vectorized over patients with ``torch.func``), `ModelState`'s
  per-patient clipping (`clip_factor`, as `P3SGD` clips), the sum, `GaussianRelease` with the
  normalizer q·N_p (ledger unit ``"patient"``) and `ModelStateTarget`, θ_{t+1} = θ_t + Δ̃.
  Its round is its own: one ``vmap`` over the round's patients of a tiny MLP, 2.5 ms a round against 17 ms for the
  library's `lightning_dp.training.patient_rounds.StackedRound` on the same patients (26 patients × 4 images,
  10-64-10 MLP, one thread), which pays per patient for its own random streams and batches; thousands of rounds per
  audit make that the difference between seconds and minutes. The library's round itself is audited through the
  real `P3SGD` callback by `CallbackAudit` (white-box, every round path) and `SensitivityAudit`.
  ``training="sample"`` trains the same patients' images by *sample-level* DP-SGD instead and still
  attacks patients: its ε_upper is then the sample-level ε, which does not cover a patient (the
  point of patient-level DP: a patient's k images leak up to about k times more).

Two lower bounds on ε, for the canary's unit:

* **many runs** (Jagielski et al. 2020): one target canary per run (canary 0), its score in the runs
  that included it against the runs that did not; Clopper–Pearson at a threshold chosen on half of
  the runs, the bound computed on the other half;
* **one run** (Steinke, Nasr and Jagielski 2023): every canary of every run (a canary changes only its
  own run, so the runs together are one mechanism, DP for each canary), with the method's ceiling
  ln(r / ln(1/α)) for r guesses beside it.

``private=False`` trains the same models without clipping or noise: the attack must then find a
large ε_lower (it has teeth). A passing audit is a lower bound from one attack, not a proof.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

import numpy as np
import torch
import torch.nn.functional as F
from numpy.typing import NDArray
from torch import Tensor, nn

from lightning_dp.accounting import AccountantName, PrivacyLedger, get_accountant
from lightning_dp.audit.bounds import best_threshold, epsilon_one_run, epsilon_threshold, one_run_ceiling
from lightning_dp.errors import PrivacyConfigError, check_count, check_finite_positive, check_sample_rate
from lightning_dp.sampling.patients import PoissonPatientSampler, secure_seed
from lightning_dp.sampling.samples import PoissonSampleSampler
from lightning_dp.sanitization.per_sample import clip_coefficients
from lightning_dp.sanitization.release import GaussianRelease
from lightning_dp.sanitization.updates import ModelState
from lightning_dp.schedules import NoiseSchedule, as_schedule
from lightning_dp.training.step import ModelStateTarget, OptimizerTarget, PrivateStep

__all__ = ["MembershipAudit", "MembershipAuditResult"]

#: Classes of the toy task: a canary's random label is then wrong for a model that never saw it 9 times in 10.
CLASSES = 10
#: Spread of a canary patient's images around its point (the point itself has std 3 per feature).
CANARY_SPREAD = 0.5
SeedRole = Literal["model", "sampler", "noise"]
#: What each run seeds: its model's initialization, its sampler and its noise (see `MembershipAudit.run_seed`).
SEED_ROLES: tuple[SeedRole, ...] = get_args(SeedRole)

AuditLevel = Literal["sample", "patient"]


@dataclass
class MembershipAuditResult:
    """The two black-box lower bounds beside the accountant's ε (``inf`` for a non-private run).

    ``level`` is the unit of the canaries and of ε_lower; ``training`` the unit of the private step and of
    ε_upper. When they differ (patient canaries, sample-level DP-SGD), ``passed`` compares a patient-level
    lower bound with a sample-level guarantee: failing then shows what the sample-level ε does not cover.
    """

    private: bool
    level: str
    training: str
    images_per_patient: int
    epsilon_upper: float
    epsilon_many_runs: float
    epsilon_one_run: float
    one_run_guesses: int
    one_run_ceiling: float
    delta: float
    significance: float
    runs: int
    canaries: int
    in_scores: NDArray[np.float64] = field(repr=False)
    out_scores: NDArray[np.float64] = field(repr=False)

    @property
    def epsilon_lower(self) -> float:
        return max(self.epsilon_many_runs, self.epsilon_one_run)

    @property
    def passed(self) -> bool:
        return self.epsilon_lower <= self.epsilon_upper

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("in_scores", "out_scores")}
        out.update(epsilon_lower=self.epsilon_lower, passed=self.passed, kind="black-box membership inference")
        return out


class MembershipAudit:
    """Trains ``runs`` small models with ``canaries`` canaries each (in with probability ½) and attacks them.

    Args:
        private: train through the private step (else the same batches or rounds, no clipping or noise).
        level: the privacy unit audited: ``"sample"`` (a canary is one image, DPSGD) or ``"patient"`` (a
            canary is a patient with ``images_per_patient`` images, P3SGD rounds).
        training: the unit of the private step; default ``level``. ``level="patient", training="sample"``
            trains the patients' images by per-sample DP-SGD (ε_upper per sample) and attacks patients.
        images_per_patient: k, images of every patient (ordinary and canary); patient level only.
        local_steps: full-batch local SGD steps of a sampled patient per round (``training="patient"``).
        noise_multiplier: z, or a `NoiseSchedule`.
        sample_rate: q (of samples, or of patients for patient-level training).
        steps: steps (rounds) per model.
        clip_norm: C (per-sample gradient, or per-patient update Δ_i).
        lr: SGD learning rate; for patient-level training the local learning rate γ (server rate 1).
        runs: models trained.
        canaries: canaries per model (canary 0 is the many-runs target).
        population: ordinary training units per model (samples, or patients of k images; a fixed dataset
            shared by every run).
        features: input dimension of the toy task.
        hidden: width of the MLP's hidden layer.
        delta: as for `StepAudit`.
        accountant: as for `StepAudit`.
        significance: as for `StepAudit`.
        seed: public seed of the data, the coins, the samplers and the noise (``None``: from the OS); every
            generator of the audit gets its own seed derived from it (`run_seed`), no two alike.
        progress: called with (run, runs) after each model.

    Example:
        >>> audit = MembershipAudit(level="patient", images_per_patient=4, runs=4, canaries=4, population=8,
        ...                         features=4, hidden=8, steps=2, seed=0)
        >>> result = audit.run()
        >>> result.level, result.training, result.in_scores.size + result.out_scores.size  # runs × canaries
        ('patient', 'patient', 16)
    """

    def __init__(
        self,
        *,
        private: bool = True,
        level: AuditLevel = "sample",
        training: AuditLevel | None = None,
        images_per_patient: int = 8,
        local_steps: int = 1,
        noise_multiplier: float | NoiseSchedule = 1.0,
        sample_rate: float = 0.1,
        steps: int = 100,
        clip_norm: float = 1.0,
        lr: float = 1.0,
        runs: int = 16,
        canaries: int = 32,
        population: int = 128,
        features: int = 32,
        hidden: int = 128,
        delta: float = 1e-5,
        accountant: AccountantName = "rdp",
        significance: float = 0.05,
        seed: int | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        owner = "MembershipAudit"
        self.private = bool(private)
        if level not in ("sample", "patient"):
            raise PrivacyConfigError(
                f"`{owner}(level={level!r})`: level must be 'sample' or 'patient', found {level!r}. "
                "HINT: 'patient' audits what P3SGD promises."
            )
        training = level if training is None else training
        if training not in ("sample", "patient") or (level == "sample" and training == "patient"):
            raise PrivacyConfigError(
                f"`{owner}(level={level!r}, training={training!r})`: training must be 'sample' or 'patient', and "
                "'patient' needs level='patient'. HINT: leave training unset to train at the audited level."
            )
        self.level: AuditLevel = level
        self.training: AuditLevel = training
        self.images_per_patient = check_count(owner, "images_per_patient", images_per_patient, "e.g. 8.", minimum=1)
        self.local_steps = check_count(owner, "local_steps", local_steps, "e.g. 1.", minimum=1)
        self.schedule = as_schedule(owner, noise_multiplier)
        self.sample_rate = check_sample_rate(owner, sample_rate)
        self.steps = check_count(owner, "steps", steps, "e.g. 100.", minimum=1)
        self.clip_norm = check_finite_positive(owner, "clip_norm", clip_norm, "e.g. 1.0.")
        self.lr = check_finite_positive(owner, "lr", lr, "e.g. 1.0.")
        self.runs = check_count(owner, "runs", runs, "e.g. 64 (the many-runs bound needs both worlds).", minimum=4)
        self.canaries = check_count(owner, "canaries", canaries, "e.g. 32.", minimum=1)
        self.population = check_count(owner, "population", population, "e.g. 256.", minimum=1)
        self.features = check_count(owner, "features", features, "e.g. 10.", minimum=2)
        self.hidden = check_count(owner, "hidden", hidden, "e.g. 64.", minimum=1)
        self.delta = float(delta)
        if accountant not in ("rdp", "prv"):
            raise PrivacyConfigError(f"`{owner}(accountant={accountant!r})`: the audited accountant is 'rdp' or 'prv'.")
        self.accountant: AccountantName = accountant
        self.significance = float(significance)
        self.seed = secure_seed("audit") if seed is None else int(seed)
        self.progress = progress

    # ------------------------------------------------------------------ data
    def dataset(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(x, y) of the population, then (x, y) of the canaries of every run, shaped (runs, canaries, ...).

        At patient level every unit has a leading axis of ``images_per_patient`` images: x of the
        population is (population, k, features), of the canaries (runs, canaries, k, features).
        """
        g = torch.Generator().manual_seed(self.seed)
        if self.level == "sample":
            y = torch.randint(CLASSES, (self.population,), generator=g)
            centers = torch.randn(CLASSES, self.features, generator=g)
            x = centers[y] + 0.7 * torch.randn(self.population, self.features, generator=g)
            # Canaries: far-out points with random labels, unlike the task: only memorization fits them.
            cx = 3.0 * torch.randn(self.runs, self.canaries, self.features, generator=g)
            cy = torch.randint(CLASSES, (self.runs, self.canaries), generator=g)
            return x, y, cx, cy
        k = self.images_per_patient
        y = torch.randint(CLASSES, (self.population, k), generator=g)
        centers = torch.randn(CLASSES, self.features, generator=g)
        x = centers[y] + 0.7 * torch.randn(self.population, k, self.features, generator=g)
        # A canary patient: k images near one far-out point, all with one random label.
        points = 3.0 * torch.randn(self.runs, self.canaries, 1, self.features, generator=g)
        cx = points + CANARY_SPREAD * torch.randn(self.runs, self.canaries, k, self.features, generator=g)
        cy = torch.randint(CLASSES, (self.runs, self.canaries, 1), generator=g).expand(-1, -1, k)
        return x, y, cx, cy

    def coins(self) -> Tensor:
        """(runs, canaries) bool: which canaries each run includes (each with probability ½)."""
        g = torch.Generator().manual_seed(self.seed + 1)
        return torch.rand(self.runs, self.canaries, generator=g) < 0.5

    def run_seed(self, run: int, role: SeedRole) -> int:
        """The seed of ``run``'s ``role`` (one of `SEED_ROLES`): ``seed + 3·(run + 1) + k``, k the role's index.

        Distinct for every (run, role) and from the data's ``seed`` and the coins' ``seed + 1``, however many
        runs: two generators with one seed would draw the same stream (torch's global and per-object
        generators are the same algorithm), coupling one run's noise with another run's sampling or
        initialization.
        """
        return self.seed + len(SEED_ROLES) * (run + 1) + SEED_ROLES.index(role)

    # ------------------------------------------------------------------ training
    def _model(self, run: int) -> nn.Module:
        torch.manual_seed(self.run_seed(run, "model"))  # a public initialization
        return nn.Sequential(nn.Linear(self.features, self.hidden), nn.Tanh(), nn.Linear(self.hidden, CLASSES))

    def train(self, run: int, x: Tensor, y: Tensor, declared: int | None = None) -> tuple[nn.Module, PrivacyLedger]:
        """One model on (x, y); the ledger of what it was charged (empty when not private).

        At patient level x is (patients, k, features): trained by P3SGD rounds, or, with
        ``training="sample"``, its images by DP-SGD. ``declared``: N in the units x holds (patients at patient level),
        declared once for every run (the population and every canary), never the run's own count; default len(x).
        """
        declared = len(x) if declared is None else declared
        if self.level == "patient" and self.training == "patient":
            return self._train_patients(run, x, y, declared)
        per_unit = x.shape[1] if self.level == "patient" else 1
        return self._train_samples(run, x.reshape(-1, self.features), y.reshape(-1), declared * per_unit)

    def _private_step(self, ledger: PrivacyLedger, run: int) -> PrivateStep:
        """The run's private step: a Gaussian release at the configured clip, rate and noise, charged to ``ledger``."""
        release = GaussianRelease(
            ledger,
            clip_norm=self.clip_norm,
            sample_rate=self.sample_rate,
            schedule=self.schedule,
            seed=self.run_seed(run, "noise"),
        )
        return PrivateStep(release)

    def _train_samples(self, run: int, x: Tensor, y: Tensor, declared: int) -> tuple[nn.Module, PrivacyLedger]:
        model = self._model(run)
        ledger = PrivacyLedger("sample", self.delta)
        sampler = PoissonSampleSampler(len(x), self.sample_rate, seed=self.run_seed(run, "sampler"))
        optimizer = torch.optim.SGD(model.parameters(), lr=self.lr)
        normalizer = self.sample_rate * declared  # q·N with N declared, as DPSGD: never the run's own count
        params = dict(model.named_parameters())
        if self.private:
            step = self._private_step(ledger, run)
            target = OptimizerTarget(model, list(params.values()), [optimizer], step_optimizers=optimizer.step)

            def sample_loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
                out = torch.func.functional_call(model, p, (xi.unsqueeze(0),))
                return F.cross_entropy(out, yi.unsqueeze(0))

            per_sample = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0))
        for t in range(self.steps):
            idx = sampler.indices(t)
            if self.private:
                clipped = torch.zeros(sum(p.numel() for p in params.values()))
                if len(idx):
                    detached = {k: v.detach() for k, v in params.items()}
                    grads = per_sample(detached, x[idx], y[idx])
                    flat = torch.cat([g.reshape(len(idx), -1) for g in grads.values()], dim=1)
                    coeff = clip_coefficients(torch.linalg.vector_norm(flat.double(), dim=1), self.clip_norm)
                    clipped = (flat * coeff.float()[:, None]).sum(dim=0)
                step(t, clipped, normalizer, target)
            elif len(idx):
                optimizer.zero_grad()
                (F.cross_entropy(model(x[idx]), y[idx], reduction="sum") / normalizer).backward()
                optimizer.step()
        return model, ledger

    def _train_patients(self, run: int, x: Tensor, y: Tensor, declared: int) -> tuple[nn.Module, PrivacyLedger]:
        """P3SGD rounds (one noise scale, server rate 1) over patients x: (patients, k, features)."""
        model = self._model(run)
        ledger = PrivacyLedger("patient", self.delta)
        sampler = PoissonPatientSampler(len(x), self.sample_rate, seed=self.run_seed(run, "sampler"))
        normalizer = self.sample_rate * declared  # q·N_p with N declared, as P3SGD: never this run's own count
        state = ModelState(model)
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        step = None
        if self.private:
            step = self._private_step(ledger, run)

        def patient_loss(p: dict[str, Tensor], xs: Tensor, ys: Tensor) -> Tensor:
            return F.cross_entropy(torch.func.functional_call(model, p, (xs,)), ys)

        def local_update(p: dict[str, Tensor], xs: Tensor, ys: Tensor) -> dict[str, Tensor]:
            for _ in range(self.local_steps):  # local SGD from θ_t over this patient's images only
                grads = torch.func.grad(patient_loss)(p, xs, ys)
                p = {name: p[name] - self.lr * grads[name] for name in p}
            return p

        local = torch.func.vmap(local_update, in_dims=(None, 0, 0))
        for t in range(self.steps):
            idx = sampler.sample()
            theta, other = state.vector(), state.snapshot_other_buffers()
            total = torch.zeros_like(theta)
            if len(idx):
                start = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
                ends = local(start, x[idx], y[idx])
                flat = torch.cat([ends[name].reshape(len(idx), -1) for name in names], dim=1)
                if self.private:
                    for row in flat:  # P3SGD's own clipping: clip_C(θ_local − θ_t), added to the sum
                        state.load(row)
                        state.add_clipped_change(theta, total, self.clip_norm)
                    state.load(theta, other)
                else:
                    total = (flat - theta).sum(dim=0)
            if step is not None:
                step(t, total, normalizer, ModelStateTarget(state, theta, other, server_lr=1.0))
            else:
                state.load(theta + total / normalizer, other)
        return model, ledger

    # ------------------------------------------------------------------ the audit
    def run(self) -> MembershipAuditResult:
        x, y, cx, cy = self.dataset()
        coins = self.coins()
        scores = np.zeros((self.runs, self.canaries))
        ledger: PrivacyLedger | None = None
        for run in range(self.runs):
            keep = coins[run]
            # N declared once for every run: the population and all its canaries (a run holds those its coins kept).
            model, ledger = self.train(
                run, torch.cat([x, cx[run][keep]]), torch.cat([y, cy[run][keep]]), len(x) + len(cx[run])
            )
            with torch.no_grad():
                logits = model(cx[run])  # (canaries, [k,] classes)
                losses = F.cross_entropy(logits.reshape(-1, CLASSES), cy[run].reshape(-1), reduction="none")
            # A patient's score: the mean negative loss over its images.
            scores[run] = -losses.double().reshape(self.canaries, -1).mean(dim=1).numpy()
            if self.progress is not None:
                self.progress(run + 1, self.runs)
        assert ledger is not None
        inc = coins.numpy()
        # Many runs: the target canary (0) of each run; the threshold chosen on the first half of the runs.
        target, target_in = scores[:, 0], inc[:, 0]
        half = self.runs // 2
        many = 0.0
        first_in, first_out = target[:half][target_in[:half]], target[:half][~target_in[:half]]
        second_in, second_out = target[half:][target_in[half:]], target[half:][~target_in[half:]]
        if min(len(first_in), len(first_out), len(second_in), len(second_out)) > 0:
            threshold, direction = best_threshold(first_in, first_out, delta=self.delta, significance=self.significance)
            many = epsilon_threshold(
                second_in, second_out, threshold, delta=self.delta, significance=self.significance, direction=direction
            ).epsilon
        one, guesses = epsilon_one_run(scores[inc], scores[~inc], delta=self.delta, significance=self.significance)
        upper = get_accountant(self.accountant).epsilon(ledger, self.delta) if self.private else math.inf
        return MembershipAuditResult(
            private=self.private,
            level=self.level,
            training=self.training,
            images_per_patient=self.images_per_patient if self.level == "patient" else 1,
            epsilon_upper=float(upper),
            epsilon_many_runs=float(many),
            epsilon_one_run=float(one),
            one_run_guesses=int(guesses),
            one_run_ceiling=one_run_ceiling(guesses, self.significance) if guesses else 0.0,
            delta=self.delta,
            significance=self.significance,
            runs=self.runs,
            canaries=self.canaries,
            in_scores=scores[inc],
            out_scores=scores[~inc],
        )
