"""Compression of teacher segmentation maps for PATE: one interface, PCA and an autoencoder.

A segmentation map has as many values as the image has pixels (d); voting per pixel would need noise
on every one of them. The thesis behind docs/algorithms/pate.md compresses each teacher's map to l ≪ d
numbers first and noises the mean of the K compressed maps. What makes that private is a bound on
how far **one** teacher can move the sum of the codes, whatever it predicts — the compressor's
`sensitivity`:

* `PCACompressor`: z = A(y − μ) with A the first l principal directions (orthonormal rows) of *public*
  maps. For maps y, y′ ∈ [0, 1]^d, ‖A(y − y′)‖ ≤ ‖y − y′‖ ≤ √d: the sensitivity is √d.
* `AutoencoderCompressor`: z = tanh(encoder(y)) ∈ [−1, 1]^l, so ‖z − z′‖ ≤ 2√l. The decoder is
  trained with Gaussian noise at the bottleneck so that it tolerates the aggregation's noise.

Both are fitted on public maps only; fitting is not a privacy release. `encode` refuses maps outside
[0, 1] (the bound would not hold), and `decode` returns maps clamped to [0, 1].
"""

from __future__ import annotations

import abc
import math
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dp.errors import PrivacyConfigError, check_count, check_finite_positive

__all__ = ["AutoencoderCompressor", "Compressor", "PCACompressor", "check_maps"]


def check_maps(owner: str, maps: Tensor, shape: tuple[int, ...] | None = None) -> Tensor:
    """``maps`` as float64 (N, *shape) after checking that every value is a finite number in [0, 1].

    Args:
        owner: who checks (named in the error).
        maps: (N, *map_shape) probabilities or binary maps.
        shape: the map shape the compressor was fitted on (checked when given).
    """
    if not isinstance(maps, Tensor) or maps.dim() < 2:
        found = tuple(maps.shape) if isinstance(maps, Tensor) else type(maps).__name__
        raise PrivacyConfigError(
            f"`{owner}`: expected a (N, ...) tensor of maps, found {found}. HINT: stack the maps along dimension 0."
        )
    if shape is not None and tuple(maps.shape[1:]) != shape:
        raise PrivacyConfigError(
            f"`{owner}`: maps of shape {tuple(maps.shape[1:])}, but the compressor was fitted on maps of shape "
            f"{shape}. HINT: predict at the size of the maps the compressor was fitted on."
        )
    values = maps.detach().to(torch.float64)
    bad = ~torch.isfinite(values) | (values < 0) | (values > 1)
    if bool(bad.any()):
        example = float(values[bad][0])
        raise PrivacyConfigError(
            f"`{owner}`: {int(bad.sum())} map values are outside [0, 1] (e.g. {example:.4g}; the range found is "
            f"[{float(values.nan_to_num().min()):.4g}, {float(values.nan_to_num().max()):.4g}]). The privacy of the "
            "aggregation rests on every teacher's map lying in [0, 1]. HINT: pass probabilities (sigmoid of the "
            "logits) or binary masks, not logits."
        )
    return values


class Compressor(abc.ABC):
    """Maps a segmentation map in [0, 1]^d to a code of l numbers and back.

    Subclasses set `sensitivity`: the largest L2 distance between the codes of two maps in [0, 1]^d
    (how far one teacher can move the sum of the K codes).
    """

    #: l, the number of values of a code.
    code_dim: int
    #: The shape of one map (fixed by `fit`).
    map_shape: tuple[int, ...] | None = None

    @property
    @abc.abstractmethod
    def sensitivity(self) -> float:
        """max ‖f(y) − f(y′)‖₂ over maps y, y′ in [0, 1]^d."""

    @abc.abstractmethod
    def fit(self, public_maps: Tensor) -> Compressor:
        """Fits the compressor on (M, *map_shape) **public** maps in [0, 1]; returns itself."""

    @abc.abstractmethod
    def _encode(self, maps: Tensor) -> Tensor: ...

    @abc.abstractmethod
    def _decode(self, codes: Tensor) -> Tensor: ...

    def _check_fitted(self) -> tuple[int, ...]:
        if self.map_shape is None:
            raise PrivacyConfigError(
                f"`{type(self).__name__}` is not fitted. HINT: call .fit(public_maps) with maps of public data first."
            )
        return self.map_shape

    def encode(self, maps: Tensor) -> Tensor:
        """(N, l) float64 codes of (N, *map_shape) maps in [0, 1] (refused outside [0, 1])."""
        shape = self._check_fitted()
        return self._encode(check_maps(f"{type(self).__name__}.encode", maps, shape))

    def decode(self, codes: Tensor) -> Tensor:
        """(N, *map_shape) float64 maps in [0, 1] from (N, l) codes."""
        shape = self._check_fitted()
        if codes.dim() != 2 or codes.shape[1] != self.code_dim:
            raise PrivacyConfigError(
                f"`{type(self).__name__}.decode`: codes of shape {tuple(codes.shape)}, expected (N, {self.code_dim})."
            )
        return self._decode(codes.to(torch.float64)).clamp(0.0, 1.0).reshape(codes.shape[0], *shape)

    def _check_code_dim(self, d: int, samples: int | None = None) -> None:
        owner = type(self).__name__
        if self.code_dim > d:
            raise PrivacyConfigError(
                f"`{owner}(code_dim={self.code_dim})`: the code is longer than the map it compresses (d = {d} pixels). "
                f"HINT: choose code_dim ≤ {d}; a few dozen components usually suffice."
            )
        if samples is not None and self.code_dim > samples:
            raise PrivacyConfigError(
                f"`{owner}(code_dim={self.code_dim})`: {samples} public maps give at most {samples} principal "
                f"components. HINT: choose code_dim ≤ {samples}, or fit on more public maps."
            )


class PCACompressor(Compressor):
    """f(y) = A(y − μ): the first ``code_dim`` principal components of public maps (sensitivity √d).

    Args:
        code_dim: l, the number of components kept.

    Example:
        >>> maps = (torch.rand(50, 1, 8, 8, generator=torch.Generator().manual_seed(0)) > 0.5).float()
        >>> pca = PCACompressor(code_dim=10).fit(maps)
        >>> pca.encode(maps[:2]).shape, pca.sensitivity
        (torch.Size([2, 10]), 8.0)
        >>> bool(pca.decode(pca.encode(maps[:2])).max() <= 1.0)
        True
    """

    def __init__(self, code_dim: int) -> None:
        self.code_dim = check_count("PCACompressor", "code_dim", code_dim, "e.g. 32 components.", minimum=1)
        self.components: Tensor | None = None  # (l, d), orthonormal rows
        self.mean: Tensor | None = None  # (d,)

    @property
    def sensitivity(self) -> float:
        shape = self._check_fitted()
        return math.sqrt(math.prod(shape))

    def fit(self, public_maps: Tensor) -> PCACompressor:
        maps = check_maps("PCACompressor.fit", public_maps)
        flat = maps.reshape(maps.shape[0], -1)
        self._check_code_dim(flat.shape[1], flat.shape[0])
        mean = flat.mean(0)
        # Right singular vectors: orthonormal rows, so ‖A v‖ ≤ ‖v‖ for every v (the sensitivity bound).
        _, _, vh = torch.linalg.svd(flat - mean, full_matrices=False)
        self.components = vh[: self.code_dim].contiguous()
        self.mean = mean
        self.map_shape = tuple(maps.shape[1:])
        return self

    def _encode(self, maps: Tensor) -> Tensor:
        assert self.components is not None and self.mean is not None
        return (maps.reshape(maps.shape[0], -1) - self.mean) @ self.components.T

    def _decode(self, codes: Tensor) -> Tensor:
        assert self.components is not None and self.mean is not None
        return codes @ self.components + self.mean

    def state_dict(self) -> dict[str, Any]:
        return {"code_dim": self.code_dim, "components": self.components, "mean": self.mean, "shape": self.map_shape}


class _MapAutoencoder(nn.Module):
    """A small MLP autoencoder for (d,) maps: sigmoid output, tanh bottleneck."""

    def __init__(self, d: int, code_dim: int, hidden: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, code_dim), nn.Tanh())
        self.decoder = nn.Sequential(nn.Linear(code_dim, hidden), nn.ReLU(), nn.Linear(hidden, d))


class AutoencoderCompressor(Compressor):
    """An autoencoder with a tanh bottleneck (z ∈ [−1, 1]^l, sensitivity 2√l), trained on public maps.

    During training Gaussian noise of std ``bottleneck_noise`` is added to the code before decoding,
    so the decoder learns to tolerate the aggregation's noise (set it to the noise std the aggregated
    code will carry, `PATEAggregator.noise_std`).

    Args:
        code_dim: l, the bottleneck width.
        hidden: width of the hidden layer of encoder and decoder.
        bottleneck_noise: std of the Gaussian noise added to the code while training (≥ 0); ``None``: the
            aggregation's noise std, set by `PATEStudentDataModule` (0 when fitted directly).
        epochs: passes over the public maps.
        lr: Adam's learning rate.
        batch_size: maps per training step.
        seed: seed of the initialization, the shuffling and the training noise (public data only).

    Example:
        >>> maps = (torch.rand(64, 1, 8, 8, generator=torch.Generator().manual_seed(0)) > 0.5).float()
        >>> ae = AutoencoderCompressor(code_dim=4, hidden=16, epochs=2, seed=0).fit(maps)
        >>> codes = ae.encode(maps[:3])
        >>> codes.shape, bool(codes.abs().max() <= 1.0), ae.sensitivity
        (torch.Size([3, 4]), True, 4.0)
    """

    def __init__(
        self,
        code_dim: int,
        hidden: int = 256,
        bottleneck_noise: float | None = 0.0,
        epochs: int = 200,
        lr: float = 1e-3,
        batch_size: int = 64,
        seed: int = 0,
    ) -> None:
        owner = "AutoencoderCompressor"
        self.code_dim = check_count(owner, "code_dim", code_dim, "e.g. 16.", minimum=1)
        self.hidden = check_count(owner, "hidden", hidden, "e.g. 256.", minimum=1)
        if bottleneck_noise is not None and (
            isinstance(bottleneck_noise, bool) or not math.isfinite(bottleneck_noise) or bottleneck_noise < 0
        ):
            raise PrivacyConfigError(
                f"`{owner}(bottleneck_noise={bottleneck_noise!r})`: must be a finite number ≥ 0. HINT: the noise std "
                "the aggregated code will carry (PATEAggregator.noise_std), or 0."
            )
        self.bottleneck_noise = None if bottleneck_noise is None else float(bottleneck_noise)
        self.epochs = check_count(owner, "epochs", epochs, "e.g. 200.", minimum=1)
        self.lr = check_finite_positive(owner, "lr", lr, "e.g. 1e-3.")
        self.batch_size = check_count(owner, "batch_size", batch_size, "e.g. 64.", minimum=1)
        self.seed = int(seed)
        self.net: _MapAutoencoder | None = None

    @property
    def sensitivity(self) -> float:
        return 2.0 * math.sqrt(self.code_dim)

    def fit(self, public_maps: Tensor) -> AutoencoderCompressor:
        maps = check_maps("AutoencoderCompressor.fit", public_maps)
        flat = maps.reshape(maps.shape[0], -1).float()
        self._check_code_dim(flat.shape[1])
        generator = torch.Generator().manual_seed(self.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            net = _MapAutoencoder(flat.shape[1], self.code_dim, self.hidden)
        optimizer = torch.optim.Adam(net.parameters(), lr=self.lr)
        loss_fn = nn.BCEWithLogitsLoss()
        for _ in range(self.epochs):
            order = torch.randperm(flat.shape[0], generator=generator)
            for start in range(0, flat.shape[0], self.batch_size):
                batch = flat[order[start : start + self.batch_size]]
                code = net.encoder(batch)
                if self.bottleneck_noise:
                    code = code + self.bottleneck_noise * torch.randn(code.shape, generator=generator)
                loss = loss_fn(net.decoder(code), batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        self.net = net.eval().requires_grad_(False)
        self.map_shape = tuple(maps.shape[1:])
        return self

    @torch.no_grad()
    def _encode(self, maps: Tensor) -> Tensor:
        assert self.net is not None
        return self.net.encoder(maps.reshape(maps.shape[0], -1).float()).double().clamp(-1.0, 1.0)

    @torch.no_grad()
    def _decode(self, codes: Tensor) -> Tensor:
        assert self.net is not None
        return torch.sigmoid(self.net.decoder(codes.float())).double()
