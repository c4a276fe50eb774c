"""A black-box one-run audit of P3SGD: input-space canary patients, each scored by the released model's loss.

`LossOneRunAudit` is the black-box sibling of `lightning_dp.audit.one_run.OneRunAudit`: the same secret coins (m canary
patients, each in the training data by an independent fair coin seeded from the OS CSPRNG unless ``coin_seed`` is
given), the same real `P3SGD` callback (Poisson sampler, local SGD per patient, per-patient clip, `GaussianRelease`,
ledger, accountant, the public N declared), the same join by id and the same three bounds (SNJ, f-DP (ε, δ), GDP;
`_OneRunDesign`). What differs is what the auditor may do:

* **Canaries in input space.** A canary is a patient whose ``images_per_patient`` images are one distinctive image: a
  random ±1 pattern over the ``input_dim`` pixels with a random label of the ``classes`` (public, drawn from
  ``design_seed``; only the coins are secret). Nothing about the model, the loss weight or the gradient is chosen for
  it: the canary's update is whatever local SGD makes of its images (clipped to C by P3SGD like anyone's).
* **Ordinary patients beside them.** ``population`` patients of a public synthetic task (``classes`` Gaussian
  clusters, class means of ``population_signal`` per pixel, unit noise) train in every world; they are not audited.
* **Loss scores only.** The auditor never reads θ's coordinates or a gradient: canary i's score is the drop of its
  loss between the public initial model and the released one, s_i = ℓ(θ_0; x_i, y_i) − ℓ(θ_T; x_i, y_i) (two
  black-box queries per canary; θ_0 is public, the initialization is seeded from ``design_seed``). Subtracting the
  initial loss removes the spread that the random initialization gives the canaries' losses; with ``hidden=0``
  (a linear model starting at 0) it is a constant.

The model is a one-hidden-layer MLP (``hidden`` ReLU units; ``hidden=0``: a linear layer starting at 0). Its bounds
are lower bounds on the run's ε like `OneRunAudit`'s (the bounds hold for any scores); a loss sees less of the run
than the released θ does, and the gap is what black-box access costs on this design: the other patients' updates
move every canary's loss by amounts that have nothing to do with its coin, and so do the other canaries' (their
patterns are not orthogonal), while the canary's own update reaches its loss only through the last iterate.
docs/results/audit.md ("One run, at patient level") measures it. The same cost limits what the scores can catch: a
planted bug that adds a quarter of the noise the ledger charges is caught at m = 1,000 on the default design
(4,096-pixel canaries beside 1,000 population patients; tests/unit/audit/test_one_run_loss.py), and passes beside the
same population with 1,024-pixel canaries, whose losses the population's updates move more.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_dp.audit.callback_audit import _flat, fit_world
from lightning_dp.audit.one_run import OneRunAuditResult, _OneRunDesign
from lightning_dp.errors import PrivacyStateError, PrivacyWarning, check_count, check_finite_positive

__all__ = ["LossOneRunAudit"]


class _Patients(Dataset[tuple[Tensor, Tensor, Tensor]]):
    """The population's patients and the included canary patients, as P3SGD reads them (``patient_to_indices``).

    Population patient j's images are ``population[j]`` (k, d); canary patient ``ids[c]``'s k images are all
    ``patterns[rows[c]]``. Items are (image, label, loss weight 1).
    """

    def __init__(
        self,
        population: Tensor,
        population_labels: Tensor,
        patterns: Tensor,
        labels: Tensor,
        ids: list[str],
        rows: list[int],
        images: int,
    ) -> None:
        self.population, self.population_labels = population, population_labels
        self.patterns, self.labels = patterns, labels
        self.images = images
        self.units: list[tuple[bool, int]] = [(False, j) for j in range(len(population))]
        self.units += [(True, r) for r in rows]
        names = [f"patient-{j}" for j in range(len(population))] + list(ids)
        self.patient_to_indices = {name: list(range(u * images, (u + 1) * images)) for u, name in enumerate(names)}
        self.num_patients = len(names)
        self.one = torch.tensor(1.0)

    def __len__(self) -> int:
        return len(self.units) * self.images

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        canary, row = self.units[i // self.images]
        if canary:
            return self.patterns[row], self.labels[row], self.one
        return self.population[row, i % self.images], self.population_labels[row], self.one


class LossOneRunAudit(_OneRunDesign):
    """One P3SGD run with m input-space canary patients, scored by the released model's loss; three ε lower bounds.

    Args:
        canaries: m, the number of canary patients.
        images_per_patient: images of each patient, canary or not (one local mini-batch).
        steps: T, the rounds of the run.
        noise_multiplier: z; or None with ``target_epsilon``.
        target_epsilon: calibrate z so that the run's printed ε is this (the callback's accountant, at δ).
        sample_rate: q of the callback (1.0, the default, is the tightest audit).
        clip_norm: C.
        delta: δ of the ledger and of every bound.
        accountant: the callback's accountant (``"rdp"`` or ``"prv"``): it prints ε_printed.
        significance: each bound holds with probability ≥ 1 − significance.
        coin_seed: seeds the coins; None (default) draws the seed from the OS CSPRNG (`secure_seed`).
        seed: seeds the callback's sampler and noise; None draws them from the OS CSPRNG.
        input_dim: d, the pixels of an image (4,096: a 64×64 grey image).
        classes: the labels of the task.
        hidden: the MLP's hidden ReLU units; 0: a linear model starting at 0.
        population: the ordinary patients trained beside the canaries (declared N = population + m).
        population_signal: the population's class means, per pixel (their images add unit Gaussian noise).
        local_lr: the local SGD's rate.
        server_lr: θ_{t+1} = θ_t + server_lr·Δ̃ (P3SGD's ``server_lr``).
        design_seed: seeds everything public: the canaries' patterns and labels, the population, the initial model.

    Example:
        >>> audit = LossOneRunAudit(canaries=1000, steps=2, target_epsilon=8.0, coin_seed=0, seed=0)
        >>> result = audit.run()  # doctest: +SKIP
        >>> result.passed, result.scoring  # doctest: +SKIP
        (True, 'loss')
    """

    owner = "LossOneRunAudit"

    def __init__(
        self,
        *,
        canaries: int = 1000,
        images_per_patient: int = 4,
        steps: int = 4,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        sample_rate: float = 1.0,
        clip_norm: float = 1.0,
        delta: float = 1e-5,
        accountant: Literal["rdp", "prv"] = "rdp",
        significance: float = 0.05,
        coin_seed: int | None = None,
        seed: int | None = None,
        input_dim: int = 4096,
        classes: int = 10,
        hidden: int = 64,
        population: int = 1000,
        population_signal: float = 0.1,
        local_lr: float = 0.1,
        server_lr: float = 10.0,
        design_seed: int = 0,
    ) -> None:
        super().__init__(
            canaries=canaries,
            images_per_patient=images_per_patient,
            steps=steps,
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            sample_rate=sample_rate,
            clip_norm=clip_norm,
            delta=delta,
            accountant=accountant,
            significance=significance,
            coin_seed=coin_seed,
            seed=seed,
            local_lr=local_lr,
        )
        owner = self.owner
        self.input_dim = check_count(owner, "input_dim", input_dim, "e.g. 1024 pixels.", minimum=1)
        self.classes = check_count(owner, "classes", classes, "e.g. 10.", minimum=2)
        self.hidden = check_count(owner, "hidden", hidden, "e.g. 64 (0: a linear model).", minimum=0)
        self.population = check_count(owner, "population", population, "e.g. 1000 patients (0: none).", minimum=0)
        self.population_signal = check_finite_positive(owner, "population_signal", population_signal, "e.g. 0.1.")
        self.server_lr = check_finite_positive(owner, "server_lr", server_lr, "e.g. 10.")
        self.design_seed = int(design_seed)

    # ------------------------------------------------------------------ the public design
    def _generator(self, purpose: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.design_seed * 1000 + purpose)

    def canary_images(self) -> tuple[Tensor, Tensor]:
        """(patterns, labels): canary i's image, a random ±1 pattern (m, d), and its random label (public)."""
        generator = self._generator(1)
        patterns = torch.randint(0, 2, (self.canaries, self.input_dim), generator=generator).float().mul_(2).sub_(1)
        labels = torch.randint(0, self.classes, (self.canaries,), generator=generator)
        return patterns, labels

    def class_means(self) -> Tensor:
        """The population task's class means (classes, d): ``population_signal`` times standard normals (public)."""
        return torch.randn(self.classes, self.input_dim, generator=self._generator(2)) * self.population_signal

    def population_images(self, patients: int, purpose: int = 3) -> tuple[Tensor, Tensor]:
        """(images (patients, k, d), labels): draws of the population task, each patient one class (public)."""
        generator = self._generator(purpose)
        labels = torch.randint(0, self.classes, (patients,), generator=generator)
        noise = torch.randn(patients, self.images_per_patient, self.input_dim, generator=generator)
        return self.class_means()[labels][:, None, :] + noise, labels

    def model(self) -> nn.Module:
        """The audited model (public initialization): an MLP with ``hidden`` ReLU units, or a linear layer at 0."""
        if self.hidden == 0:
            linear = nn.Linear(self.input_dim, self.classes)
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)
            return linear
        with torch.random.fork_rng():
            torch.manual_seed(self.design_seed)
            return nn.Sequential(
                nn.Linear(self.input_dim, self.hidden), nn.ReLU(), nn.Linear(self.hidden, self.classes)
            )

    def callback(self) -> Any:
        """The P3SGD callback as configured (N declared as population + m)."""
        from lightning_dp.callbacks.p3sgd import P3SGD

        return P3SGD(
            sample_rate=self.sample_rate,
            clip_norm=self.clip_norm,
            noise_scales=(self.noise_multiplier,),
            local_lr=self.local_lr,
            local_batch_size=self.images_per_patient,
            server_lr=self.server_lr,
            delta=self.delta,
            accountant=self.accountant,
            seed=self.seed,
            vectorize="auto",
            num_patients=self.population + self.canaries,
        )

    # ------------------------------------------------------------------ the scores
    @torch.no_grad()
    def losses(self, model: nn.Module, images: Tensor, labels: Tensor) -> Tensor:
        """Each image's cross-entropy under ``model`` (a black-box query), in float64, eval mode."""
        net = copy.deepcopy(model).double().eval()
        out = [
            F.cross_entropy(net(chunk.double()), target, reduction="none")
            for chunk, target in zip(images.split(4096), labels.split(4096))
        ]
        return torch.cat(out)

    def scores(self, initial: nn.Module, released: nn.Module) -> list[tuple[str, float]]:
        """(patient id, s_i) for every canary: its loss under the initial model less its loss under the released one."""
        patterns, labels = self.canary_images()
        drop = self.losses(initial, patterns, labels) - self.losses(released, patterns, labels)
        return list(zip(self.canary_ids(), drop.tolist()))

    @torch.no_grad()
    def accuracy(self, model: nn.Module, draws: int = 2000) -> float:
        """The model's accuracy on fresh draws of the population task (public draws, not the training patients)."""
        images, labels = self.population_images(draws, purpose=4)
        net = copy.deepcopy(model).eval()
        return float((net(images[:, 0]).argmax(1) == labels).double().mean())

    # ------------------------------------------------------------------ the run
    def run(self) -> OneRunAuditResult:
        """Draws the coins, trains once through the P3SGD callback, scores every canary by its loss, joins, bounds."""
        start = time.perf_counter()
        membership = self.coins()
        rows = {pid: i for i, pid in enumerate(self.canary_ids())}
        included = self._included(membership)
        patterns, labels = self.canary_images()
        population, population_labels = self.population_images(self.population)
        data = _Patients(
            population,
            population_labels,
            patterns,
            labels,
            included,
            [rows[pid] for pid in included],
            self.images_per_patient,
        )
        model = self.model()
        initial = copy.deepcopy(model)
        callback = self.callback()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=PrivacyWarning)
            declared = self.population + self.canaries
            observer = fit_world(model, callback, data, self.local_lr, self.steps, {}, declared)
        if len(observer.thetas) != self.steps + 1:
            raise PrivacyStateError(f"`{self.owner}`: the run made {len(observer.thetas) - 1} of {self.steps} rounds.")
        if not torch.equal(_flat(model), observer.thetas[-1]):
            raise PrivacyStateError(f"`{self.owner}`: the model scored is not the one the last round released.")
        return self._result(
            membership,
            self.scores(initial, model),
            epsilon_printed=float(callback.accountant.epsilon(callback.ledger)),
            accountant=self.accountant,
            started=start,
            round_path=str(callback.round_path),
            mechanism="P3SGD callback",
            scoring="loss",
            population=self.population,
            population_accuracy=self.accuracy(model) if self.population else math.nan,
        )
