"""The naive per-sample reference: every sample's gradient alone (autograd on a batch of one), clipped, summed.

Used to check `PerSampleClipper` (one forward + one backward for the whole batch) on layers and
whole networks. Run it in float64: fp32 round-off on deep networks would hide real errors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from lightning_dp.sanitization.per_sample import ClipStats, LossReduction, PerSampleClipper

#: ``batch_loss(model, *data)``: the batch's loss as the clipper gets it (a scalar for 'mean'/'sum', (B,) for 'none').
BatchLoss = Callable[..., Tensor]


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def naive_per_sample_grads(model: nn.Module, batch_loss: BatchLoss, data: tuple[Tensor, ...]) -> Tensor:
    """(B, n): row i is sample i's gradient alone over `trainable(model)`, from ``batch_loss`` on a batch of one."""
    params = trainable(model)
    rows = []
    for i in range(len(data[0])):
        loss = batch_loss(model, *(t[i : i + 1] for t in data)).sum()  # a batch of one: mean = sum = its loss
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)]))
    return torch.stack(rows)


def clip_norm_between(norms: Tensor) -> float:
    """A bound with half of the samples above it and half below (geometric mean of the middle two norms)."""
    ordered = norms.sort().values
    k = len(ordered) // 2
    assert ordered[k - 1] < ordered[k], "two middle norms coincide: pick other inputs"
    return float((ordered[k - 1] * ordered[k]).sqrt())


def engine_sum(clipper: PerSampleClipper, model: nn.Module) -> Tensor:
    """The clipper's flat sum re-ordered like `trainable(model)` (a parameter listed twice: its slices summed)."""
    by_param: dict[int, Tensor] = {}
    for p, view in clipper.views(clipper.flat_sum):
        by_param[id(p)] = by_param[id(p)] + view if id(p) in by_param else view.clone()
    return torch.cat([by_param[id(p)].reshape(-1) for p in trainable(model)])


def check_clipped_sum(
    model: nn.Module,
    batch_loss: BatchLoss,
    *data: Tensor,
    loss_reduction: LossReduction = "mean",
    rtol: float = 1e-10,
) -> ClipStats:
    """The clipper's clipped sum, norm sum and clipped count for one batch equal the naive loop's.

    The clip norm is chosen between the samples' norms, so that half of them are clipped.
    """
    grads = naive_per_sample_grads(model, batch_loss, data)
    norms = grads.norm(dim=1)
    clip_norm = clip_norm_between(norms)
    expected = ((clip_norm / norms).clamp(max=1.0)[:, None] * grads).sum(0)
    clipper = PerSampleClipper(model, clip_norm, loss_reduction)
    try:
        stats = clipper.accumulate(lambda: batch_loss(model, *data), len(data[0]))
        got = engine_sum(clipper, model)
    finally:
        clipper.remove()
    error = float((got - expected).norm() / expected.norm())
    assert error <= rtol, f"clipped sum off by {error:.2e} (relative)"
    assert abs(stats.norm_sum - float(norms.sum())) <= rtol * float(norms.sum())
    assert stats.clipped == int((norms > clip_norm).sum()) == len(norms) - len(norms) // 2
    assert stats.nonfinite == 0 and stats.batch_size == len(norms)
    assert all(p.grad is None and p.requires_grad for p in trainable(model))
    return stats
