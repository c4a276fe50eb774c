"""Losses over patients' images at the current weights (what P3SGD's selection and energies score); no Lightning.

* `round_loss`: the mean loss over a round's images (the exponential mechanism's score of a candidate update).
* `patient_losses`: the mean loss of each of a round's patients (a private energy's per-unit losses).
* `check_returns_loss`: the start-up check that ``training_step`` returns a scalar loss.

Each patient's images are fetched drawing from its own stream (`lightning_dp.training.patient_rounds.images_loss`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain, islice

import torch
from torch import Tensor

from lightning_dp.errors import PrivacyConfigError
from lightning_dp.sampling.randomness import UnitStreams
from lightning_dp.training.batches import returned_loss
from lightning_dp.training.checks import readable
from lightning_dp.training.patient_rounds import RoundParts, images_loss

__all__ = ["check_returns_loss", "patient_losses", "round_loss"]


@torch.no_grad()
def round_loss(
    parts: RoundParts,
    patients: Sequence[int],
    streams: UnitStreams,
    images_per_pass: int | None,
    reduce: Callable[[Tensor], Tensor],
) -> float:
    """The mean loss over ``patients``' images at the model's current weights (summed over ranks), eval mode.

    Args:
        parts: the round's parts.
        patients: this rank's patients of the round.
        streams: fresh streams of the round (every candidate is scored on the same images).
        images_per_pass: the images of all the patients go through in chunks of this many; None: patient by patient,
            in local batches. The mean is the same either way.
        reduce: sums a tensor over the ranks.
    """
    total = torch.zeros(2, dtype=torch.float64, device=parts.device)
    if images_per_pass is not None:
        total[0] += images_loss(parts, patients, images_per_pass, streams)
        total[1] += sum(parts.data.size(p) for p in patients)
    else:
        for patient in patients:
            total[0] += images_loss(parts, [patient], parts.local.batch_size, streams)
            total[1] += parts.data.size(patient)
    total = reduce(total)
    return float(total[0] / total[1]) if total[1] > 0 else 0.0


def patient_losses(parts: RoundParts, patients: Sequence[int], streams: UnitStreams) -> Tensor:
    """The mean loss of each of ``patients`` (float64), at the model's current weights, eval mode."""
    values = [images_loss(parts, [p], parts.local.batch_size, streams) / max(parts.data.size(p), 1) for p in patients]
    return torch.tensor(values, dtype=torch.float64)


@torch.no_grad()
def check_returns_loss(parts: RoundParts) -> None:
    """Runs ``training_step`` on two images (the first readable ones, patient by patient); the model is restored.

    An image whose read raises is skipped (`checks.readable`). Fewer than two readable among the first 256: not
    checked (a loss that is not a scalar still fails the local step's ``backward``).

    Raises:
        PrivacyConfigError: it does not return a scalar loss tensor (or ``{"loss": tensor}``).
    """
    candidates = list(islice(chain.from_iterable(parts.data.groups), 256))
    items = [item for _, item in readable(parts.data.dataset, candidates, limit=2)]
    if len(items) < min(2, len(candidates)):
        return
    state = parts.state
    theta, other = state.vector(), state.snapshot_other_buffers()
    out = parts.step(parts.data.collated(items), 0)
    state.load(theta, other)
    loss = returned_loss(out)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise PrivacyConfigError(
            f"`P3SGD`: {type(parts.module).__name__}.training_step returned {type(out).__name__}, not a scalar loss "
            "tensor. HINT: return the loss (or {'loss': loss}) from training_step."
        )
