"""Augmentation multiplicity in `PerSampleClipper.accumulate(group_size=K)` (De et al. 2022).

A batch of n samples arrives as n·K rows, sample-major. Sample i's gradient is the *mean* of its K
views' gradients, and that mean is what is clipped to C. The reference below is independent of the
engine: every row's gradient by autograd on that row alone, averaged over the sample's K views,
clipped, summed. Everything runs in float64 with a relative tolerance of 1e-10 (the engine computes
the same sums in another order; fp64 round-off is ~1e-15).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock

from lightning_dp.errors import PrivacyConfigError
from lightning_dp.sanitization import rules
from lightning_dp.sanitization.per_sample import LossReduction, PerSampleClipper, UnsupportedModelError

RTOL = 1e-10
SAMPLES, VIEWS = 4, 3


# ---------------------------------------------------------------------- the independent reference
def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _row_losses(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """One loss per row: cross-entropy plus a smooth non-linear term (so that views' gradients differ in norm)."""
    out = model(x)
    return F.cross_entropy(out, y, reduction="none") + 0.1 * out.pow(2).sum(1)


def _batch_loss(model: nn.Module, x: Tensor, y: Tensor, reduction: LossReduction) -> Tensor:
    rows = _row_losses(model, x, y)
    return rows.mean() if reduction == "mean" else rows.sum() if reduction == "sum" else rows


def _naive_sample_grads(model: nn.Module, x: Tensor, y: Tensor, views: int) -> Tensor:
    """(n, P): sample i's gradient, the mean over its K views of each view's gradient alone (one row at a time)."""
    params = _trainable(model)
    rows = []
    for r in range(len(x)):
        grads = torch.autograd.grad(_row_losses(model, x[r : r + 1], y[r : r + 1]).sum(), params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)]))
    return torch.stack(rows).reshape(len(x) // views, views, -1).mean(1)


def _clipped_sum(grads: Tensor, clip_norm: float) -> Tensor:
    return ((clip_norm / grads.norm(dim=1)).clamp(max=1.0)[:, None] * grads).sum(0)


def _engine_vector(clipper: PerSampleClipper, model: nn.Module) -> Tensor:
    """The clipper's flat sum in the order of `_trainable(model)`."""
    by_param = {id(p): view for p, view in clipper.views(clipper.flat_sum)}
    return torch.cat([by_param[id(p)].reshape(-1) for p in _trainable(model)])


def _relative_error(got: Tensor, want: Tensor) -> float:
    return float((got - want).norm() / want.norm())


# ---------------------------------------------------------------------- models
class _TwoCalls(nn.Module):
    """One Linear called twice (two records of one layer: the engine's multi-call path)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


class _Residual(nn.Module):
    """torchvision's BasicBlock with GroupNorm, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block = BasicBlock(4, 4, norm_layer=lambda c: nn.GroupNorm(2, c))
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.stem(x)).mean((2, 3)))


def _linear() -> tuple[nn.Module, Tensor]:
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)), torch.randn(SAMPLES * VIEWS, 6)


def _conv_groupnorm() -> tuple[nn.Module, Tensor]:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(), nn.Linear(36, 3)
    )
    return model, torch.randn(SAMPLES * VIEWS, 3, 5, 5)


def _two_calls() -> tuple[nn.Module, Tensor]:
    return _TwoCalls(), torch.randn(SAMPLES * VIEWS, 6)


def _residual() -> tuple[nn.Module, Tensor]:
    return _Residual(), torch.randn(SAMPLES * VIEWS, 3, 6, 6)


def _wide_linear() -> tuple[nn.Module, Tensor]:
    return nn.Sequential(nn.Linear(40, 48), nn.Tanh(), nn.Linear(48, 3)), torch.randn(SAMPLES * VIEWS, 40)


def _sequence_linear() -> tuple[nn.Module, Tensor]:
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Flatten(), nn.Linear(128, 3))
    return model, torch.randn(SAMPLES * VIEWS, 4, 32)


def _deep_conv() -> tuple[nn.Module, Tensor]:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(128, 3),
    )
    return model, torch.randn(SAMPLES * VIEWS, 3, 5, 5)


MODELS: dict[str, Callable[[], tuple[nn.Module, Tensor]]] = {
    "linear": _linear,
    "conv_groupnorm": _conv_groupnorm,
    "layer_called_twice": _two_calls,
    "resnet_basic_block": _residual,
    "wide_linear": _wide_linear,
    "sequence_linear": _sequence_linear,
    "deep_conv": _deep_conv,
}
#: What each Linear/Conv layer of a model takes with K = 3 views: the ghost norm over a sample's K·T positions
#: when K·T·(d + p) < d·p, else the materialized rows' gradients, summed per sample.
GROUPED_PATHS = {
    "linear": ["materialized", "materialized"],
    "conv_groupnorm": ["materialized", "materialized", "materialized"],
    "layer_called_twice": ["materialized"],  # the twice-called layer is summed over its calls by the engine
    "resnet_basic_block": ["materialized"] * 4,
    "wide_linear": ["ghost", "materialized"],
    "sequence_linear": ["ghost", "materialized"],
    "deep_conv": ["materialized", "ghost", "materialized"],
}


def _spy_grouped(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    original = rules.ProductRule.grouped_norms

    def spy(self: rules.ProductRule, *args: Any) -> tuple[Tensor, rules.ClippedSumTerm]:
        sq, item = original(self, *args)
        seen.append("ghost" if isinstance(item, rules.RowsTerm) else "materialized")
        return sq, item

    monkeypatch.setattr(rules.ProductRule, "grouped_norms", spy)
    return seen


def _case(name: str) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model, x = MODELS[name]()
    y = torch.arange(len(x)) % 3
    return model.double(), x.double(), y


def _accumulate(
    model: nn.Module, x: Tensor, y: Tensor, clip_norm: float, reduction: LossReduction, views: int
) -> tuple[Tensor, Any]:
    clipper = PerSampleClipper(model, clip_norm, loss_reduction=reduction)
    try:
        stats = clipper.accumulate(lambda: _batch_loss(model, x, y, reduction), len(x) // views, group_size=views)
        return _engine_vector(clipper, model), stats
    finally:
        clipper.remove()


# ---------------------------------------------------------------------- the clipped sum equals the reference
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(MODELS))
def test_clipped_sum_of_view_means_matches_the_naive_reference(
    name: str, reduction: LossReduction, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = _spy_grouped(monkeypatch)
    model, x, y = _case(name)
    grads = _naive_sample_grads(model, x, y, VIEWS)
    norms = grads.norm(dim=1)
    ordered = norms.sort().values
    clip_norm = float((ordered[1] * ordered[2]).sqrt())  # two samples clipped, two not
    got, stats = _accumulate(model, x, y, clip_norm, reduction, VIEWS)
    assert _relative_error(got, _clipped_sum(grads, clip_norm)) <= RTOL
    assert stats.batch_size == SAMPLES and stats.clipped == 2 and stats.nonfinite == 0
    assert stats.norm_sum == pytest.approx(float(norms.sum()), rel=RTOL)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    assert sorted(paths) == sorted(GROUPED_PATHS[name]), "the premise: both paths are covered by these models"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_mean_of_the_views_is_clipped_not_each_view_nor_their_sum(reduction: LossReduction) -> None:
    # A bound above every sample's mean gradient and below every single view's gradient: the mean is not
    # clipped at all, while clipping each view (or the views' sum) would clip every sample.
    model, x, y = _case("linear")
    means = _naive_sample_grads(model, x, y, VIEWS)
    views = _naive_sample_grads(model, x, y, 1).reshape(SAMPLES, VIEWS, -1)
    highest_mean, lowest_view = float(means.norm(dim=1).max()), float(views.norm(dim=2).min())
    assert highest_mean < lowest_view, "pick other inputs"
    clip_norm = (highest_mean * lowest_view) ** 0.5
    got, stats = _accumulate(model, x, y, clip_norm, reduction, VIEWS)
    assert stats.clipped == 0
    assert _relative_error(got, means.sum(0)) <= RTOL
    each_view_clipped = torch.stack([_clipped_sum(views[:, k], clip_norm) for k in range(VIEWS)]).mean(0)
    assert _relative_error(got, each_view_clipped) > 1e-2
    assert _relative_error(got, _clipped_sum(views.sum(1), clip_norm)) > 1e-2


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_identical_views_give_the_single_view_result(reduction: LossReduction) -> None:
    model, x, y = _case("conv_groupnorm")
    once_x, once_y = x[::VIEWS], y[::VIEWS]
    repeated_x, repeated_y = once_x.repeat_interleave(VIEWS, 0), once_y.repeat_interleave(VIEWS, 0)
    single, _ = _accumulate(model, once_x, once_y, 0.05, reduction, 1)
    grouped, stats = _accumulate(model, repeated_x, repeated_y, 0.05, reduction, VIEWS)
    assert stats.batch_size == SAMPLES
    assert _relative_error(grouped, single) <= 1e-12


# ---------------------------------------------------------------------- the bound: one contribution of norm <= C
@pytest.mark.parametrize("scale", [1e3, 1e8, 1e15])
def test_a_sample_with_huge_gradients_in_all_views_adds_at_most_clip_norm(scale: float) -> None:
    model, x, y = _case("conv_groupnorm")
    model = model.float()
    x = x.float()
    x[:VIEWS] *= scale  # every view of sample 0
    clip_norm = 0.3
    with_it = PerSampleClipper(model, clip_norm, loss_reduction="mean")
    stats = with_it.accumulate(lambda: _batch_loss(model, x, y, "mean"), SAMPLES, group_size=VIEWS)
    without = PerSampleClipper(model, clip_norm, loss_reduction="mean")
    without.accumulate(lambda: _batch_loss(model, x[VIEWS:], y[VIEWS:], "mean"), SAMPLES - 1, group_size=VIEWS)
    contribution = with_it.flat_sum - without.flat_sum
    assert stats.batch_size == SAMPLES and stats.nonfinite == 0 and stats.clipped >= 1
    assert float(contribution.norm()) <= clip_norm * (1 + 1e-5)
    alone = PerSampleClipper(model, clip_norm, loss_reduction="mean")
    alone.accumulate(lambda: _batch_loss(model, x[:VIEWS], y[:VIEWS], "mean"), 1, group_size=VIEWS)
    assert float(alone.flat_sum.norm()) == pytest.approx(clip_norm, rel=1e-5)
    for clipper in (with_it, without, alone):
        clipper.remove()


def test_every_samples_contribution_is_bounded_by_clip_norm() -> None:
    model, x, y = _case("resnet_basic_block")
    x = x * torch.logspace(-2, 4, SAMPLES, dtype=torch.float64).repeat_interleave(VIEWS)[:, None, None, None]
    clip_norm = 0.1
    for i in range(SAMPLES):
        rows = slice(i * VIEWS, (i + 1) * VIEWS)
        got, _ = _accumulate(model, x[rows], y[rows], clip_norm, "sum", VIEWS)
        assert float(got.norm()) <= clip_norm * (1 + 1e-12)


@pytest.mark.parametrize("name", ["linear", "wide_linear"], ids=["materialized", "ghost"])
def test_a_non_finite_view_drops_its_sample_only(name: str) -> None:
    model, x, y = _case(name)
    bad = x.clone()
    bad[VIEWS + 1, 0] = float("nan")  # one view of sample 1
    keep = torch.tensor([True, False, True, True])
    grads = _naive_sample_grads(model, x, y, VIEWS)[keep]
    got, stats = _accumulate(model, bad, y, 0.2, "sum", VIEWS)
    assert stats.nonfinite == 1 and stats.batch_size == SAMPLES
    assert _relative_error(got, _clipped_sum(grads, 0.2)) <= RTOL


# ---------------------------------------------------------------------- K = 1 is the plain path
def test_group_size_one_is_bit_identical_to_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, y = _case("deep_conv")
    single: list[str] = []
    original = rules.ProductRule.norms

    def spy(self: rules.ProductRule, module: nn.Module, *args: Any) -> tuple[Tensor, rules.ClippedSumTerm]:
        single.append(type(module).__name__)
        return original(self, module, *args)

    monkeypatch.setattr(rules.ProductRule, "norms", spy)
    grouped = _spy_grouped(monkeypatch)
    results = []
    for kwargs in ({}, {"group_size": 1}):
        clipper = PerSampleClipper(model, 0.05)
        stats = clipper.accumulate(lambda: _batch_loss(model, x, y, "mean"), len(x), **kwargs)
        results.append((clipper.flat_sum.clone(), stats))
        clipper.remove()
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1]
    assert single == ["Linear", "Conv2d", "Conv2d"] * 2 and grouped == []  # K = 1: the plain path, twice
    single.clear()
    _accumulate(model, x, y, 0.05, "mean", VIEWS)
    assert single == [] and len(grouped) == 3  # K > 1: the grouped path only


@pytest.mark.parametrize("seed", range(5))
def test_views_whose_gradients_nearly_cancel_add_at_most_clip_norm(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two views with nearly opposite weight gradients (fp32): the ghost norm over their joint positions is a
    # small difference of large Gram terms, and the clipped sum a small difference of large fp32 products.
    # Whatever the round-off, the sample's contribution stays within C.
    paths = _spy_grouped(monkeypatch)
    torch.manual_seed(seed)
    model = nn.Linear(64, 64, bias=False)
    x = torch.randn(1, 64) * 1e3
    views = torch.cat([x, -x + 1e-4 * torch.randn(1, 64)])
    clipper = PerSampleClipper(model, clip_norm=0.5, loss_reduction="sum")
    clipper.accumulate(lambda: model(views).sum(), 1, group_size=2)
    assert paths == ["ghost"]
    assert float(clipper.flat_sum.norm()) <= 0.5 * (1 + 1e-6)


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_group_size_must_be_an_integer_of_at_least_one(bad: Any) -> None:
    model, x, y = _case("linear")
    clipper = PerSampleClipper(model, 1.0)
    with pytest.raises(PrivacyConfigError, match=rf"group_size must be an integer >= 1, found {bad!r}\. HINT: "):
        clipper.accumulate(lambda: _batch_loss(model, x, y, "mean"), SAMPLES, group_size=bad)
    assert not clipper.flat_sum.any()


def test_per_sample_instead_of_per_row_losses_are_refused() -> None:
    model, x, y = _case("linear")
    clipper = PerSampleClipper(model, 1.0, loss_reduction="none")
    with pytest.raises(PrivacyConfigError, match=r"for a batch of 12 \(4 samples x 3 views\), found \(4,\)"):
        clipper.accumulate(lambda: _row_losses(model, x, y).reshape(SAMPLES, VIEWS).mean(1), SAMPLES, group_size=VIEWS)


def test_rows_not_matching_samples_times_views_are_refused() -> None:
    model, x, y = _case("linear")
    clipper = PerSampleClipper(model, 1.0)
    with pytest.raises(
        UnsupportedModelError, match=r"first dimension is 12, but the batch holds 8 rows \(4 samples x 2"
    ):
        clipper.accumulate(lambda: _batch_loss(model, x, y, "mean"), SAMPLES, group_size=2)


# ---------------------------------------------------------------------- groups of different sizes
SIZES = [1, 5, 2, 4]  # 12 rows, as the models' inputs: P3SGD's patients with their images


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(MODELS))
def test_groups_of_different_sizes_clip_each_group_mean(
    name: str, reduction: LossReduction, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = _spy_grouped(monkeypatch)
    model, x, y = _case(name)
    params = _trainable(model)
    rows = []
    for r in range(len(x)):
        grads = torch.autograd.grad(_row_losses(model, x[r : r + 1], y[r : r + 1]).sum(), params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)]))
    grads = torch.stack([chunk.mean(0) for chunk in torch.stack(rows).split(SIZES)])  # each group's mean gradient
    ordered = grads.norm(dim=1).sort().values
    clip_norm = float((ordered[1] * ordered[2]).sqrt())  # two groups clipped, two not
    clipper = PerSampleClipper(model, clip_norm, loss_reduction=reduction)
    try:
        stats = clipper.accumulate(
            lambda: _batch_loss(model, x, y, reduction), len(SIZES), group_size=torch.tensor(SIZES)
        )
        got = _engine_vector(clipper, model)
    finally:
        clipper.remove()
    assert _relative_error(got, _clipped_sum(grads, clip_norm)) < RTOL
    assert stats.batch_size == len(SIZES) and stats.clipped == 2
    assert stats.norm_sum == pytest.approx(float(grads.norm(dim=1).sum()), rel=1e-9)
    if name == "wide_linear":  # T·K_max·(d + p) = 5·88 < d·p = 1920
        assert "ghost" in paths, "the padded ghost norm must be exercised"


def test_equal_group_sizes_are_the_uniform_path() -> None:
    model, x, y = _case("linear")
    a, b = PerSampleClipper(model, 0.1), PerSampleClipper(model, 0.1)
    a.accumulate(lambda: _batch_loss(model, x, y, "mean"), SAMPLES, group_size=VIEWS)
    a.remove()
    b.accumulate(lambda: _batch_loss(model, x, y, "mean"), SAMPLES, group_size=[VIEWS] * SAMPLES)
    b.remove()
    assert torch.equal(a.flat_sum, b.flat_sum)


@pytest.mark.parametrize("bad", [[1, 2], [0, 4, 4, 4], [1.5, 2, 4, 4.5], torch.tensor([3.0, 3.0, 3.0, 3.0])])
def test_group_sizes_must_be_one_positive_integer_per_sample(bad: Any) -> None:
    model, x, y = _case("linear")
    clipper = PerSampleClipper(model, 1.0)
    with pytest.raises(PrivacyConfigError, match=rf"must be one integer >= 1 or {SAMPLES} of them"):
        clipper.accumulate(lambda: _batch_loss(model, x, y, "mean"), SAMPLES, group_size=bad)
    assert not clipper.flat_sum.any()
