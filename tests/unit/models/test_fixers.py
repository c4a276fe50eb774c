"""`fix_model` turns BatchNorm into GroupNorm faithfully; `validate_model` names what per-sample DP-SGD cannot train."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torchvision
from torch import Tensor, nn

from lightning_dp.errors import PrivacyConfigError, PrivacyWarning
from lightning_dp.models import ImageClassifier, ModelProblem, build_backbone, fix_model, validate_model

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _seq_bn1d() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 3))


def _seq_bn3d() -> nn.Module:
    return nn.Sequential(nn.Conv3d(2, 6, 3, padding=1), nn.BatchNorm3d(6), nn.ReLU(inplace=True), nn.Conv3d(6, 4, 1))


# name -> (constructor, input shape of a small batch)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "resnet18": (lambda: torchvision.models.resnet18(weights=None, num_classes=3), (3, 3, 16, 16)),
    "mobilenet_v2": (lambda: torchvision.models.mobilenet_v2(weights=None, num_classes=3), (3, 3, 16, 16)),
    "seq_bn1d": (_seq_bn1d, (4, 5)),
    "seq_bn3d": (_seq_bn3d, (4, 2, 5, 5, 5)),
}


def _batch_norms(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, BATCH_NORMS)}


def _randomize_batch_norms(model: nn.Module) -> dict[str, tuple[Tensor, Tensor, float]]:
    """Gives every BatchNorm random affine parameters and its own eps; returns them by layer name."""
    generator = torch.Generator().manual_seed(123)
    expected = {}
    with torch.no_grad():
        for i, (name, bn) in enumerate(_batch_norms(model).items()):
            bn.weight.copy_(torch.rand(bn.num_features, generator=generator) + 0.5)
            bn.bias.copy_(torch.randn(bn.num_features, generator=generator))
            bn.eps = 1e-3 * (i + 2)  # not GroupNorm's default 1e-5
            expected[name] = (bn.weight.detach().clone(), bn.bias.detach().clone(), bn.eps)
    return expected


@pytest.fixture(params=list(MODELS))
def model_case(request: pytest.FixtureRequest) -> tuple[str, nn.Module, tuple[int, ...]]:
    build, shape = MODELS[request.param]
    return request.param, build(), shape


def test_fix_model_replaces_every_batch_norm_by_a_faithful_group_norm(
    model_case: tuple[str, nn.Module, tuple[int, ...]],
) -> None:
    _, model, _ = model_case
    expected = _randomize_batch_norms(model)
    channels = {name: bn.num_features for name, bn in _batch_norms(model).items()}
    assert expected, "the test model must contain BatchNorm layers"

    fix_model(model, warn=False)

    assert _batch_norms(model) == {}, "no BatchNorm may be left"
    modules = dict(model.named_modules())
    for name, (weight, bias, eps) in expected.items():
        gn = modules[name]
        assert isinstance(gn, nn.GroupNorm), f"{name} must now be a GroupNorm, found {type(gn).__name__}"
        assert gn.num_channels == channels[name]
        assert gn.num_channels % gn.num_groups == 0, f"{name}: {gn.num_groups} groups do not divide the channels"
        assert gn.num_groups <= 32
        assert gn.affine
        assert torch.equal(gn.weight.detach(), weight), f"{name}: affine weight not copied"
        assert torch.equal(gn.bias.detach(), bias), f"{name}: affine bias not copied"
        assert gn.eps == eps, f"{name}: eps not kept"
        assert gn.weight.requires_grad and gn.bias.requires_grad


def test_fixed_model_output_is_finite_and_per_sample(model_case: tuple[str, nn.Module, tuple[int, ...]]) -> None:
    _, model, shape = model_case
    _randomize_batch_norms(model)
    fix_model(model, warn=False)
    model.train()
    for dropout in (m for m in model.modules() if isinstance(m, nn.Dropout)):
        dropout.eval()  # random masks would differ between the two calls
    x = torch.randn(shape)
    with torch.no_grad():
        out = model(x)
        alone = model(x[:1])
    assert torch.isfinite(out).all()
    # BatchNorm in training mode mixes the samples of a batch; GroupNorm must not.
    torch.testing.assert_close(out[:1], alone, rtol=1e-4, atol=1e-5)


def test_fix_model_returns_one_line_naming_each_layer(model_case: tuple[str, nn.Module, tuple[int, ...]]) -> None:
    _, model, _ = model_case
    before = {name: (type(bn).__name__, bn.num_features) for name, bn in _batch_norms(model).items()}

    lines = fix_model(model, warn=False)

    assert len(lines) == len(before)
    modules = dict(model.named_modules())
    for line in lines:
        match = re.fullmatch(r"(\S+): (BatchNorm[123]d)\((\d+)\) -> GroupNorm\((\d+), (\d+)\)", line)
        assert match, f"unexpected line format: {line!r}"
        name, kind, channels, groups, channels_after = match.groups()
        assert before[name] == (kind, int(channels))
        assert int(channels_after) == int(channels)
        assert modules[name].num_groups == int(groups)
    assert {line.split(":")[0] for line in lines} == set(before)


def test_fix_model_warns_with_the_count(model_case: tuple[str, nn.Module, tuple[int, ...]]) -> None:
    _, model, _ = model_case
    count = len(_batch_norms(model))
    with pytest.warns(PrivacyWarning, match=rf"replaced {count} BatchNorm layer\(s\) by GroupNorm") as record:
        fix_model(model)
    privacy = [w for w in record if issubclass(w.category, PrivacyWarning)]
    assert len(privacy) == 1
    assert privacy[0].filename == __file__, "the warning must point at the caller of fix_model"


def test_fix_model_is_silent_with_warn_false() -> None:
    model = torchvision.models.resnet18(weights=None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lines = fix_model(model, warn=False)
    assert len(lines) == 20
    assert not [w for w in record if issubclass(w.category, PrivacyWarning)]


def test_fix_model_twice_changes_nothing_the_second_time() -> None:
    model = torchvision.models.mobilenet_v2(weights=None)
    _randomize_batch_norms(model)
    assert fix_model(model, warn=False)
    modules = dict(model.named_modules())
    state = {k: v.clone() for k, v in model.state_dict().items()}

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert fix_model(model) == []
    assert not [w for w in record if issubclass(w.category, PrivacyWarning)], "nothing replaced, nothing to warn"
    assert all(modules[name] is m for name, m in model.named_modules()), "no module may be replaced again"
    after = model.state_dict()
    assert after.keys() == state.keys()
    assert all(torch.equal(after[k], state[k]) for k in state)


def test_frozen_batch_norm_stays_frozen() -> None:
    model = torchvision.models.resnet18(weights=None)
    model.bn1.weight.requires_grad_(False)
    model.layer2[0].bn2.bias.requires_grad_(False)

    fix_model(model, warn=False)

    assert isinstance(model.bn1, nn.GroupNorm) and isinstance(model.layer2[0].bn2, nn.GroupNorm)
    assert not model.bn1.weight.requires_grad
    assert model.bn1.bias.requires_grad
    assert model.layer2[0].bn2.weight.requires_grad
    assert not model.layer2[0].bn2.bias.requires_grad
    assert model.layer1[0].bn1.weight.requires_grad, "other layers stay trainable"


def test_float64_model_keeps_dtype_and_exact_affine_values() -> None:
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16)).double()
    with torch.no_grad():
        # Values that float32 cannot represent: a round trip through float32 would change them.
        model[1].weight.copy_(1.0 + torch.arange(16, dtype=torch.float64) * (1 + 2**-40))
        model[1].bias.copy_(torch.full((16,), 0.1, dtype=torch.float64))
    weight, bias = model[1].weight.detach().clone(), model[1].bias.detach().clone()

    fix_model(model, warn=False)

    gn = model[1]
    assert isinstance(gn, nn.GroupNorm)
    assert gn.weight.dtype == torch.float64 and gn.bias.dtype == torch.float64
    out = model(torch.randn(2, 3, 6, 6, dtype=torch.float64))
    assert out.dtype == torch.float64 and torch.isfinite(out).all()
    assert torch.equal(gn.weight.detach(), weight), "float64 affine weight must be copied exactly"
    assert torch.equal(gn.bias.detach(), bias), "float64 affine bias must be copied exactly"


@pytest.mark.gpu
def test_cuda_model_stays_on_cuda() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).cuda()
    fix_model(model, warn=False)
    assert isinstance(model[1], nn.GroupNorm)
    assert model[1].weight.device.type == "cuda"
    assert model(torch.randn(2, 3, 6, 6, device="cuda")).isfinite().all()


def test_batch_norm_without_affine_becomes_group_norm_without_affine() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, affine=False, eps=1e-2))
    assert fix_model(model, warn=False) == ["1: BatchNorm2d(8) -> GroupNorm(8, 8)"]
    gn = model[1]
    assert isinstance(gn, nn.GroupNorm)
    assert not gn.affine and gn.weight is None and gn.bias is None
    assert gn.eps == 1e-2
    assert list(model[1].parameters()) == []


def test_sync_batch_norm_is_replaced() -> None:
    model = nn.Sequential(nn.Conv2d(3, 64, 3), nn.SyncBatchNorm(64))
    assert fix_model(model, warn=False) == ["1: SyncBatchNorm(64) -> GroupNorm(32, 64)"]
    assert isinstance(model[1], nn.GroupNorm)


@pytest.mark.parametrize(
    ("channels", "groups"),
    [(1, 1), (8, 8), (64, 32), (96, 32), (6, 6), (24, 24), (144, 24)],  # 24 and 144: mobilenet_v2's widths
)
def test_group_count_is_largest_divisor_up_to_32(channels: int, groups: int) -> None:
    model = nn.Sequential(nn.BatchNorm2d(channels))
    fix_model(model, warn=False)
    assert model[0].num_groups == groups, (
        f"BatchNorm2d({channels}) must become GroupNorm({groups}, {channels}) (largest divisor <= 32), "
        f"found GroupNorm({model[0].num_groups}, {channels})"
    )


# --- validate_model ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["resnet18", "resnet34", "mobilenet_v2", "small_cnn"])
def test_group_norm_classifiers_validate_clean(arch: str) -> None:
    model = ImageClassifier(arch=arch, num_classes=3, norm="group")  # type: ignore[arg-type]
    assert _batch_norms(model) == {}
    assert any(isinstance(m, nn.GroupNorm) for m in model.modules())
    assert validate_model(model) == []


def test_batch_norm_classifier_is_flagged() -> None:
    model = ImageClassifier(arch="resnet18", num_classes=2, norm="batch")
    assert {p.name for p in validate_model(model)} == set(_batch_norms(model))


def test_fixed_smp_unet_validates_clean() -> None:
    smp = pytest.importorskip("segmentation_models_pytorch")
    model = smp.Unet("resnet18", encoder_weights=None, classes=2)
    assert validate_model(model), "the Unet has BatchNorm before fixing"
    assert fix_model(model, warn=False)
    assert validate_model(model) == []
    with torch.no_grad():
        out = model.train()(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 2, 32, 32) and torch.isfinite(out).all()


def test_each_batch_norm_layer_is_listed_by_name() -> None:
    model = torchvision.models.resnet18(weights=None)
    problems = validate_model(model)
    names = [p.name for p in problems]
    assert names == list(_batch_norms(model)), "one problem per BatchNorm, named, in module order"
    assert "layer1.0.bn1" in names and "layer2.0.downsample.1" in names
    for problem in problems:
        assert problem.layer == "BatchNorm2d"
        assert "BatchNorm" in problem.problem
        assert "fix_model" in problem.fix


def test_lstm_is_flagged_with_dplstm_fix() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.LSTM(4, 8))
    problems = validate_model(model)
    assert [(p.name, p.layer) for p in problems] == [("1", "LSTM")]
    assert "DPLSTM" in problems[0].fix


@pytest.mark.parametrize("kind", [nn.RNN, nn.GRU])
def test_other_recurrent_layers_are_flagged(kind: type[nn.Module]) -> None:
    problems = validate_model(nn.Sequential(kind(4, 8)))
    assert [(p.name, p.layer) for p in problems] == [("0", kind.__name__)]
    assert f"DP{kind.__name__}" in problems[0].fix


def test_frozen_lstm_is_not_flagged() -> None:
    model = nn.Sequential(nn.LSTM(4, 8), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    assert validate_model(model) == []


def test_instance_norm_with_running_stats_is_flagged() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, track_running_stats=True))
    problems = validate_model(model)
    assert [(p.name, p.layer) for p in problems] == [("1", "InstanceNorm2d")]
    assert "track_running_stats=False" in problems[0].fix
    assert validate_model(nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4))) == []


class _ScaledLinear(nn.Module):
    """Holds a parameter next to a child with parameters: its per-sample gradients cannot be split."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.linear = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * self.linear(x)


def test_parameter_next_to_parameterized_children_is_flagged_by_name() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(_ScaledLinear()))
    problems = validate_model(model)
    assert len(problems) == 1
    problem = problems[0]
    assert "scale" in problem.problem
    assert problem.name == "1.0", f"the offending module's qualified name, found {problem.name!r}"
    assert problem.layer == "_ScaledLinear", f"the offending module's type, found {problem.layer!r}"


def test_every_module_with_parameters_next_to_children_is_listed() -> None:
    model = nn.Sequential(_ScaledLinear(), nn.ReLU(), _ScaledLinear(), nn.BatchNorm1d(3))
    problems = validate_model(model)
    assert [p.name for p in problems if p.name != "3"] == ["0", "2"], (
        f"both offending modules must be listed, found {[str(p) for p in problems]}"
    )


class _MaskedScale(nn.Module):
    """A parameter with a buffer, no per-sample rule: the generic rule cannot handle it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))
        self.register_buffer("mask", torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight * self.mask


class _PlainScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


def test_custom_layer_with_buffer_and_no_rule_is_flagged() -> None:
    problems = validate_model(nn.Sequential(nn.Linear(3, 3), _MaskedScale()))
    assert [(p.name, p.layer) for p in problems] == [("1", "_MaskedScale")]
    assert validate_model(nn.Sequential(nn.Linear(3, 3), _PlainScale())) == []


def test_model_problem_str_names_the_layer_and_the_fix() -> None:
    problem = validate_model(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)))[0]
    text = str(problem)
    assert "FIX:" in text
    assert text.startswith("1 (BatchNorm2d): ")
    assert text.endswith(f"FIX: {problem.fix}")
    root = ModelProblem("", "LSTM", "p", "f")
    assert str(root) == "<root> (LSTM): p. FIX: f"


def test_build_backbone_group_norm_has_no_batch_norm() -> None:
    assert _batch_norms(build_backbone("resnet18", 2, "group")) == {}
    assert len(_batch_norms(build_backbone("resnet18", 2, "batch"))) == 20


def test_build_backbone_rejects_unknown_norm() -> None:
    with pytest.raises(PrivacyConfigError, match=r"norm must be 'batch' or 'group', found 'bogus'"):
        build_backbone("resnet18", 2, "bogus")  # type: ignore[arg-type]
    with pytest.raises(PrivacyConfigError, match=r"ImageClassifier\(norm='bogus'\)"):
        ImageClassifier(arch="small_cnn", norm="bogus")  # type: ignore[arg-type]


def test_build_backbone_rejects_unknown_arch() -> None:
    with pytest.raises(PrivacyConfigError, match=r"arch must be one of .*found 'vgg'"):
        build_backbone("vgg", 2)  # type: ignore[arg-type]
