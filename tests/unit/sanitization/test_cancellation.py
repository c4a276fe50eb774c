"""One crafted sample must not move the clipped sum by more than C, on every way the engine sums a layer.

The canary (issue 31, item 1): an input of H = 1e8 at two positions and an output gradient of +1 at the first and
−1 at the second, so that its per-sample weight gradient H·a − H·a is exactly 0: its norm is 0 and it is not
clipped. Where the clipped sum adds every sample's terms in one fp32 reduction (the kept-inputs term, the ghost
path), its ±H terms erase the other samples' terms there ((S + H) − H = 0) unless a guard keeps them out. Each
case checks the canary's effect on the sum of a batch whose other samples point the same way (so an erasure is
large): at most C (its clipped gradient is 0 here; 1e-3·C allows for fp32 round-off, measured ≈ 5e-6·C), and
that the case takes the way it names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_dp.sanitization import rules
from lightning_dp.sanitization.per_sample import PerSampleClipper

H = 1e8
CLIP = 1.0
OTHERS = 32


@dataclass
class _Case:
    layer: Callable[[], nn.Module]
    shape: tuple[int, ...]  # a sample's input
    plus: tuple[int, ...]  # the input position at H whose output gradient is +1 (its output position: ``out_plus``)
    minus: tuple[int, ...]
    out_plus: tuple[int, ...]
    out_minus: tuple[int, ...]
    term: type  # the clipped-sum term the layer's call must produce
    features_last: bool = False


CASES = {
    "conv2d_kept_inputs": _Case(
        lambda: nn.Conv2d(16, 16, 3, padding=1), (16, 6, 6), (1, 1), (4, 4), (1, 1), (4, 4), rules.KeptInputsTerm
    ),
    "conv2d_kept_inputs_reflect": _Case(
        lambda: nn.Conv2d(16, 16, 3, padding=1, padding_mode="reflect"),
        (16, 6, 6),
        (1, 1),
        (4, 4),
        (1, 1),
        (4, 4),
        rules.KeptInputsTerm,
    ),
    "conv2d_kept_inputs_tapwise": _Case(
        lambda: nn.Conv2d(32, 16, 3, dilation=6, padding=6),
        (32, 6, 6),
        (1, 1),
        (4, 4),
        (1, 1),
        (4, 4),
        rules.KeptInputsTerm,
    ),
    "conv1d_kept_inputs_stride": _Case(
        lambda: nn.Conv1d(8, 8, 5, stride=2, padding=2), (8, 24), (4,), (16,), (2,), (8,), rules.KeptInputsTerm
    ),
    "conv3d_kept_inputs": _Case(
        lambda: nn.Conv3d(8, 8, 3, padding=1),
        (8, 4, 4, 4),
        (0, 0, 0),
        (3, 3, 3),
        (0, 0, 0),
        (3, 3, 3),
        rules.KeptInputsTerm,
    ),
    "conv2d_ghost": _Case(
        lambda: nn.Conv2d(16, 16, 3, padding=1), (16, 3, 3), (0, 0), (2, 2), (0, 0), (2, 2), rules.GhostTerm
    ),
    "conv2d_materialized": _Case(
        lambda: nn.Conv2d(4, 4, 3, padding=1), (4, 8, 8), (1, 1), (6, 6), (1, 1), (6, 6), rules.MaterializedGrads
    ),
    "linear_ghost_over_positions": _Case(
        lambda: nn.Linear(16, 16), (3, 16), (0,), (2,), (0,), (2,), rules.GhostTerm, features_last=True
    ),
    "conv_transpose2d_ghost": _Case(
        lambda: nn.ConvTranspose2d(16, 16, 1), (16, 2, 2), (0, 0), (1, 1), (0, 0), (1, 1), rules.GhostTerm
    ),
}


def _canary(case: _Case, out_shape: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The canary's input (H at two positions, every channel) and its output gradient (+1 there, −1 there)."""
    x = torch.zeros(1, *case.shape)
    g = torch.zeros(1, *out_shape)
    every = slice(None)
    for position, out, sign in ((case.plus, case.out_plus, 1.0), (case.minus, case.out_minus, -1.0)):
        if case.features_last:  # Linear: (positions, features)
            x[(0, *position, every)], g[(0, *out, every)] = H, sign
        else:  # convolutions: (channels, *spatial)
            x[(0, every, *position)], g[(0, every, *out)] = H, sign
    return x, g


def _population(case: _Case, layer: nn.Module) -> tuple[Tensor, Tensor]:
    """``OTHERS`` samples whose gradients all point nearly the same way and are clipped: their sum is ≈ OTHERS·C."""
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(OTHERS, *case.shape, generator=generator) + 0.5
    out = layer(x[:1])
    g = 0.05 + 0.01 * torch.rand(OTHERS, *out.shape[1:], generator=generator)
    return x, g


def _clipped_sum(layer: nn.Module, x: Tensor, g: Tensor, group_size: Any = 1) -> tuple[Tensor, list[type]]:
    terms: list[type] = []
    clipper = PerSampleClipper(layer, CLIP, "sum")
    original = clipper._call_norms

    def spy(*args: Any) -> Any:
        sq, term = original(*args)
        terms.append(type(term.term) if isinstance(term, rules.RowsTerm) else type(term))
        return sq, term

    clipper._call_norms = spy  # type: ignore[method-assign]
    batch = x.shape[0] if isinstance(group_size, int) else len(group_size)
    clipper.accumulate(lambda: (layer(x) * g).sum(), batch_size=batch, group_size=group_size)
    clipper.remove()
    return clipper.flat_sum.clone(), terms


@pytest.mark.parametrize("name", list(CASES))
def test_a_cancelling_canary_moves_the_clipped_sum_by_at_most_c(name: str) -> None:
    case = CASES[name]
    torch.manual_seed(0)
    layer = case.layer()
    x, g = _population(case, layer)
    cx, cg = _canary(case, g.shape[1:])
    weight = layer.weight
    (canary_grad,) = torch.autograd.grad((layer(cx) * cg).sum(), [weight])
    assert float(canary_grad.abs().max()) == 0.0, "the canary's terms must cancel exactly"
    without, _ = _clipped_sum(layer, x, g)
    with_canary, terms = _clipped_sum(layer, torch.cat([x, cx]), torch.cat([g, cg]))
    assert terms == [case.term]
    assert float(without.norm()) > 10 * CLIP  # the others' sum is large: an erasure would show
    assert float((with_canary - without).norm()) <= 1e-3 * CLIP


@pytest.mark.parametrize("sizes", [[1] * (OTHERS + 1), [2, 1, 3] * (OTHERS // 3) + [1, 1, 1]])
def test_a_single_image_canary_patient_moves_the_grouped_sum_by_at_most_c(sizes: list[int]) -> None:
    """P3SGD's batched round: patients are groups of their images; the canary is a patient of one image (last).

    Equal group sizes collapse to the plain per-sample path (the kept-inputs term); different sizes take the grouped
    one (each group's gradient materialized, or the ghost norm over its rows).
    """
    case = CASES["conv2d_kept_inputs"]
    torch.manual_seed(0)
    layer = case.layer()
    rows = sum(sizes) - 1
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(rows, *case.shape, generator=generator) + 0.5
    g = 0.05 + 0.01 * torch.rand(rows, 16, 6, 6, generator=generator)
    cx, cg = _canary(case, g.shape[1:])
    without, _ = _clipped_sum(layer, x, g, sizes[:-1])
    with_canary, _ = _clipped_sum(layer, torch.cat([x, cx]), torch.cat([g, cg]), sizes)
    assert float(without.norm()) > 10 * CLIP
    assert float((with_canary - without).norm()) <= 1e-3 * CLIP


def test_ordinary_samples_are_not_flagged_and_keep_the_inputs_term() -> None:
    """The guard costs nothing on ordinary data: no sample of a random batch is taken out of the pooled sum."""
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 16, 3, padding=1)
    x = torch.randn(64, 16, 6, 6)
    backprops = torch.randn(64, 16, 6, 6)
    _, term = rules.ConvRule().norms(conv, x, backprops)
    assert type(term) is rules.KeptInputsTerm and term.exact_rows is None


@pytest.mark.parametrize("name", ["conv2d_kept_inputs", "conv2d_kept_inputs_tapwise", "conv3d_kept_inputs"])
def test_a_canary_whose_size_bound_would_overflow_in_fp32_is_still_kept_apart(name: str) -> None:
    """Review of issue 31: an input of 1e31 with an output gradient of 1e-23 made the fp32 bound inf·0 = NaN, which
    flagged nothing, and the canary's ±1e8 products erased the others' terms (1.1–4.8·C). The bound is now taken on
    rows scaled by their largest value, and a NaN bound flags the sample."""
    case = CASES[name]
    torch.manual_seed(0)
    layer = case.layer()
    x, g = _population(case, layer)
    cx, cg = _canary(case, g.shape[1:])
    cx, cg = cx / H * 1e31, cg * 1e-23
    without, _ = _clipped_sum(layer, x, g)
    with_canary, _ = _clipped_sum(layer, torch.cat([x, cx]), torch.cat([g, cg]))
    # Its own fp32 gradient need not cancel exactly at this size: it is clipped to C, and nothing more moves.
    assert float((with_canary - without).norm()) <= (1 + 1e-3) * CLIP
