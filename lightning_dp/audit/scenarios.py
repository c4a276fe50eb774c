"""Small, fast `CallbackAudit` set-ups that cover every layer-rule family and both engines.

Each function returns a ready `CallbackAudit` on synthetic 8×8 one-channel images: a population of
ordinary units whose gradients stay below the clip norm, and a canary whose loss is weighted so that its
gradient (or local update) is far above it. They are what the test suite and
``examples/audit_mutation_table.py`` audit, and a template for auditing a configuration of one's own.

* ``dpsgd_audit("conv")``: Conv2d (materialized per-sample gradients at 8×8), GroupNorm (Opacus' grad
  sampler), Conv2d at 2×2 (ghost norm), Linear (ghost norm).
* ``dpsgd_audit("transpose")``: Conv2d, ConvTranspose2d, an eval-mode BatchNorm with a trainable affine
  (the library's eval-BatchNorm rule), Linear.
* ``dpsgd_audit("kept")``: Conv2d(16, 16, 3) at 8×8, whose input and output gradient are smaller than its
  per-sample gradients while the ghost norm is not chosen (the engine keeps them for the clipped sum:
  `KeptInputsTerm`), and a 3×3 Conv2d with dilation 4 at 4×4, where only the centre tap reads the input (the
  per-sample gradients are materialized tap by tap: `_live_taps`).
* ``p3sgd_audit(...)``: an MLP over patients of 3 images (with an int64 buffer that counts the images it sees and
  a frozen parameter that keeps their running mean, which P3SGD must restore after every patient), one or several
  local steps, one or several noise scales (the exponential-mechanism selection).
* ``coupling_audit(...)``: the paired-world `SensitivityAudit` with canaries that expose coupling between units (a
  sample whose terms cancel, an adversarial neighbour, augmented patients).
* ``federated_scenario(...)``: the `FederatedAudit` of federated P3SGD through Flower, a canary patient at one of
  three hospitals.

The DPSGD scenarios split each step into physical chunks of 4 samples (``max_physical_batch_size=4``), so
the accumulation across chunks is audited too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from lightning_dp.audit.callback_audit import CallbackAudit
from lightning_dp.audit.federated import FederatedAudit
from lightning_dp.audit.sensitivity import SensitivityAudit
from lightning_dp.callbacks.dpsgd import DPSGD
from lightning_dp.callbacks.p3sgd import P3SGD

__all__ = ["coupling_audit", "dpsgd_audit", "federated_scenario", "p3sgd_audit"]

#: The canary's loss is weighted by this much: its gradient (or local update) is far above C whatever the
#: model does to its input's scale, while the population's stay below C.
CANARY_WEIGHT = 50.0


def _conv_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.AvgPool2d(4),
        nn.Conv2d(4, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 2 * 2, 2),
    )


def _transpose_net() -> nn.Module:
    norm = nn.BatchNorm2d(4)
    assert norm.running_mean is not None and norm.running_var is not None
    with torch.no_grad():  # public running statistics, frozen: the eval-mode BatchNorm rule
        norm.running_mean.uniform_(-0.1, 0.1)
        norm.running_var.uniform_(0.5, 1.5)
    norm.eval()
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.ConvTranspose2d(4, 4, 2, stride=2),
        norm,
        nn.ReLU(),
        nn.AvgPool2d(4),
        nn.Flatten(),
        nn.Linear(4 * 2 * 2, 2),
    )


def _kept_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),  # T·(d + p) = 64·160 ≥ d·p = 2304: materialized; 2048 < 2304 numbers kept
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Conv2d(16, 8, 3, padding=4, dilation=4),  # at 4×4 the outer taps read only padding: tap by tap
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 2),
    )


class _ImageCounter(nn.Module):
    """Counts the images it sees in training mode, and keeps their running mean in a frozen parameter.

    An int64 buffer and a frozen ``nn.Parameter`` that a patient's data changes: P3SGD must restore both.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen: torch.Tensor
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.mean = nn.Parameter(torch.zeros(1, 8, 8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.add_(len(x))
            with torch.no_grad():
                self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x


def _mlp() -> nn.Module:
    return nn.Sequential(_ImageCounter(), nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 2))


def _plain_mlp() -> nn.Module:
    """The MLP without the counter: the vectorized round refuses a training_step that changes buffers."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 2))


def _images(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(count, 1, 8, 8, generator=g), torch.randint(0, 2, (count,), generator=g)


def dpsgd_audit(
    model: Literal["conv", "transpose", "kept"] = "conv",
    *,
    steps: int = 200,
    noise_multiplier: float = 0.5,
    clip_norm: float = 3.0,
    population: int = 12,
    accountant: Literal["rdp", "prv"] = "rdp",
    seed: int = 0,
) -> CallbackAudit:
    """A full-batch `DPSGD` audit of one of the two models (see the module docstring)."""
    x, y = _images(population + 1, seed)
    factory = {"conv": _conv_net, "transpose": _transpose_net, "kept": _kept_net}[model]
    return CallbackAudit(
        lambda s: DPSGD(
            sample_rate=1.0,
            noise_multiplier=noise_multiplier,
            clip_norm=clip_norm,
            delta=1e-5,
            accountant=accountant,
            max_physical_batch_size=4,
            seed=s,
        ),
        model=factory,
        population=(x[1:], y[1:]),
        canary=(x[:1], 1 - y[:1]),
        canary_weight=CANARY_WEIGHT,
        steps=steps,
        lr=0.05,
        seed=seed,
    )


def p3sgd_audit(
    *,
    noise_scales: Sequence[float] = (0.5,),
    local_steps: int = 1,
    steps: int = 200,
    clip_norm: float = 0.5,
    patients: int = 10,
    images_per_patient: int = 3,
    vectorize: Literal["auto", False] = False,
    seed: int = 0,
) -> CallbackAudit:
    """A full-batch `P3SGD` audit: patients of ``images_per_patient`` images, ``local_steps`` local SGD steps.

    ``vectorize="auto"`` audits the batched round (one local step: every patient's gradient in one pass of the
    per-sample engine), or with ``local_steps`` > 1 stacked local SGD (torch.func over the patients' parameter
    copies), instead of the patient-by-patient loop.
    """
    x, y = _images((patients + 1) * images_per_patient, seed)
    ids = torch.arange(patients).repeat_interleave(images_per_patient)
    k = images_per_patient
    selection = {"selection_epsilon": 0.5, "loss_bound": 3.0} if len(noise_scales) > 1 else {}
    return CallbackAudit(
        lambda s: P3SGD(
            sample_rate=1.0,
            clip_norm=clip_norm,
            noise_scales=tuple(noise_scales),
            local_lr=0.1,
            local_batch_size=k,
            local_epochs=local_steps,
            server_lr=0.1,
            vectorize=vectorize,
            delta=1e-5,
            seed=s,
            **selection,  # type: ignore[arg-type]
        ),
        model=_mlp if vectorize is False else _plain_mlp,
        population=(x[k:], y[k:], ids),
        canary=(x[:k], 1 - y[:k]),
        canary_weight=CANARY_WEIGHT / 2,
        steps=steps,
        seed=seed,
    )


class _TwoPositions(nn.Module):
    """Conv2d(16 → 16, 3×3) at 8×8 read at two positions with opposite signs, then a linear head.

    The convolution's per-sample gradients are materialized and its clipped sum is computed from the kept input
    and output gradient (`KeptInputsTerm`); a sample with the same receptive field at both positions has a
    convolution gradient of exactly 0, whatever its size.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        with torch.no_grad():  # multiples of 2⁻¹⁰: a canary's products with 2²⁷ add up exactly in any order
            self.conv.weight.copy_((self.conv.weight * 1024).round() / 1024)
        mask = torch.zeros(1, 1, 8, 8)
        mask[..., 1, 1], mask[..., 6, 6] = 1.0, -1.0
        self.mask: torch.Tensor
        self.register_buffer("mask", mask)
        self.head = nn.Linear(16, 2, bias=False)  # a sample whose two positions agree has a gradient of exactly 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((self.conv(x) * self.mask).sum((2, 3)))


def _zero_linear() -> nn.Module:
    """A bias-free Linear(4, 2) at zero: every sample's softmax is (½, ½) at the audited step."""
    layer = nn.Linear(4, 2, bias=False)
    nn.init.zeros_(layer.weight)
    return layer


def _random_flip(x: torch.Tensor) -> torch.Tensor:
    """The image or its negative, at random (from the global generator, as a torchvision transform draws)."""
    return x if float(torch.rand(())) < 0.5 else -x


def coupling_audit(
    kind: Literal["cancel", "neighbour", "augment", "normalizer"], *, runs: int = 2, seed: int = 0
) -> SensitivityAudit:
    """A paired-world `SensitivityAudit` whose canary exposes one kind of coupling between units.

    * ``"cancel"`` (DPSGD): `_TwoPositions` on 24 positive images of one class (their clipped gradients add up to
      ≈ 24·C in one direction); the canary is H = 2²⁷ at the two read positions of every channel: its gradient is
      exactly 0 (its two outputs agree in any float order), so it is not clipped, and only a guard keeps its ±H
      terms out of the pooled sum, where they would erase the others' terms.
    * ``"neighbour"`` (DPSGD): `_zero_linear`; the last population sample has the canary's image scaled to a
      gradient of 0.9·C in the opposite direction: clipped together with the canary (one clip group for two
      units), the pair's contribution replaces the neighbour's and the canary moves the sum by ≈ 1.45·C.
    * ``"augment"`` (P3SGD): patients of 3 images whose images are negated at random when fetched; the canary is
      the first patient: drawn in processing order, its draws would shift every later patient's flips.
    * ``"normalizer"`` (DPSGD, Poisson-sampled at q = ½): 12 small samples and a canary far above C, appended last
      (both worlds sample the same others). Divided by the public q·N the two releases differ by the canary's clipped
      gradient; divided by the step's private sample size, the same noise is scaled differently in the two worlds
      and the difference is many C.
    """
    g = torch.Generator().manual_seed(seed)
    if kind == "cancel":
        x = torch.rand(24, 16, 8, 8, generator=g) + 0.5
        canary = torch.zeros(1, 16, 8, 8)
        canary[0, :, 1, 1] = canary[0, :, 6, 6] = 2.0**27
        return SensitivityAudit(
            lambda s: DPSGD(sample_rate=1.0, noise_multiplier=0.5, clip_norm=0.05, delta=1e-5, seed=s),
            model=_TwoPositions,
            population=(x, torch.zeros(24, dtype=torch.long)),
            canary=(canary, torch.zeros(1, dtype=torch.long)),
            runs=runs,
            seed=seed,
        )
    if kind == "neighbour":
        x = 0.1 * torch.randn(12, 4, generator=g)
        canary = torch.tensor([[10.0, 0.0, 0.0, 0.0]])  # gradient (−½, ½)ᵀ·xᵀ of norm 7.07 at class 0
        x[-1] = canary[0] * (0.9 / (10.0 * 0.5**0.5))  # at class 1: the opposite direction, norm 0.9
        y = torch.randint(0, 2, (12,), generator=g)
        y[-1] = 1
        return SensitivityAudit(
            lambda s: DPSGD(sample_rate=1.0, noise_multiplier=0.5, clip_norm=1.0, delta=1e-5, seed=s),
            model=_zero_linear,
            population=(x, y),
            canary=(canary, torch.zeros(1, dtype=torch.long)),
            runs=runs,
            seed=seed,
        )
    if kind == "normalizer":
        x = 0.1 * torch.randn(12, 4, generator=g)
        return SensitivityAudit(
            lambda s: DPSGD(sample_rate=0.5, noise_multiplier=0.5, clip_norm=1.0, delta=1e-5, seed=s),
            model=_zero_linear,
            population=(x, torch.randint(0, 2, (12,), generator=g)),
            canary=(torch.tensor([[10.0, 0.0, 0.0, 0.0]]), torch.zeros(1, dtype=torch.long)),
            runs=runs,
            seed=seed,
        )
    x, y = _images(27, seed)
    return SensitivityAudit(
        lambda s: P3SGD(
            sample_rate=1.0, clip_norm=0.05, local_lr=0.5, local_batch_size=3, server_lr=0.1, delta=1e-5, seed=s
        ),
        model=_plain_mlp,
        population=(x[3:], y[3:], torch.arange(8).repeat_interleave(3)),
        canary=(x[:3], y[:3]),
        augment=_random_flip,
        runs=runs,
        seed=seed,
    )


def federated_scenario(
    *,
    rounds: int = 20,
    seed: int = 0,
    noise_at: Literal["server", "sites"] = "server",
    secure_aggregation: bool = False,
    drop: dict[str, list[int]] | None = None,
) -> FederatedAudit:
    """A `FederatedAudit` of three hospitals (5, 4 and 6 patients of 3 images, 16 features) and a canary at "a".

    An MLP 16 → 8 → 2 (154 parameters), q = ½ at every site, C = 0.5, z = 1, one full-batch local SGD step per
    patient (lr 0.2), server_lr 1. The canary patient's images are 10× larger than the others' and labelled against
    the initial model's prediction, its loss weighted by `CANARY_WEIGHT`: its local update is far above C (even 2C).
    ``noise_at="sites"``: each hospital adds a share z·C/√3 (with ``secure_aggregation``, summed by SecAgg+);
    ``drop``: hospitals that miss rounds (see `FederatedAudit`).
    """
    g = torch.Generator().manual_seed(seed)
    sites = {}
    for name, count in (("a", 5), ("b", 4), ("c", 6)):
        x = torch.randn(3 * count, 16, generator=g)
        sites[name] = (x, (x[:, 0] > 0).long(), torch.arange(count).repeat_interleave(3))
    canary = 10 * torch.randn(3, 16, generator=g)
    torch.manual_seed(seed)
    with torch.no_grad():
        labels = _federated_mlp()(canary).argmax(1) ^ 1  # the class the initial model finds least likely
    return FederatedAudit(
        model=_federated_mlp,
        sites=sites,
        canary=(canary, labels),
        canary_site="a",
        sample_rate=0.5,
        clip_norm=0.5,
        noise_multiplier=1.0,
        rounds=rounds,
        canary_weight=CANARY_WEIGHT,
        seed=seed,
        noise_at=noise_at,
        secure_aggregation=secure_aggregation,
        drop=drop,
    )


def _federated_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2))
