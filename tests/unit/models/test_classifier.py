"""`ImageClassifier(trainable=[...])`: which parameters train, which modules stay in eval mode, bad selections."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_dp.errors import PrivacyConfigError
from lightning_dp.models import ImageClassifier, validate_model

_NORMS = (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm, nn.InstanceNorm2d)


def _trained(model: ImageClassifier) -> set[str]:
    return {name for name, p in model.net.named_parameters() if p.requires_grad}


def _expected_norm_and_head(net: nn.Module, head: str) -> set[str]:
    names = {f"{head}.weight", f"{head}.bias"}
    for module_name, module in net.named_modules():
        if isinstance(module, _NORMS):
            names |= {f"{module_name}.weight", f"{module_name}.bias"}
    return names


@pytest.mark.parametrize(
    ("arch", "head", "norm_type"), [("resnet18", "fc", nn.BatchNorm2d), ("small_cnn", "head", nn.GroupNorm)]
)
def test_norm_and_head_train_exactly_the_normalization_layers_and_the_head(
    arch: Any, head: str, norm_type: type[nn.Module]
) -> None:
    model = ImageClassifier(arch=arch, norm="batch", trainable=["norm", "head"])
    expected = _expected_norm_and_head(model.net, head)
    assert _trained(model) == expected
    norms = [m for m in model.net.modules() if isinstance(m, norm_type)]
    assert norms and len(expected) == 2 * len(norms) + 2
    model.train()
    head_module = model.net.get_submodule(head)
    for name, module in list(model.net.named_modules())[1:]:  # the container itself computes nothing
        inside_head = module is head_module or name.startswith(head + ".")
        assert module.training == inside_head, f"{name or '<net>'} must be in {'train' if inside_head else 'eval'} mode"
    model.eval()
    assert not any(m.training for m in model.modules())


def test_resnet18_with_batchnorm_and_norm_head_is_trainable_by_per_sample_dp_sgd() -> None:
    model = ImageClassifier(arch="resnet18", norm="batch", trainable=["norm", "head"]).train()
    assert validate_model(model) == [], "eval-mode BatchNorm with a trained affine has a per-sample rule"
    assert validate_model(ImageClassifier(arch="resnet18", norm="batch").train()) != []


def test_bias_group_trains_every_bias_and_nothing_else() -> None:
    model = ImageClassifier(arch="resnet18", trainable=["bias"])
    biases = {name for name, _ in model.net.named_parameters() if name.endswith(".bias")}
    assert _trained(model) == biases and "fc.bias" in biases and "bn1.bias" in biases


def test_all_and_default_train_everything_in_training_mode() -> None:
    for model in (ImageClassifier(arch="small_cnn"), ImageClassifier(arch="small_cnn", trainable=["all", "bias"])):
        assert all(p.requires_grad for p in model.parameters())
        model.train()
        assert all(m.training for m in model.modules())
    assert ImageClassifier(arch="small_cnn").trainable == ("all",)


def test_freeze_backbone_is_an_alias_of_head() -> None:
    alias = ImageClassifier(arch="resnet18", freeze_backbone=True)
    named = ImageClassifier(arch="resnet18", trainable=["head"])
    both = ImageClassifier(arch="resnet18", freeze_backbone=True, trainable=["head"])
    assert _trained(alias) == _trained(named) == _trained(both) == {"fc.weight", "fc.bias"}
    assert alias.trainable == named.trainable == ("head",)
    assert not alias.net.get_submodule("layer1").training and not named.net.get_submodule("layer1").training


def test_freeze_backbone_with_another_selection_is_refused() -> None:
    with pytest.raises(PrivacyConfigError, match=r"freeze_backbone=True.*contradicts.*HINT"):
        ImageClassifier(arch="small_cnn", freeze_backbone=True, trainable=["norm", "head"])


def test_an_unknown_group_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(
        PrivacyConfigError,
        match=r"unknown group\(s\) \['layer4'\]; the valid ones are \['all', 'head', 'norm', 'bias'\]",
    ):
        ImageClassifier(arch="small_cnn", trainable=["head", "layer4"])  # type: ignore[list-item]


def test_a_string_instead_of_a_list_is_refused() -> None:
    with pytest.raises(PrivacyConfigError, match=r"trainable must be a list of group names, found str"):
        ImageClassifier(arch="small_cnn", trainable="head")  # type: ignore[arg-type]


def test_a_selection_that_trains_nothing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PrivacyConfigError, match=r"trainable=\[\]\)`: the selection trains nothing"):
        ImageClassifier(arch="small_cnn", trainable=[])
    import lightning_dp.models.classifier as classifier

    def no_norms_no_biases(arch: Any, num_classes: int, norm: Any = "batch", in_channels: int = 3) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(12, num_classes, bias=False))

    monkeypatch.setattr(classifier, "build_backbone", no_norms_no_biases)
    with pytest.raises(PrivacyConfigError, match=r"trains no parameter of this network"):
        ImageClassifier(arch="small_cnn", trainable=["norm", "bias"])


def test_the_selection_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    model = ImageClassifier(arch="small_cnn", trainable=["norm", "head"])
    trainer = pl.Trainer(accelerator="cpu", max_steps=0, logger=False, enable_progress_bar=False)
    trainer.strategy.connect(model)
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    loaded = ImageClassifier.load_from_checkpoint(path)
    assert loaded.hparams["trainable"] == ["norm", "head"]
    assert loaded.trainable == ("norm", "head")
    assert _trained(loaded) == _trained(model)
    loaded.train()
    assert not loaded.net.get_submodule("features").training and loaded.net.get_submodule("head").training
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
