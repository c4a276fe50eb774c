"""White-box audit of the code that trains: the real callback, a real model, a real Trainer, every release observed.

`CallbackAudit` fits a small model twice with the user's own callback (`DPSGD` or `P3SGD`, as configured):
once on a population plus a *canary* unit (a sample, or a patient with several images) and once on the
population alone. Between steps it reads the model's parameters, so it observes every released update
θ_{t+1} − θ_t, exactly as an adversary holding the intermediate models would (Nasr et al. 2023, "Tight
auditing", the white-box gradient-canary setting). Nothing of the engine is re-implemented on the path
that is audited: the per-sample engine (ghost and materialized norms, every layer rule), P3SGD's local
updates and per-patient clipping, the sample rate, clip norm and normalizer the callback hands to its
release, the noise and the ledger all run as they do in training.

The auditor knows everything but the canary's membership (the DP threat model): the population, the
model at every step, the configuration. For full-batch runs (q = 1) it computes, with its own float64
reference (``torch.func`` per-sample gradients; its own local SGD for patients), every other unit's
clipped contribution at θ_t and subtracts it from the observed release (rescaled by the public n/lr).
What remains is the canary's clipped contribution (in the "in" world) plus the noise. Its projection on
the canary's direction, in units of the clip norm C, is y_t ~ N(b, z²) with b = 1 if the canary is
present, 0 if not.

**Verdict rule** (the Gaussian-DP reading, valid for full-batch Gaussian steps, where every step's
trade-off curve is Gaussian): y_t ~ N(b·β·m_t, s²), with m_t the canary's clipped norm by the auditor's
reference (units of C; 1 while the clip is active) and β the factor by which the step really lets the
canary through (1 for correct code). β is estimated by least squares in each world and bounded from
below; s, the noise sd, is measured on the d − 1 directions orthogonal to the canary (where, once the
population is subtracted, only the noise is left) and bounded from above (`gdp_mu_lower`), jointly with
confidence 1 − significance. The T steps compose to μ = β·√(Σ m_t²)/s, so ε_lower = ε_GDP(μ_lower, δ).
The audit *passes* when ε_lower ≤ ε_upper, the ε the callback's own accountant reports for the run's
ledger. With several noise scales (P3SGD's selection) s is the root mean square of the scales used,
which makes the reading conservative. The canary's loss is weighted (``canary_weight``) so that its
gradient is far above C, and C is set above the population's gradients: a wrong clip then moves the
canary alone.

What it does not see: subsampling (q < 1 is refused here: the simulated `StepAudit` covers the sampler
with Clopper–Pearson bounds), an accountant that is wrong only for q < 1, and anything that leaks without
moving the mean or the spread of the canary's projection. A passing audit is a lower bound from one
attack, not a proof; a leaking bug can pass it (the mutation table in docs/results/audit.md lists what it catches).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from numpy.typing import NDArray
from scipy import stats
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.data import DataLoader, Dataset

from lightning_dp.audit.bounds import gdp_epsilon
from lightning_dp.errors import PrivacyConfigError, check_count

__all__ = ["CallbackAudit", "CallbackAuditResult"]

#: False-alarm probability of the fresh-noise check (a reused noise vector correlates at 1, far beyond it).
NOISE_CHECK_SIGNIFICANCE = 1e-3
#: The verdict rule, as printed in results and reports.
VERDICT_RULE = "Gaussian-DP reading of the per-step canary projections (full batch)"


@dataclass
class CallbackAuditResult:
    """What a `CallbackAudit` measured. ``passed``: ε_lower ≤ ε_upper.

    ``beta`` is the estimated factor by which the step lets the canary through (1 for a correct step; a clip
    bound 10× too large shows as up to 10), ``mu`` the run's estimated Gaussian-DP μ, ``mu_lower`` its bound.
    ``mean_in``/``mean_out`` are the canary projection's means in units of C (1 and 0 for a correct step),
    ``sd_in``/``sd_out`` its spread (the noise multiplier z for a correct step), ``noise_sd`` the noise
    std measured on the directions orthogonal to the canary (also ≈ z), ``canary_norm`` the canary's
    clipped contribution norm by the auditor's reference, in units of C (1: the clip is active),
    ``population_clipped`` the fraction of the population's contributions the clip changed (0 is best: a bug in
    the clip then moves only the canary, not the population the auditor subtracts).
    """

    mechanism: str
    level: str
    steps: int
    epsilon_lower: float
    epsilon_upper: float
    mu_lower: float
    mu: float
    beta: float
    mean_in: float
    mean_out: float
    sd_in: float
    sd_out: float
    noise_sd: float
    noise_multiplier: float
    canary_norm: float
    population_clipped: float
    noise_correlation: float
    noise_correlation_limit: float
    changed_state: list[str]
    delta: float
    significance: float
    accountant: str
    verdict_rule: str = VERDICT_RULE
    in_projections: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0), repr=False)
    out_projections: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0), repr=False)

    @property
    def noise_fresh(self) -> bool:
        """No two consecutive steps' noise correlate beyond chance (a reused or re-seeded generator shows here)."""
        return self.noise_correlation <= self.noise_correlation_limit

    @property
    def passed(self) -> bool:
        """ε_lower ≤ ε_upper, the noise is fresh at every step, and nothing outside the parameters changed."""
        return self.epsilon_lower <= self.epsilon_upper and self.noise_fresh and not self.changed_state

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("in_projections", "out_projections")}
        out.update(passed=self.passed, noise_fresh=self.noise_fresh, kind="white-box audit of the callback's own step")
        return out

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED: the run leaks more than its ε says"
        if not self.noise_fresh:
            verdict += f" (noise of consecutive steps correlates: {self.noise_correlation:.3f})"
        if self.changed_state:
            verdict += f" (state outside the parameters changed: {self.changed_state[:5]})"
        return (
            f"{self.mechanism} ({self.level} level, {self.steps} steps): ε_lower {self.epsilon_lower:.2f} vs "
            f"ε_upper {self.epsilon_upper:.2f} [{self.accountant}] at δ={self.delta:g}: {verdict}. Canary projection "
            f"(units of C): in {self.mean_in:.3f} ± {self.sd_in:.3f}, out {self.mean_out:.3f} ± {self.sd_out:.3f}; "
            f"noise sd {self.noise_sd:.3f} (configured z {self.noise_multiplier:.3f})."
        )


class _Units(Dataset):
    """(x, y) pairs; with patients, the P3SGD interface (``patient_to_indices``, ``num_patients``)."""

    def __init__(self, x: Tensor, y: Tensor, w: Tensor, patients: Tensor | None) -> None:
        self.x, self.y, self.w = x, y, w
        if patients is not None:
            ids = sorted(set(patients.tolist()))
            self.patient_to_indices = {k: torch.nonzero(patients == p).flatten().tolist() for k, p in enumerate(ids)}
            self.num_patients = len(ids)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.x[i], self.y[i], self.w[i]


class _Data(pl.LightningDataModule):
    def __init__(self, dataset: _Units) -> None:
        super().__init__()
        self.train_dataset = dataset

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_dataset, batch_size=len(self.train_dataset))


class _Module(pl.LightningModule):
    """The audited model behind an ordinary LightningModule: cross-entropy, plain SGD (no momentum or decay)."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def train(self, mode: bool = True) -> _Module:
        # The model's own modes are kept (an eval-mode BatchNorm stays in eval mode, as under ImageClassifier).
        modes = {m: m.training for m in self.model.modules()}
        super().train(mode)
        for m, was in modes.items():
            m.training = was
        return self

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, w = batch
        return _weighted_loss(self.model(x), y, w)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=self.lr)


class _Observer(pl.Callback):
    """Reads the trainable parameters before the first step and after every step."""

    def __init__(self) -> None:
        self.thetas: list[Tensor] = []
        self.model: nn.Module | None = None
        self.state: dict[str, Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert isinstance(pl_module, _Module)
        # The auditor's reference runs in eval mode: the same function for the layers the audit supports (no
        # dropout, no training-mode normalization), and no buffer of the copy changes under torch.func.
        self.model = copy.deepcopy(pl_module.model).double().eval()
        self.thetas = [_flat(pl_module.model)]
        self.state = _unreleased_state(pl_module.model)

    def changed_state(self, model: nn.Module) -> list[str]:
        """Names of tensors outside the trainable parameters whose values changed since training started."""
        now = _unreleased_state(model)
        return [k for k, v in self.state.items() if k not in now or not torch.equal(now[k], v)]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        assert isinstance(pl_module, _Module)
        self.thetas.append(_flat(pl_module.model))


def _weighted_loss(logits: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """Mean over the batch of each image's cross-entropy times its unit's weight (the canary's is large)."""
    return (F.cross_entropy(logits, y, reduction="none") * w.to(logits.dtype)).mean()


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _unreleased_state(model: nn.Module) -> dict[str, Tensor]:
    """Copies of every state tensor but the released ones: frozen parameters and buffers of any dtype.

    Released are the trainable parameters and, under P3SGD, the running statistics of normalization layers in
    training mode (noised with the update).
    """
    released = {name for name, _ in _trainable(model)}
    for name, m in model.named_modules():
        if isinstance(m, _NormBase) and m.training and m.track_running_stats:
            released |= {f"{name}.running_mean", f"{name}.running_var"}
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items() if k not in released}


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().double().reshape(-1) for _, p in _trainable(model)])


class CallbackAudit:
    """Audits a DP callback by training a small model with it, with and without a canary unit.

    Args:
        callback: builds the callback to audit from a seed (``lambda seed: DPSGD(..., seed=seed)``), configured
            as the run to audit is, with ``sample_rate=1.0``.
        model: builds the model (called once per world under the same torch seed: both worlds start equal).
            Its parameters that require grad are the ones audited; eval-mode layers stay in eval mode.
        population: ``(x, y)`` — the other units' images and labels; for patient-level callbacks
            ``(x, y, patients)`` with one patient id per image.
        canary: ``(x, y)`` of the canary unit (one sample for DPSGD; the images of one patient for P3SGD).
            Its gradient (or local update) must be much larger than the clip norm, so the clip is active.
        steps: T, the number of steps observed.
        lr: the learning rate of DPSGD's SGD (P3SGD uses its own local and server learning rates).
        canary_weight: the canary's loss is multiplied by this (a "gradient canary": its gradient, or local
            update, is then far above the clip norm whatever the architecture does to the input's scale).
        significance: the bound holds with probability ≥ 1 − significance.
        seed: seeds the model's initialization and the callbacks (public; never derived from data).
        trainer_kwargs: more arguments for the Trainer (e.g. ``precision``).

    Example:
        >>> from lightning_dp.callbacks import DPSGD
        >>> x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        >>> audit = CallbackAudit(
        ...     lambda seed: DPSGD(sample_rate=1.0, noise_multiplier=1.0, clip_norm=1.0, delta=1e-5, seed=seed),
        ...     model=lambda: nn.Linear(4, 2), population=(x, y), canary=(torch.full((1, 4), 50.0), torch.tensor([0])),
        ...     steps=20, lr=0.01)
        >>> audit.run().passed  # doctest: +SKIP
        True
    """

    def __init__(
        self,
        callback: Callable[[int], Any],
        *,
        model: Callable[[], nn.Module],
        population: Sequence[Tensor],
        canary: Sequence[Tensor],
        steps: int = 200,
        lr: float = 0.05,
        canary_weight: float = 1.0,
        significance: float = 0.05,
        seed: int = 0,
        trainer_kwargs: dict[str, Any] | None = None,
    ) -> None:
        owner = "CallbackAudit"
        self.callback = callback
        self.model = model
        probe = callback(seed)
        self.level = probe.unit
        self.mechanism = probe.mechanism
        if float(probe.sample_rate) != 1.0:
            raise PrivacyConfigError(
                f"`{owner}`: the callback samples with q = {probe.sample_rate}; this audit subtracts every other "
                "unit's contribution, which needs a full batch. HINT: audit the configuration with sample_rate=1.0 "
                "(same engine, clip and noise), and the sampler with the simulated `StepAudit(sample_rate=q)`."
            )
        need = 3 if self.level == "patient" else 2
        if len(population) != need or len(canary) != 2:
            raise PrivacyConfigError(
                f"`{owner}`: population must be {'(x, y, patients)' if need == 3 else '(x, y)'} and canary (x, y) for "
                f"a {self.level}-level callback; found {len(population)} and {len(canary)} tensors."
            )
        self.population = tuple(population)
        self.canary = tuple(canary)
        self.steps = check_count(owner, "steps", steps, "e.g. 200.", minimum=2)
        self.lr = float(lr)
        self.canary_weight = float(canary_weight)
        self._population_clipped: list[float] = []
        self._changed_state: list[str] = []
        self._dimension = 0
        if not 0.0 < significance < 1.0:
            raise PrivacyConfigError(f"`{owner}(significance={significance})`: must be in (0, 1), e.g. 0.05.")
        self.significance = float(significance)
        self.seed = int(seed)
        self.trainer_kwargs = dict(trainer_kwargs or {})
        if self.level == "patient":
            self._check_patient_settings(probe)

    def _check_patient_settings(self, probe: Any) -> None:
        counts = torch.unique(self.population[2], return_counts=True)[1].tolist() + [len(self.canary[1])]
        if probe.local_batch_size < max(counts):
            raise PrivacyConfigError(
                f"`CallbackAudit`: P3SGD(local_batch_size={probe.local_batch_size}) splits a patient of {max(counts)} "
                "images into mini-batches in an order drawn from the callback's private generator, which the "
                "reference cannot follow. HINT: local_batch_size >= images per patient (local_epochs sets the number "
                "of local steps)."
            )

    # ------------------------------------------------------------------ the two worlds
    def _dataset(self, with_canary: bool) -> _Units:
        x, y = self.population[0], self.population[1]
        w = torch.ones(len(y))
        patients = self.population[2] if self.level == "patient" else None
        if with_canary:
            cx, cy = self.canary
            x, y = torch.cat([x, cx]), torch.cat([y, cy])
            w = torch.cat([w, torch.full((len(cy),), self.canary_weight)])
            if patients is not None:  # the canary is the first patient of every round (its id sorts first)
                patients = torch.cat([patients, torch.full((len(cy),), int(patients.min()) - 1)])
        return _Units(x, y, w, patients)

    def fit(self, with_canary: bool) -> tuple[Any, _Observer, _Units]:
        """One world's run: (the callback after fitting, the observer with every θ_t, the training data)."""
        torch.manual_seed(self.seed)
        model = self.model()
        callback = self.callback(self.seed + (1 if with_canary else 2))
        observer = _Observer()
        data = self._dataset(with_canary)
        kwargs: dict[str, Any] = {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": self.steps,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
        }
        kwargs.update(self.trainer_kwargs)
        quiet = [logging.getLogger(name) for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric")]
        levels = [logger.level for logger in quiet]
        try:
            for logger in quiet:
                logger.setLevel(logging.WARNING)
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.filterwarnings(
                    "ignore", message=".*(workers|val_dataloader|litlogger|IterableDataset|LeafSpec).*"
                )
                module = _Module(model, self.lr)
                pl.Trainer(callbacks=[callback, observer], **kwargs).fit(module, datamodule=_Data(data))
        finally:
            for logger, level in zip(quiet, levels):
                logger.setLevel(level)
        self._changed_state += observer.changed_state(model)
        if len(observer.thetas) != self.steps + 1:
            raise PrivacyConfigError(
                f"`CallbackAudit`: the run made {len(observer.thetas) - 1} steps, not {self.steps}. HINT: no budget or "
                "early stopping in the audited configuration."
            )
        return callback, observer, data

    # ------------------------------------------------------------------ the auditor's reference
    def _contributions(self, reference: nn.Module, theta: Tensor, callback: Any) -> tuple[Tensor, Tensor]:
        """(Σ of the population's clipped contributions, the canary's clipped contribution) at θ, in float64.

        The population is the same in both worlds; the canary's contribution is computed in both (in the
        "out" world it only gives the direction to project on).
        """
        trainable = _trainable(reference)
        sizes = [p.numel() for _, p in trainable]
        params = {name: t.view_as(p) for (name, p), t in zip(trainable, torch.split(theta, sizes))}
        fixed: dict[str, Tensor] = {k: v for k, v in reference.named_parameters() if k not in params}
        fixed.update(dict(reference.named_buffers()))

        def loss(p: dict[str, Tensor], x: Tensor, y: Tensor, w: Tensor) -> Tensor:
            return _weighted_loss(torch.func.functional_call(reference, {**p, **fixed}, (x,)), y, w)

        weight = torch.tensor(self.canary_weight, dtype=torch.float64)
        if self.level == "sample":
            x = torch.cat([self.population[0], self.canary[0]]).double()
            y = torch.cat([self.population[1], self.canary[1]])
            w = torch.cat(
                [torch.ones(len(self.population[1]), dtype=torch.float64), weight.expand(len(self.canary[1]))]
            )
            grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0, 0))(
                params, x.unsqueeze(1), y.unsqueeze(1), w.unsqueeze(1)
            )
            flat = torch.cat([grads[name].reshape(len(y), -1) for name in params], dim=1)
        else:
            x, y, patients = self.population
            units = [(x[patients == p].double(), y[patients == p], 1.0) for p in torch.unique(patients)]
            units.append((self.canary[0].double(), self.canary[1], self.canary_weight))
            flat = torch.stack(
                [self._local_change(loss, params, ux, uy, torch.full((len(uy),), uw), callback) for ux, uy, uw in units]
            )
        norms = flat.norm(dim=1, keepdim=True)
        self._population_clipped.append(float((norms[:-1] > float(callback.clip_norm)).double().mean()))
        clipped = flat * torch.clamp(float(callback.clip_norm) / norms, max=1.0)
        return clipped[:-1].sum(0), clipped[-1]

    @staticmethod
    def _local_change(
        loss: Callable[..., Tensor], params: dict[str, Tensor], x: Tensor, y: Tensor, w: Tensor, callback: Any
    ) -> Tensor:
        """A patient's local update by plain torch SGD semantics (momentum, weight decay), full-patient batches."""
        current = {k: v.clone() for k, v in params.items()}
        velocity: dict[str, Tensor] = {}
        for step in range(int(callback.local_epochs)):
            grads = torch.func.grad(loss)(current, x, y, w.double())
            for k in current:
                d = grads[k] + callback.local_weight_decay * current[k]
                if callback.local_momentum:
                    velocity[k] = d if step == 0 else callback.local_momentum * velocity[k] + d
                    d = velocity[k]
                current[k] = current[k] - callback.local_lr * d
        return torch.cat([(current[k] - params[k]).reshape(-1) for k in params])

    def _projections(self, callback: Any, observer: _Observer, data: _Units) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per step, in units of C: canary projection, squared noise, canary norm, noise correlation.

        y_t is the canary projection; the correlation is that of the step's noise with the previous step's.
        The squared noise is summed over the d − 1 directions orthogonal to the canary; the canary's clipped
        norm m_t is the auditor's reference. Fresh noise makes consecutive correlations ~N(0, 1/d).
        """
        assert observer.model is not None
        clip = float(callback.clip_norm)
        units = data.num_patients if self.level == "patient" else len(data)
        n = float(callback.sample_rate) * units  # the public normalizer q·N
        scale = float(callback.server_lr) if self.level == "patient" else -self.lr
        ys, sds, norms, correlations = [], [], [], []
        previous: Tensor | None = None
        for t in range(self.steps):
            theta, after = observer.thetas[t], observer.thetas[t + 1]
            released = (after - theta) * (n / scale)
            others, canary = self._contributions(observer.model, theta, callback)
            residual = released - others
            self._dimension = residual.numel()
            direction = canary / canary.norm()
            along = float(residual @ direction)
            noise = residual - along * direction
            ys.append(along / clip)
            sds.append(float(noise.norm() / clip) ** 2)  # Σ of d − 1 squared noise draws
            norms.append(float(canary.norm()) / clip)
            if previous is not None:
                correlations.append(float(noise @ previous / (noise.norm() * previous.norm())))
            previous = noise
        return torch.tensor(ys), torch.tensor(sds), torch.tensor(norms), torch.tensor(correlations)

    # ------------------------------------------------------------------ the audit
    def run(self) -> CallbackAuditResult:
        """Both worlds, the projections, the bound, and the accountant's ε for the "in" world's ledger."""
        results = {}
        for world in (True, False):
            callback, observer, data = self.fit(world)
            results[world] = (callback, *self._projections(callback, observer, data))
        callback = results[True][0]
        y_in, y_out = results[True][1].double().numpy(), results[False][1].double().numpy()
        m_in, m_out = results[True][3].double().numpy(), results[False][3].double().numpy()
        noise_ss = float(torch.cat([results[True][2], results[False][2]]).sum())
        noise_dof = 2 * self.steps * (self._dimension - 1)
        correlations = torch.cat([results[True][4], results[False][4]]).double()
        # Fresh noise: each correlation ~N(0, 1/(d−1)); Bonferroni over every pair at NOISE_CHECK_SIGNIFICANCE.
        noise_correlation = float(correlations.abs().max()) if len(correlations) else 0.0
        tail = NOISE_CHECK_SIGNIFICANCE / (2 * max(1, len(correlations)))
        correlation_limit = float(stats.norm.isf(tail)) / math.sqrt(self._dimension - 1)
        mu_lower, mu, beta = gdp_mu_lower(y_in, m_in, y_out, m_out, noise_ss, noise_dof, self.significance)
        delta = float(callback.ledger.delta)
        return CallbackAuditResult(
            mechanism=self.mechanism,
            level=self.level,
            steps=self.steps,
            epsilon_lower=gdp_epsilon(mu_lower, delta) if mu_lower > 0 else 0.0,
            epsilon_upper=float(callback.accountant.epsilon(callback.ledger)),
            mu_lower=mu_lower,
            mu=mu,
            beta=beta,
            mean_in=float(y_in.mean()),
            mean_out=float(y_out.mean()),
            sd_in=float(y_in.std(ddof=1)),
            sd_out=float(y_out.std(ddof=1)),
            noise_sd=math.sqrt(noise_ss / noise_dof),
            population_clipped=float(np.mean(self._population_clipped)),
            noise_multiplier=float(callback.release.noise_multiplier(0)),
            canary_norm=float(results[True][3].mean()),
            noise_correlation=noise_correlation,
            noise_correlation_limit=correlation_limit,
            changed_state=sorted(set(self._changed_state)),
            delta=delta,
            significance=self.significance,
            accountant=str(callback.accountant.name),
            in_projections=y_in,
            out_projections=y_out,
        )


def gdp_mu_lower(
    y_in: NDArray[np.float64],
    m_in: NDArray[np.float64],
    y_out: NDArray[np.float64],
    m_out: NDArray[np.float64],
    noise_ss: float,
    noise_dof: int,
    significance: float,
) -> tuple[float, float, float]:
    """(μ_lower, μ̂, β̂): a lower confidence bound on the run's Gaussian-DP μ, its point estimate, and β̂.

    Step t's projection is y_t ~ N(b·β·m_t, s²): b = 1 in the "in" world, m_t the canary's clipped norm
    the auditor expects (units of C), β the factor by which the step lets the canary through (1 when
    correct). β is estimated by least squares in each world (β̂ = β̂_in − β̂_out) and bounded from below by
    a normal bound; s² is measured on the directions orthogonal to the canary (``noise_ss`` over
    ``noise_dof`` squared draws, where only the noise is left once the population is subtracted) and
    bounded from above by a χ² bound; each at half the significance, so the pair holds jointly with
    probability ≥ 1 − significance. The steps compose to μ = β·√(Σ m_t²)/s (in-world m_t).

    Example:
        >>> rng = np.random.default_rng(0)
        >>> ones, noise = np.ones(4000), rng.normal(0, 1, 100_000)
        >>> low, mu, beta = gdp_mu_lower(rng.normal(1, 1, 4000), ones, rng.normal(0, 1, 4000), ones,
        ...                              float(noise @ noise), len(noise), 0.05)
        >>> 0.9 * 4000**0.5 < low < mu < 1.1 * 4000**0.5, 0.9 < beta < 1.1
        (True, True)
    """
    ss_in, ss_out = float(m_in @ m_in), float(m_out @ m_out)
    beta = float(m_in @ y_in) / ss_in - float(m_out @ y_out) / ss_out
    variance = noise_ss / noise_dof
    half = significance / 2
    beta_lower = beta - float(stats.norm.isf(half)) * math.sqrt(variance / ss_in + variance / ss_out)
    sd_upper = math.sqrt(noise_ss / float(stats.chi2.ppf(half, noise_dof)))
    scale = math.sqrt(ss_in)
    return max(0.0, beta_lower * scale / sd_upper), beta * scale / math.sqrt(variance), beta
