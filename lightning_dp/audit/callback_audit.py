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
trade-off curve is Gaussian), read *per step*: y_t ~ N(b·β·m_t, κ²·r_t²), with m_t the canary's clipped norm
by the auditor's reference (units of C; 1 while the clip is active), r_t the multiplier the release reports
for step t (logged as ``privacy/noise_multiplier``: the selected candidate's with several noise scales; the
ledger's where it is not logged), κ one common noise factor (1 for correct code) and β the factor by which
the step really lets the canary through (1 for correct code). β is estimated by weighted least squares in
each world and bounded from below; κ is measured on the d − 1 directions orthogonal to the canary (where,
once the population is subtracted, only the noise is left) and bounded from above (`gdp_mu_lower`), jointly
with confidence 1 − significance. The T steps compose to μ = β·√(Σ m_t²/r_t²)/κ, so ε_lower = ε_GDP(μ_lower, δ).
The audit *passes* when ε_lower ≤ ε_upper, the ε the callback's own accountant reports for the run's ledger,
**and** the noise passes three checks (`lightning_dp.audit.noise`, each with false-alarm probability
`NOISE_CHECK_SIGNIFICANCE`): it is fresh (no two steps correlate, at any lag, within or across the worlds),
it is nowhere below the ledger's multiplier (pooled, per step, per parameter tensor, per coordinate and along
the canary's direction: a tensor or slice released without noise, or a ledger that records more noise than
was drawn, fails here), and each step's noise is what the release reports (the per-step reading's
condition); and no state outside the released tensors changed. The canary's loss is weighted
(``canary_weight``) so that its gradient is far above C, and C is set above the population's gradients: a
wrong clip then moves the canary alone.

**Power.** The result states how far the run's μ̂ lies above or below μ_allowed (the μ whose ε_GDP is
ε_upper) in standard errors (``margin_se``), the catch probability that margin gives (``power``), and the
smallest leak factor on μ the ε comparison catches with probability 0.9 at this run's length
(``detectable_factor``): a catch by a margin of a standard error or two is a coin flip, not a catch.

What it does not see, or refuses: subsampling (q < 1 is refused here: the simulated `StepAudit` covers the
sampler with Clopper–Pearson bounds), an accountant that is wrong only for q < 1, models whose training-mode
function the eval-mode reference cannot follow (Dropout, BatchNorm or normalization with running statistics
in training mode: refused), and anything that leaks without moving the mean or the spread of the release's
noise. A passing audit is a lower bound from one attack, not a proof; a leaking bug can pass it (the mutation
table in docs/results/audit.md lists what it catches).
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
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.utils.data import DataLoader, Dataset

from lightning_dp.audit.bounds import gdp_epsilon, gdp_mu
from lightning_dp.audit.noise import (
    NoiseCheck,
    fresh_noise,
    ledger_multipliers,
    noise_as_released,
    noise_vs_ledger,
)
from lightning_dp.errors import PrivacyConfigError, check_count

__all__ = ["CallbackAudit", "CallbackAuditResult"]

#: False-alarm probability of each noise check (fresh noise; noise vs ledger; noise as released): each fails
#: correct code with probability at most this (a reused noise vector correlates at ~1, an un-noised tensor's
#: sd is ~0: far beyond their limits).
NOISE_CHECK_SIGNIFICANCE = 1e-3
#: The verdict rule, as printed in results and reports.
VERDICT_RULE = (
    "Gaussian-DP reading of the canary projections, each step at its released multiplier (full batch); "
    "noise fresh at every lag, nowhere below the ledger's multiplier, as released at every step; no state changed"
)
#: The power the catch probability and the detectable leak factor are stated at.
POWER = 0.9


@dataclass
class CallbackAuditResult:
    """What a `CallbackAudit` measured. ``passed``: ε_lower ≤ ε_upper, every noise check passed, no state changed.

    ``beta`` is the estimated factor by which the step lets the canary through (1 for a correct step; a clip
    bound 10× too large shows as up to 10), ``mu`` the run's estimated Gaussian-DP μ, ``mu_lower`` its bound,
    ``mu_se`` its standard error and ``mu_allowed`` the μ whose ε_GDP is ε_upper.
    ``mean_in``/``mean_out`` are the canary projection's means in units of C (1 and 0 for a correct step),
    ``sd_in``/``sd_out`` its spread (the noise multiplier z for a correct step), ``noise_sd`` the noise
    std measured on the directions orthogonal to the canary (also ≈ z), ``canary_norm`` the canary's
    clipped contribution norm by the auditor's reference, in units of C (1: the clip is active),
    ``population_clipped`` the fraction of the population's contributions the clip changed (0 is best: a bug in
    the clip then moves only the canary, not the population the auditor subtracts). ``checks`` holds the three
    noise checks (`lightning_dp.audit.noise`); ``released_multipliers`` and ``ledger_multipliers`` the
    multiplier each step of the "in" world reported and was charged.
    """

    mechanism: str
    level: str
    steps: int
    epsilon_lower: float
    epsilon_upper: float
    mu_lower: float
    mu: float
    mu_se: float
    mu_allowed: float
    beta: float
    mean_in: float
    mean_out: float
    sd_in: float
    sd_out: float
    noise_sd: float
    noise_multiplier: float
    canary_norm: float
    population_clipped: float
    checks: tuple[NoiseCheck, ...]
    changed_state: list[str]
    delta: float
    significance: float
    accountant: str
    verdict_rule: str = VERDICT_RULE
    in_projections: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0), repr=False)
    out_projections: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0), repr=False)
    released_multipliers: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0), repr=False)
    ledger_multipliers: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0), repr=False)

    def check(self, name: str) -> NoiseCheck:
        """The noise check called ``name`` ("fresh noise", "noise vs ledger", "noise as released")."""
        return next(c for c in self.checks if c.name == name)

    @property
    def noise_correlation(self) -> float:
        """The largest correlation between two steps' noise (any lag, within or across the worlds)."""
        return self.check("fresh noise").statistic

    @property
    def noise_correlation_limit(self) -> float:
        return self.check("fresh noise").limit

    @property
    def noise_fresh(self) -> bool:
        """No two steps' noise correlate beyond chance (a reused or re-seeded generator shows here)."""
        return self.check("fresh noise").passed

    @property
    def failed(self) -> list[str]:
        """The checks the run failed: "ε", the names of the noise checks, "state"."""
        out = ["ε"] if self.epsilon_lower > self.epsilon_upper else []
        out += [c.name for c in self.checks if not c.passed]
        return out + (["state"] if self.changed_state else [])

    @property
    def passed(self) -> bool:
        """ε_lower ≤ ε_upper, every noise check passed, and nothing outside the released tensors changed."""
        return not self.failed

    @property
    def threshold_se(self) -> float:
        """How many standard errors μ_lower lies below μ̂: μ̂ must exceed μ_allowed by this much to be caught."""
        return (self.mu - self.mu_lower) / self.mu_se if self.mu_se > 0 else math.inf

    @property
    def margin_se(self) -> float:
        """(μ̂ − μ_allowed) / se(μ̂): how far the run lies above the leak ε_upper allows (below it: negative)."""
        return (self.mu - self.mu_allowed) / self.mu_se if self.mu_se > 0 else -math.inf

    @property
    def power(self) -> float:
        """The ε comparison's catch probability were μ̂ the run's true μ: Φ(margin_se − threshold_se).

        For a mutant, how far from a coin flip (0.5) its catch is; for correct code, its false-alarm estimate.
        """
        return float(stats.norm.cdf(self.margin_se - self.threshold_se))

    @property
    def detectable_factor(self) -> float:
        """The leak factor on μ (μ_true = factor·μ_allowed) the ε comparison catches with probability `POWER`."""
        if not self.mu_allowed > 0:
            return math.inf
        return 1.0 + (self.threshold_se + float(stats.norm.ppf(POWER))) * self.mu_se / self.mu_allowed

    def to_dict(self) -> dict[str, Any]:
        skip = ("in_projections", "out_projections", "released_multipliers", "ledger_multipliers")
        out = {k: v for k, v in asdict(self).items() if k not in skip}
        out.update(
            passed=self.passed,
            failed=self.failed,
            noise_fresh=self.noise_fresh,
            margin_se=self.margin_se,
            threshold_se=self.threshold_se,
            power=self.power,
            detectable_factor=self.detectable_factor,
            kind="white-box audit of the callback's own step",
        )
        return out

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED: the run leaks more than its ε says"
        verdict += "".join(check.failure(".3f") for check in self.checks)
        if self.changed_state:
            verdict += f" (state outside the parameters changed: {self.changed_state[:5]})"
        return (
            f"{self.mechanism} ({self.level} level, {self.steps} steps): ε_lower {self.epsilon_lower:.2f} vs "
            f"ε_upper {self.epsilon_upper:.2f} [{self.accountant}] at δ={self.delta:g}: {verdict}. Canary projection "
            f"(units of C): in {self.mean_in:.3f} ± {self.sd_in:.3f}, out {self.mean_out:.3f} ± {self.sd_out:.3f}; "
            f"noise sd {self.noise_sd:.3f} (configured z {self.noise_multiplier:.3f}); μ̂ {self.mu:.2f} vs allowed "
            f"{self.mu_allowed:.2f}: {self.margin_se:+.1f} SE (caught above {self.threshold_se:.1f}); a leak of "
            f"×{self.detectable_factor:.2f} in μ is caught with probability {POWER:g}."
        )


class _Units(Dataset):
    """(x, y) pairs; with patients, the P3SGD interface (``patient_to_indices``, ``num_patients``).

    ``augment`` (optional) transforms each image when it is fetched, drawing from the global generators as a
    torchvision transform does.
    """

    def __init__(
        self,
        x: Tensor,
        y: Tensor,
        w: Tensor,
        patients: Tensor | None,
        augment: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        self.x, self.y, self.w = x, y, w
        self.augment = augment
        if patients is not None:
            # Keyed by the patients' own ids: a patient keeps its id (and so its random streams) in both worlds.
            ids = sorted(set(patients.tolist()))
            self.patient_to_indices = {p: torch.nonzero(patients == p).flatten().tolist() for p in ids}
            self.num_patients = len(ids)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        x = self.x[i] if self.augment is None else self.augment(self.x[i])
        return x, self.y[i], self.w[i]


class _Data(pl.LightningDataModule):
    """A world's training data, with N declared as the auditor fixes it for every world (never the world's count)."""

    def __init__(self, dataset: Dataset[Any], declared: int) -> None:
        super().__init__()
        self.train_dataset = dataset
        self.declared_num_patients = self.declared_num_samples = declared

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_dataset, batch_size=len(self.train_dataset))  # type: ignore[arg-type]


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
    """Reads the trainable parameters before the first step and after every step, and each step's multiplier.

    The multiplier is what the callback logs as ``privacy/noise_multiplier`` for the step (the release's
    `StepRelease.noise_multiplier`: with several noise scales, the selected candidate's); NaN if not logged.
    """

    def __init__(self) -> None:
        self.thetas: list[Tensor] = []
        self.released: list[float] = []
        self.model: nn.Module | None = None
        self.state: dict[str, Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert isinstance(pl_module, _Module)
        # The auditor's reference runs in eval mode: the same function for the layers the audit supports (no
        # dropout, no training-mode normalization), and no buffer of the copy changes under torch.func. It runs on the
        # CPU in float64 whatever device the callback trains on (the units' tensors are on the CPU).
        self.model = copy.deepcopy(pl_module.model).double().eval().cpu()
        self.thetas = [_flat(pl_module.model)]
        self.state = _unreleased_state(pl_module.model)

    def changed_state(self, model: nn.Module) -> list[str]:
        """Names of tensors outside the trainable parameters whose values changed since training started."""
        now = _unreleased_state(model)
        return [k for k, v in self.state.items() if k not in now or not torch.equal(now[k], v)]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        assert isinstance(pl_module, _Module)
        self.thetas.append(_flat(pl_module.model))
        logged = trainer.callback_metrics.get("privacy/noise_multiplier")
        self.released.append(math.nan if logged is None else float(logged))


def check_units(owner: str, level: str, population: Sequence[Tensor], canary: Sequence[Tensor]) -> None:
    """Raises `PrivacyConfigError` unless population and canary hold the tensors a ``level``-level audit needs."""
    need = 3 if level == "patient" else 2
    if len(population) != need or len(canary) != 2:
        raise PrivacyConfigError(
            f"`{owner}`: population must be {'(x, y, patients)' if need == 3 else '(x, y)'} and canary (x, y) for "
            f"a {level}-level callback; found {len(population)} and {len(canary)} tensors."
        )


def fit_world(
    model: nn.Module,
    callback: Any,
    data: Dataset[Any],
    lr: float,
    steps: int,
    trainer_kwargs: dict[str, Any],
    declared: int,
) -> _Observer:
    """Trains ``model`` on ``data`` with ``callback`` for ``steps`` steps, quietly; returns what was observed.

    ``declared`` is N as the world's datamodule declares it: the auditor gives every world the same N (neighbouring
    data sets under one public declaration), so a callback that read N off the data would show in the releases.
    """
    observer = _Observer()
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": steps,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    kwargs.update(trainer_kwargs)
    quiet = [logging.getLogger(name) for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric")]
    levels = [logger.level for logger in quiet]
    try:
        for logger in quiet:
            logger.setLevel(logging.WARNING)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.filterwarnings("ignore", message=".*(workers|val_dataloader|litlogger|IterableDataset|LeafSpec).*")
            module = _Module(model, lr)
            pl.Trainer(callbacks=[callback, observer], **kwargs).fit(module, datamodule=_Data(data, declared))
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return observer


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
    """The trainable parameters as one float64 vector on the CPU, where the auditor's reference runs."""
    return torch.cat([p.detach().double().reshape(-1) for _, p in _trainable(model)]).cpu()


@dataclass
class _World:
    """One world's measurements, per step t, in units of C.

    ``y``: the residual's projection on the canary's direction; ``m``: the canary's clipped norm by the
    reference; ``orthogonal``: (T, d) the residual less its projection (noise only); ``residual``: (T, d) the
    release less every other unit's clipped contribution; ``released``: the multiplier the callback logged for
    the step (NaN if none); ``ledger``: the Gaussian multiplier the world's ledger charges at each step;
    ``tensors``: (name, numel) of the audited parameters, in the order of the d coordinates.
    """

    callback: Any
    y: NDArray[np.float64]
    m: NDArray[np.float64]
    orthogonal: NDArray[np.float64]
    residual: NDArray[np.float64]
    released: NDArray[np.float64]
    ledger: NDArray[np.float64]
    tensors: list[tuple[str, int]]

    def scales(self) -> NDArray[np.float64]:
        """r_t: the released multiplier of each step; the ledger's where none was logged, else the configured z."""
        fallback = self.ledger if len(self.ledger) == len(self.y) else np.full(len(self.y), np.nan)
        scales = np.where(np.isfinite(self.released), self.released, fallback)
        return np.where(np.isfinite(scales), scales, float(self.callback.release.noise_multiplier(0)))


class CallbackAudit:
    """Audits a DP callback by training a small model with it, with and without a canary unit.

    Args:
        callback: builds the callback to audit from a seed (``lambda seed: DPSGD(..., seed=seed)``), configured
            as the run to audit is, with ``sample_rate=1.0``.
        model: builds the model (called once per world under the same torch seed: both worlds start equal).
            Its parameters that require grad are the ones audited; eval-mode layers stay in eval mode. Dropout
            (p > 0) and normalization that uses batch or running statistics must be in eval mode.
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

    Raises:
        PrivacyConfigError: a callback that samples (q < 1), population and canary tensors that do not match the
            privacy unit, P3SGD local mini-batches the reference cannot follow, or layers in training mode that the
            eval-mode reference cannot follow (Dropout, BatchNorm, normalization with running statistics).

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
        check_units(owner, self.level, population, canary)
        self.population = tuple(population)
        self.canary = tuple(canary)
        self.steps = check_count(owner, "steps", steps, "e.g. 200.", minimum=2)
        self.lr = float(lr)
        self.canary_weight = float(canary_weight)
        self._population_clipped: list[float] = []
        self._changed_state: list[str] = []
        if not 0.0 < significance < 1.0:
            raise PrivacyConfigError(f"`{owner}(significance={significance})`: must be in (0, 1), e.g. 0.05.")
        self.significance = float(significance)
        self.seed = int(seed)
        self.trainer_kwargs = dict(trainer_kwargs or {})
        if self.level == "patient":
            self._check_patient_settings(probe)
        self._check_followable()

    def _check_followable(self) -> None:
        """Refuses a model whose training-mode function the auditor's eval-mode reference cannot follow.

        Dropout draws random masks from a generator the auditor does not see; BatchNorm in training mode
        normalizes by the batch's (or the patient's) statistics, and a normalization layer that tracks running
        statistics uses them only in eval mode. In either case the reference computes other contributions than
        the callback did, the population is not subtracted, and the verdict reads a wrong residual (measured:
        a P3SGD clip 10× too large passed with a training-mode BatchNorm, ε_lower 151 against ε_upper 166).
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = self.model()
        found = [
            f"{name or 'model'} ({type(m).__name__}(p={m.p}))"
            for name, m in model.named_modules()
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0
        ]
        found += [
            f"{name or 'model'} ({type(m).__name__} in training mode)"
            for name, m in model.named_modules()
            if isinstance(m, _NormBase) and m.training and (isinstance(m, _BatchNorm) or m.track_running_stats)
        ]
        if found:
            raise PrivacyConfigError(
                f"`CallbackAudit`: {len(found)} layer(s) of the model behave differently in training mode, which the "
                f"auditor's eval-mode reference cannot follow: {', '.join(found[:5])}. Dropout draws masks the auditor "
                "does not see, and normalization in training mode uses batch statistics, so the other units' "
                "contributions cannot be subtracted and the verdict would read noise that is not there. HINT: audit "
                "the model with these layers in eval mode (call .eval() on them in the model factory: frozen, public "
                "statistics; dropout off) or replace BatchNorm by GroupNorm; the engines themselves are audited the "
                "same way."
            )

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
    @property
    def declared_units(self) -> int:
        """N as both worlds declare it: the units of the world with the canary (the same number in both)."""
        data = self._dataset(True)
        return int(data.num_patients) if self.level == "patient" else len(data)

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
        data = self._dataset(with_canary)
        observer = fit_world(model, callback, data, self.lr, self.steps, self.trainer_kwargs, self.declared_units)
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

    def _measure(self, callback: Any, observer: _Observer, data: _Units) -> _World:
        """One world's measurements, per step, in units of C (see `_World`).

        The residual is the release less every other unit's clipped contribution (the noise, plus the canary in
        the "in" world); y_t its projection on the canary's direction, the orthogonal noise the rest.
        """
        assert observer.model is not None
        clip = float(callback.clip_norm)
        n = float(callback.sample_rate) * self.declared_units  # the public normalizer q·N, N declared (both worlds)
        scale = float(callback.server_lr) if self.level == "patient" else -self.lr
        ys, norms, orthogonal, residuals = [], [], [], []
        for t in range(self.steps):
            theta, after = observer.thetas[t], observer.thetas[t + 1]
            released = (after - theta) * (n / scale)
            others, canary = self._contributions(observer.model, theta, callback)
            residual = (released - others) / clip
            direction = canary / canary.norm()
            along = float(residual @ direction)
            ys.append(along)
            norms.append(float(canary.norm()) / clip)
            orthogonal.append(residual - along * direction)
            residuals.append(residual)
        tensors = [(name, p.numel()) for name, p in _trainable(observer.model)]
        return _World(
            callback=callback,
            y=np.asarray(ys, dtype=np.float64),
            m=np.asarray(norms, dtype=np.float64),
            orthogonal=torch.stack(orthogonal).double().numpy(),
            residual=torch.stack(residuals).double().numpy(),
            released=np.asarray(observer.released, dtype=np.float64),
            ledger=ledger_multipliers(callback.ledger),
            tensors=tensors,
        )

    # ------------------------------------------------------------------ the audit
    def run(self) -> CallbackAuditResult:
        """Both worlds, the projections, the noise checks, the bound, and the accountant's ε for the "in" ledger."""
        worlds = {}
        for world in (True, False):
            callback, observer, data = self.fit(world)
            worlds[world] = self._measure(callback, observer, data)
        inside, outside = worlds[True], worlds[False]
        callback = inside.callback
        steps, d = inside.orthogonal.shape
        r_in, r_out = inside.scales(), outside.scales()
        checks = (
            fresh_noise(inside.orthogonal, outside.orthogonal, NOISE_CHECK_SIGNIFICANCE),
            noise_vs_ledger(
                (inside.orthogonal, outside.orthogonal),
                outside.residual,
                (inside.y, inside.m, outside.y),
                (inside.ledger, outside.ledger),
                inside.tensors,
                NOISE_CHECK_SIGNIFICANCE,
            ),
            noise_as_released((inside.orthogonal, outside.orthogonal), (r_in, r_out), NOISE_CHECK_SIGNIFICANCE),
        )
        # The per-step reading: step t in units of its own multiplier r_t, so every step is N(β·m_t/r_t, κ²).
        squares_in, squares_out = (inside.orthogonal**2).sum(1), (outside.orthogonal**2).sum(1)
        noise_ss = float((squares_in / r_in**2).sum() + (squares_out / r_out**2).sum())
        noise_dof = 2 * steps * (d - 1)
        m_in, m_out = inside.m / r_in, outside.m / r_out
        mu_lower, mu, beta = gdp_mu_lower(
            inside.y / r_in, m_in, outside.y / r_out, m_out, noise_ss, noise_dof, self.significance
        )
        # se(μ̂) by the delta method: var(β̂) = κ²(1/S_in + 1/S_out), var(κ̂)/κ² = 1/(2·dof), μ = β·√S_in/κ.
        mu_se = math.sqrt(1.0 + float(m_in @ m_in) / float(m_out @ m_out) + mu**2 / (2 * noise_dof))
        delta = float(callback.ledger.delta)
        epsilon_upper = float(callback.accountant.epsilon(callback.ledger))
        return CallbackAuditResult(
            mechanism=self.mechanism,
            level=self.level,
            steps=self.steps,
            epsilon_lower=gdp_epsilon(mu_lower, delta) if mu_lower > 0 else 0.0,
            epsilon_upper=epsilon_upper,
            mu_lower=mu_lower,
            mu=mu,
            mu_se=mu_se,
            mu_allowed=gdp_mu(epsilon_upper, delta),
            beta=beta,
            mean_in=float(inside.y.mean()),
            mean_out=float(outside.y.mean()),
            sd_in=float(inside.y.std(ddof=1)),
            sd_out=float(outside.y.std(ddof=1)),
            noise_sd=math.sqrt(float(squares_in.sum() + squares_out.sum()) / noise_dof),
            population_clipped=float(np.mean(self._population_clipped)),
            noise_multiplier=float(callback.release.noise_multiplier(0)),
            canary_norm=float(inside.m.mean()),
            checks=checks,
            changed_state=sorted(set(self._changed_state)),
            delta=delta,
            significance=self.significance,
            accountant=str(callback.accountant.name),
            in_projections=inside.y,
            out_projections=outside.y,
            released_multipliers=r_in,
            ledger_multipliers=inside.ledger,
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

    `CallbackAudit` reads each step at its own multiplier r_t: it passes y_t/r_t and m_t/r_t, and the squared
    noise divided by r_t², so that s is the common factor κ and μ = β·√(Σ m_t²/r_t²)/κ.

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
