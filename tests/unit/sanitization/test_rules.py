"""The per-layer rule registry: transposed and dilated convolutions, PReLU, bias-only layers, user rules.

Every clipped sum is checked against the naive loop (each sample's gradient alone, clipped,
summed; float64, relative 1e-10), and the cases say which way (ghost norm or materialized
per-sample gradients) each Linear/Conv/ConvTranspose layer took, so that both are covered.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_dp.errors import PrivacyConfigError, UnsupportedModelError
from lightning_dp.models import validate_model
from lightning_dp.sanitization import rules
from lightning_dp.sanitization.per_sample import PerSampleClipper
from lightning_dp.sanitization.rules import (
    ConvRule,
    ConvTransposeRule,
    FunctorchRule,
    LayerRule,
    LinearRule,
    OpacusRule,
    PReLURule,
    has_rule,
    register_rule,
    rule_for,
    rule_problem,
    unregister_rule,
)
from tests.helpers.per_sample_reference import check_clipped_sum

BATCH = 4


def _output_loss(model: nn.Module, x: Tensor) -> Tensor:
    """Mean over the batch of a smooth, non-linear per-sample loss of the model's output."""
    out = model(x)
    return (out.sin() + 0.5 * out.pow(2)).flatten(1).sum(1).mean()


def _x(*shape: int) -> Tensor:
    return torch.randn(BATCH, *shape, dtype=torch.float64)


@pytest.fixture
def ways(monkeypatch: pytest.MonkeyPatch) -> list[tuple[nn.Module, str]]:
    """(layer, way) for each single-call Linear/Conv/ConvTranspose layer: ghost norm or materialized gradients."""
    seen: list[tuple[nn.Module, str]] = []
    original = rules.ProductRule.norms

    def spy(self: rules.ProductRule, module: nn.Module, *args: Any) -> tuple[Tensor, rules.ClippedSumTerm]:
        sq, item = original(self, module, *args)
        seen.append((module, "ghost" if type(item) is rules.GhostTerm else "materialized"))
        return sq, item

    monkeypatch.setattr(rules.ProductRule, "norms", spy)
    return seen


class _WithOutputSize(nn.Module):
    """A ConvTranspose2d called with ``output_size=``: the output padding differs from the layer's attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 2, 3, stride=3)

    def forward(self, x: Tensor) -> Tensor:
        return self.up(x, output_size=[13, 14])  # the smallest output is 12 × 12 for a 4 × 4 input


def _frozen_weight(layer: nn.Module) -> nn.Module:
    layer.weight.requires_grad_(False)  # bias-only fine-tuning (BitFit)
    return layer


@dataclass
class _Case:
    model: nn.Module
    x: Tensor
    ways: list[str] | None = None  # the way each product layer must take (None: unchecked)


# T = positions (a transposed convolution's *input* positions), d = fan-in, p = fan-out, read from the weight as
# weight[0].numel() and weight.shape[0]: the ghost norm is used when T·(d + p) < d·p and groups == 1.
CASES: dict[str, Callable[[], _Case]] = {
    "conv_transpose1d_stride2_output_padding": lambda: _Case(
        nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1), _x(3, 10), ["materialized"]
    ),
    "conv_transpose1d_ghost": lambda: _Case(nn.ConvTranspose1d(16, 16, 3, stride=2), _x(16, 3), ["ghost"]),
    "conv_transpose2d_stride2_output_padding": lambda: _Case(
        nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1), _x(4, 5, 5), ["materialized"]
    ),
    "conv_transpose2d_stride2_output_padding_ghost": lambda: _Case(
        nn.ConvTranspose2d(16, 8, 3, stride=2, padding=1, output_padding=1), _x(16, 3, 3), ["ghost"]
    ),
    "conv_transpose2d_kernel2_stride2": lambda: _Case(
        nn.ConvTranspose2d(4, 2, 2, stride=2), _x(4, 6, 6), ["materialized"]
    ),
    "conv_transpose2d_dilation": lambda: _Case(
        nn.ConvTranspose2d(3, 4, 3, stride=2, dilation=2, padding=2, output_padding=1), _x(3, 5, 4), ["materialized"]
    ),
    # output_padding ≥ stride (allowed as it is < dilation): the adjoint convolution has more positions than the input
    "conv_transpose2d_output_padding_above_stride": lambda: _Case(
        nn.ConvTranspose2d(2, 3, 2, stride=1, dilation=3, output_padding=2), _x(2, 4, 3), ["materialized"]
    ),
    "conv_transpose2d_output_padding_above_stride_ghost": lambda: _Case(
        nn.ConvTranspose2d(16, 16, 2, stride=1, dilation=3, output_padding=2), _x(16, 2, 2), ["ghost"]
    ),
    "conv_transpose2d_groups": lambda: _Case(
        nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, output_padding=1), _x(4, 4, 4), ["materialized"]
    ),
    "conv_transpose2d_depthwise": lambda: _Case(
        nn.ConvTranspose2d(4, 4, 2, stride=2, groups=4), _x(4, 3, 3), ["materialized"]
    ),
    "conv_transpose2d_no_bias_ghost": lambda: _Case(
        nn.ConvTranspose2d(16, 8, 2, stride=2, bias=False), _x(16, 2, 2), ["ghost"]
    ),
    "conv_transpose2d_output_size": lambda: _Case(_WithOutputSize(), _x(3, 4, 4), ["materialized"]),
    "conv_transpose3d_stride2_output_padding": lambda: _Case(
        nn.ConvTranspose3d(2, 3, 3, stride=2, padding=1, output_padding=1), _x(2, 3, 3, 2), ["materialized"]
    ),
    "conv_transpose3d_ghost": lambda: _Case(
        nn.ConvTranspose3d(16, 8, 2, stride=2, output_padding=1), _x(16, 1, 2, 2), ["ghost"]
    ),
    "conv_transpose3d_dilation_groups": lambda: _Case(
        nn.ConvTranspose3d(4, 2, 2, stride=2, dilation=2, groups=2), _x(4, 2, 3, 2), ["materialized"]
    ),
    "conv2d_dilated": lambda: _Case(nn.Conv2d(3, 4, 3, dilation=2, padding=2), _x(3, 8, 8), ["materialized"]),
    "conv2d_dilated_ghost": lambda: _Case(nn.Conv2d(16, 16, 3, dilation=3, padding=3), _x(16, 3, 3), ["ghost"]),
    # DeepLabV3's ASPP: a dilation beyond the input, so that the kernel's outer taps read only padding (tap-wise)
    "conv2d_dilation_beyond_the_input_tapwise": lambda: _Case(
        nn.Conv2d(3, 4, 3, dilation=6, padding=6), _x(3, 5, 5), ["materialized"]
    ),
    "conv2d_stride_dilation_partly_beyond_the_input_tapwise": lambda: _Case(
        nn.Conv2d(3, 4, 3, stride=2, dilation=4, padding=4), _x(3, 6, 7), ["materialized"]
    ),
    # Materialized, but the layer's input and output gradient are smaller than its per-sample weight gradients: the
    # clipped sum is computed from them (KeptInputsTerm); plain and tap-wise.
    "conv2d_kept_inputs": lambda: _Case(nn.Conv2d(16, 16, 3, padding=1), _x(16, 6, 6), ["materialized"]),
    "conv2d_kept_inputs_reflect": lambda: _Case(
        nn.Conv2d(16, 16, 3, padding=1, padding_mode="reflect"), _x(16, 6, 6), ["materialized"]
    ),
    "conv1d_kept_inputs_stride": lambda: _Case(nn.Conv1d(8, 8, 5, stride=2, padding=2), _x(8, 24), ["materialized"]),
    "conv2d_kept_inputs_tapwise": lambda: _Case(
        nn.Conv2d(32, 16, 3, dilation=6, padding=6), _x(32, 6, 6), ["materialized"]
    ),
    "conv2d_dilated_reflect": lambda: _Case(
        nn.Conv2d(3, 4, 3, dilation=2, padding=2, padding_mode="reflect"), _x(3, 6, 6), ["materialized"]
    ),
    "conv_then_transpose_skip": lambda: _Case(_TinyUNet(), _x(1, 8, 8)),
    "prelu_shared_slope": lambda: _Case(nn.Sequential(nn.Conv2d(3, 4, 3), nn.PReLU()), _x(3, 5, 5)),
    "prelu_per_channel": lambda: _Case(nn.Sequential(nn.Conv2d(3, 4, 3), nn.PReLU(4)), _x(3, 5, 5)),
    "prelu_on_features": lambda: _Case(nn.Sequential(nn.Linear(3, 5), nn.PReLU(5)), _x(3)),
    # A bias right before a normalization layer has a per-sample gradient of ~0 (the norm removes any shift): it must
    # be clipped on that, not on the bound Σ_t‖g_t‖ a ghost norm of the bias falls back to when its terms cancel.
    "conv2d_ghost_before_instance_norm": lambda: _Case(
        nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.InstanceNorm2d(16)), _x(16, 3, 3), ["ghost"]
    ),
    "conv_transpose2d_ghost_before_group_norm": lambda: _Case(
        nn.Sequential(nn.ConvTranspose2d(16, 8, 2, stride=2), nn.GroupNorm(8, 8, affine=False)), _x(16, 2, 2), ["ghost"]
    ),
    "linear_bias_only": lambda: _Case(_frozen_weight(nn.Linear(16, 16)), _x(2, 16), ["materialized"]),
    "conv2d_bias_only": lambda: _Case(_frozen_weight(nn.Conv2d(16, 16, 3)), _x(16, 3, 3), ["materialized"]),
    "conv_transpose2d_bias_only": lambda: _Case(
        _frozen_weight(nn.ConvTranspose2d(16, 8, 2, stride=2)), _x(16, 2, 2), ["materialized"]
    ),
}


class _TinyUNet(nn.Module):
    """Down (strided conv), up (ConvTranspose2d), skip concatenation, 1×1 head."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(1, 8, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.head = nn.Conv2d(5, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.norm(self.down(x)))
        return self.head(torch.cat([torch.relu(self.up(h)), x], 1))


@pytest.mark.parametrize("name", list(CASES))
def test_layer_matches_naive_per_sample_loop(name: str, ways: list[tuple[nn.Module, str]]) -> None:
    case = CASES[name]()
    model = case.model.double()
    check_clipped_sum(model, _output_loss, case.x)
    if case.ways is not None:
        assert [way for m in model.modules() for layer, way in ways if layer is m] == case.ways


@pytest.mark.parametrize(
    ("conv", "spatial", "kept"),
    [
        (nn.Conv2d(16, 16, 3, padding=1), 6, rules.KeptInputsTerm),  # 2·16·36 numbers a sample < 16·16·9
        (nn.Conv2d(32, 16, 3, dilation=6, padding=6), 6, rules.KeptInputsTerm),  # tap-wise, 6·6·48 < 16·32·9
        (nn.Conv2d(4, 4, 3, padding=1), 8, rules.MaterializedGrads),  # 2·4·64 > 4·4·9: the gradients are smaller
    ],
)
def test_a_materialized_call_keeps_the_smaller_of_its_gradients_and_its_inputs(
    conv: nn.Conv2d, spatial: int, kept: type
) -> None:
    """Once normed, per-sample weight gradients larger than the layer's input and output gradient are freed: the
    clipped sum is then the c-weighted weight gradient of the kept inputs, equal to Σ_i c_i·g_i (float64)."""
    torch.manual_seed(0)
    conv = conv.double()
    x = _x(conv.in_channels, spatial, spatial)
    backprops = torch.randn_like(conv(x))
    rule = rules.ConvRule()
    assert not rule.use_ghost(conv, x, backprops)  # the norms are materialized either way
    sq, term = rule.norms(conv, x, backprops)
    assert type(term) is kept
    grads = rule.per_sample_grads(conv, x, backprops)
    torch.testing.assert_close(sq, sum(g.flatten(1).pow(2).sum(1) for g in grads.values()), rtol=1e-12, atol=0)
    coeff = torch.rand(BATCH, dtype=torch.float64)
    keep = torch.tensor([True, False, True, True])
    sums = {p: torch.zeros_like(p) for p in (conv.weight, conv.bias)}
    term.add_clipped(coeff, keep, sums)
    for p, g in grads.items():
        torch.testing.assert_close(sums[p], torch.tensordot(coeff * keep, g, dims=1), rtol=1e-10, atol=1e-12)


def test_a_convolution_whose_taps_mostly_read_padding_materializes_tap_by_tap(monkeypatch: pytest.MonkeyPatch) -> None:
    # The two tap-wise cases above must take that way (their sums equal the naive loop's there), and an ordinary
    # convolution, whose taps all read the input almost everywhere, must not.
    calls: list[nn.Module] = []
    original = rules._tapwise_weight_grad

    def spy(module: nn.Module, *args: Any) -> Tensor:
        calls.append(module)
        return original(module, *args)

    monkeypatch.setattr(rules, "_tapwise_weight_grad", spy)
    for name in ("conv2d_dilation_beyond_the_input_tapwise", "conv2d_stride_dilation_partly_beyond_the_input_tapwise"):
        case = CASES[name]()
        check_clipped_sum(case.model.double(), _output_loss, case.x)
        assert calls and calls[-1] is case.model, name
    calls.clear()
    check_clipped_sum(nn.Conv2d(3, 4, 3, padding=1).double(), _output_loss, _x(3, 6, 6))
    assert not calls


@pytest.mark.parametrize(
    "name", ["conv2d_dilation_beyond_the_input_tapwise", "conv2d_stride_dilation_partly_beyond_the_input_tapwise"]
)
def test_a_tap_span_one_position_short_is_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A planted bug: every tap's span loses its last output position, so each sample's gradient misses terms (its norm,
    # and with it the clip, would fall short). The comparison with the naive loop must fail.
    original = rules._tap_span

    def short(*args: int) -> tuple[slice, slice] | None:
        span = original(*args)
        if span is None or span[0].stop - span[0].start < 2:
            return span
        out, read = span
        return slice(out.start, out.stop - 1), slice(read.start, read.stop - read.step, read.step)

    monkeypatch.setattr(rules, "_tap_span", short)
    case = CASES[name]()
    with pytest.raises(AssertionError, match="clipped sum off by"):
        check_clipped_sum(case.model.double(), _output_loss, case.x)


def test_the_tap_wise_gradient_equals_the_grouped_convolution_for_every_geometry() -> None:
    # Every kernel size, stride, dilation and padding (including taps that never read the input), each with the
    # tap-wise way forced: the per-sample weight gradients equal the grouped weight-gradient convolution's.
    torch.manual_seed(0)
    checked = 0
    for k, stride, dilation, pad, (h, w) in itertools.product(
        [1, 2, 3], [1, 2, 3], [1, 3, 6], [0, 1, 3, 6], [(4, 5), (7, 16)]
    ):
        conv = nn.Conv2d(2, 3, k, stride=stride, dilation=dilation, padding=pad).double()
        x = torch.randn(3, 2, h, w, dtype=torch.float64)
        try:
            y = conv(x)
        except RuntimeError:  # the kernel does not fit the padded input
            continue
        g = torch.randn_like(y)
        taps = rules._live_taps(conv, x, g, (pad, pad), live_fraction=float("inf"))
        assert taps is not None
        reference = rules._conv_weight_grad(conv, x, g, (pad, pad), None, per_sample=True)
        torch.testing.assert_close(rules._tapwise_weight_grad(conv, x, g, taps), reference, rtol=0, atol=1e-12)
        # and the batch's sum (the clipped sum of a ghost-normed or kept-inputs layer) equals the plain one
        summed = rules._conv_weight_grad(conv, x, g, (pad, pad), None, per_sample=False)
        torch.testing.assert_close(rules._tapwise_weight_sum(conv, x, g, taps), summed, rtol=0, atol=1e-12)
        checked += 1
    assert checked > 150


def test_conv_transpose_has_its_own_rule_not_functorch() -> None:
    for layer in (nn.ConvTranspose1d(2, 2, 2), nn.ConvTranspose2d(2, 2, 2), nn.ConvTranspose3d(2, 2, 2)):
        assert isinstance(rule_for(layer), ConvTransposeRule)


def test_built_in_rules() -> None:
    assert isinstance(rule_for(nn.Linear(2, 2)), LinearRule)
    assert all(isinstance(rule_for(c(1, 1, 1)), ConvRule) for c in (nn.Conv1d, nn.Conv2d, nn.Conv3d))
    assert isinstance(rule_for(nn.PReLU()), PReLURule)
    for layer in (nn.GroupNorm(2, 4), nn.LayerNorm(4), nn.InstanceNorm2d(4, affine=True), nn.Embedding(5, 2)):
        assert isinstance(rule_for(layer), OpacusRule), type(layer).__name__
    assert isinstance(rule_for(_ScaleShift()), FunctorchRule)


class _Conv2dSubclass(nn.Conv2d):
    pass


def test_a_subclass_uses_its_nearest_registered_base() -> None:
    assert isinstance(rule_for(_Conv2dSubclass(1, 1, 1)), ConvRule)


# ---------------------------------------------------------------------- user rules
class _ScaleShift(nn.Module):
    """A leaf layer with its own parameters and no registered rule: the functorch fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(3))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


class _MaskedScale(nn.Module):
    """A parameter next to a buffer: the functorch fallback cannot handle it."""

    mask: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))
        self.register_buffer("mask", torch.tensor([1.0, 0.0, 1.0]))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight * self.mask


class _MaskedScaleRule(LayerRule):
    def per_sample_grads(self, module: Any, activation: Tensor, backprops: Tensor) -> dict[nn.Parameter, Tensor]:
        return {module.weight: (activation * backprops * module.mask).reshape(len(activation), -1, 3).sum(1)}


@pytest.fixture
def masked_scale_rule() -> Iterator[LayerRule]:
    rule = _MaskedScaleRule()
    register_rule(_MaskedScale, rule)
    try:
        yield rule
    finally:
        unregister_rule(_MaskedScale)


def _masked_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 3), nn.Tanh(), _MaskedScale())


def test_a_layer_without_rule_is_refused_by_the_engine_and_validate_model_alike() -> None:
    model = _masked_model()
    layer = model[2]
    assert not has_rule(layer)
    assert rule_problem(layer) is not None and "buffers ['mask']" in str(rule_problem(layer))
    with pytest.raises(UnsupportedModelError, match=r"`2` \(_MaskedScale\) has trainable parameters but no .*register"):
        PerSampleClipper(model, 1.0)
    problems = validate_model(model)
    assert [(p.name, p.layer) for p in problems] == [("2", "_MaskedScale")]
    assert "register_rule(_MaskedScale, rule)" in problems[0].fix


def test_a_registered_rule_is_used_by_the_engine_and_validate_model(masked_scale_rule: LayerRule) -> None:
    model = _masked_model().double()
    assert rule_for(model[2]) is masked_scale_rule and has_rule(model[2])
    assert validate_model(model) == []
    check_clipped_sum(model, _output_loss, _x(3))


def test_unregistering_restores_the_default() -> None:
    original = rule_for(nn.PReLU())
    assert unregister_rule(nn.PReLU) is original
    try:
        assert isinstance(rule_for(nn.PReLU()), FunctorchRule)
        check_clipped_sum(nn.Sequential(nn.Linear(3, 4), nn.PReLU()).double(), _output_loss, _x(3))
    finally:
        register_rule(nn.PReLU, original)
    assert rule_for(nn.PReLU()) is original
    assert unregister_rule(_MaskedScale) is None


def test_register_rule_rejects_what_is_not_a_layer_type_or_rule() -> None:
    with pytest.raises(PrivacyConfigError, match=r"layer_type must be an nn.Module subclass, found Linear"):
        register_rule(nn.Linear(2, 2), LinearRule())  # type: ignore[arg-type]
    with pytest.raises(PrivacyConfigError, match=r"rule must be a LayerRule, found function.*HINT: subclass"):
        register_rule(nn.Linear, lambda *a: {})  # type: ignore[arg-type]
    assert isinstance(rule_for(nn.Linear(2, 2)), LinearRule), "a refused registration changes nothing"


def test_frozen_layers_and_parameter_free_modules_need_no_rule() -> None:
    bn = nn.BatchNorm2d(4).requires_grad_(False)
    assert has_rule(bn) and has_rule(nn.ReLU())
    assert not has_rule(nn.BatchNorm2d(4))


# ---------------------------------------------------------------------- review findings (independent review)
@pytest.mark.parametrize("scale", [-1.0, -2.0, 0.0, float("nan"), float("inf")])
def test_a_loss_scale_that_is_not_finite_and_positive_is_refused(scale: float) -> None:
    """A negative loss scale made every norm negative, so nothing was clipped (‖sum‖ 213 for a bound of 3)."""
    net = nn.Linear(4, 2)
    clipper = PerSampleClipper(net, clip_norm=1.0, loss_reduction="sum")
    x = torch.randn(3, 4) * 10
    with pytest.raises(PrivacyConfigError, match="loss_scale must be a finite number > 0"):
        clipper.accumulate(lambda: net(x).sum(), batch_size=3, loss_scale=scale)
    assert float(clipper.flat_sum.abs().sum()) == 0.0


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


def test_a_sampler_that_returns_another_layers_gradient_cannot_loosen_the_clip(monkeypatch: Any) -> None:
    """Each sample's contribution stays ≤ C even if a registered sampler also returns a foreign parameter."""
    from opacus.grad_sample import GradSampleModule

    net = nn.Sequential(_Scale(), nn.Linear(4, 1).double())
    head = net[1].weight

    def sampler(layer: nn.Module, activations: list[Tensor], backprops: Tensor) -> dict[nn.Parameter, Tensor]:
        a = activations[0]
        return {layer.scale: a * backprops, head: torch.ones(a.shape[0], 1, 4, dtype=a.dtype)}  # foreign, wrong

    monkeypatch.setitem(GradSampleModule.GRAD_SAMPLERS, _Scale, sampler)
    x = torch.randn(3, 4, dtype=torch.float64)

    def clipped_sum(rows: list[int]) -> Tensor:
        clipper = PerSampleClipper(net, 1.0, "sum")
        try:
            clipper.accumulate(lambda: net(x[rows]).sum(), len(rows))
            return clipper.flat_sum.clone()
        finally:
            clipper.remove()

    full = clipped_sum([0, 1, 2])
    for i in range(3):
        added = full - clipped_sum([j for j in range(3) if j != i])
        assert float(added.norm()) <= 1.0 + 1e-9


class _GainConvTranspose(nn.ConvTranspose2d):
    def __init__(self) -> None:
        super().__init__(2, 3, 2, stride=2)
        self.gain = nn.Parameter(torch.full((1,), 3.0))

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(x) * self.gain


class _ShiftPReLU(nn.PReLU):
    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x + self.shift)


@pytest.mark.parametrize("layer", [_GainConvTranspose, _ShiftPReLU], ids=["conv_transpose", "prelu"])
def test_a_subclass_with_its_own_forward_does_not_get_its_base_class_rule(layer: type[nn.Module]) -> None:
    """The plain ConvTranspose / PReLU formula is wrong for a subclass that computes something else."""

    model = nn.Sequential(layer()).double()
    assert rules.registered_rule(model[0]) is None
    check_clipped_sum(model, lambda m, x: (m(x) ** 2).flatten(1).sum(1).mean(), torch.randn(4, 2, 2, 2).double())


# ---------------------------------------------------------------------- BatchNorm in eval mode (parameter-efficient)
def _eval_norm(layer: nn.Module, weight: bool = True, bias: bool = True) -> nn.Module:
    """``layer`` in eval mode with non-trivial running statistics and affine, float64; ``weight``/``bias``: trained."""
    layer.double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in layer.named_buffers(recurse=False):
            if name == "running_mean":
                t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
            elif name == "running_var":
                t.copy_(torch.rand(t.shape, generator=g, dtype=t.dtype) * 2 + 0.5)
        for t in layer.parameters(recurse=False):
            t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    layer.weight.requires_grad_(weight)
    layer.bias.requires_grad_(bias)
    return layer.eval()


def _frozen(layer: nn.Module) -> nn.Module:
    return layer.requires_grad_(False)


class _BatchNormResNetBlock(nn.Module):
    """Frozen conv → eval BatchNorm (affine trained) → in-place ReLU → frozen conv → eval BatchNorm, += identity."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = _frozen(nn.Conv2d(3, 3, 3, padding=1, bias=False))
        self.bn1 = _eval_norm(nn.BatchNorm2d(3))
        self.conv2 = _frozen(nn.Conv2d(3, 3, 3, padding=1, bias=False))
        self.bn2 = _eval_norm(nn.BatchNorm2d(3))
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu_(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.head(torch.relu(out).mean((2, 3)))


BATCH_NORM_CASES: dict[str, Callable[[], tuple[nn.Module, Tensor]]] = {
    "batchnorm1d_features": lambda: (nn.Sequential(nn.Linear(3, 5), _eval_norm(nn.BatchNorm1d(5))), _x(3)),
    "batchnorm1d_sequence": lambda: (_eval_norm(nn.BatchNorm1d(3)), _x(3, 7)),
    "batchnorm2d_after_frozen_conv": lambda: (
        nn.Sequential(_frozen(nn.Conv2d(2, 4, 3)), _eval_norm(nn.BatchNorm2d(4))),
        _x(2, 6, 6),
    ),
    "batchnorm2d_weight_only": lambda: (_eval_norm(nn.BatchNorm2d(3), bias=False), _x(3, 4, 4)),
    "batchnorm2d_bias_only": lambda: (
        nn.Sequential(_eval_norm(nn.BatchNorm2d(3), weight=False), nn.Tanh(), nn.Conv2d(3, 2, 1)),
        _x(3, 4, 4),
    ),
    "batchnorm3d": lambda: (_eval_norm(nn.BatchNorm3d(2)), _x(2, 3, 2, 3)),
    "batchnorm_resnet_block": lambda: (_BatchNormResNetBlock(), _x(3, 5, 5)),
    "groupnorm_affine_after_frozen_conv": lambda: (
        nn.Sequential(_frozen(nn.Conv2d(2, 4, 3)), _eval_norm(nn.GroupNorm(2, 4)).train()),
        _x(2, 5, 5),
    ),
}


@pytest.mark.parametrize("name", list(BATCH_NORM_CASES))
def test_eval_mode_norm_affine_matches_naive_per_sample_loop(name: str) -> None:
    model, x = BATCH_NORM_CASES[name]()
    model = model.double()
    assert validate_model(model) == []
    check_clipped_sum(model, _output_loss, x)


def test_batchnorm_rule_is_registered_for_every_batchnorm() -> None:
    for layer in (nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.BatchNorm3d(2), nn.SyncBatchNorm(2)):
        assert isinstance(rule_for(layer.eval()), rules.BatchNormRule), type(layer).__name__


def test_a_trainable_batchnorm_in_training_mode_or_without_running_statistics_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match=r"`1` \(BatchNorm2d\) is a trainable BatchNorm in training mode"):
        PerSampleClipper(nn.Sequential(nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2)), 1.0)
    untracked = nn.Sequential(nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2, track_running_stats=False).eval())
    with pytest.raises(UnsupportedModelError, match=r"without running statistics \(track_running_stats=False\)"):
        PerSampleClipper(untracked, 1.0)
    assert [p.layer for p in validate_model(untracked)] == ["BatchNorm2d"]
    assert not has_rule(nn.BatchNorm2d(2)) and has_rule(nn.BatchNorm2d(2).eval())
    assert has_rule(nn.BatchNorm2d(2).requires_grad_(False)), "a frozen BatchNorm has nothing to compute"


def test_a_batchnorm_switched_to_training_mode_after_the_engine_was_built_is_refused_before_anything_is_added() -> None:
    model = nn.Sequential(_frozen(nn.Conv2d(2, 3, 1)), nn.BatchNorm2d(3).eval()).double()
    clipper = PerSampleClipper(model, 1.0)
    model[1].train()
    x = _x(2, 3, 3)
    with pytest.raises(UnsupportedModelError, match="trainable BatchNorm in training mode"):
        clipper.accumulate(lambda: _output_loss(model, x), BATCH)
    assert float(clipper.flat_sum.abs().sum()) == 0.0
