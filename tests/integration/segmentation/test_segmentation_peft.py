"""Fine-tuning part of a segmentation network privately: `SegmentationModule(trainable=[...])` under DPSGD and P3SGD.

Only the selected parameters may change (the frozen encoder comes out bit-identical, so nothing computed
from private data leaves the run through it), and with BatchNorm the running statistics stay frozen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_dp.callbacks import DPSGD, P3SGD
from lightning_dp.data import SyntheticSilhouettesDataModule
from lightning_dp.errors import PrivacyConfigError
from lightning_dp.models import SegmentationModule, segmentation_trainable_names


def _tiny(trainable: Any, **kw: Any) -> SegmentationModule:
    return SegmentationModule(
        arch="monai_unet", monai_channels=(4, 8, 16), monai_res_units=1, trainable=trainable, lr=1e-2, **kw
    )


def _data(root: Path) -> SyntheticSilhouettesDataModule:
    return SyntheticSilhouettesDataModule(
        root=str(root), num_patients=8, images_per_patient=3, image_size=16, batch_size=4, val_fraction=0.125,
        test_fraction=0.125,
    )  # fmt: skip


def _trainer(root: Path, callbacks: list[pl.Callback], steps: int = 2) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=root,
    )


def _changed(model: SegmentationModule, before: dict[str, torch.Tensor]) -> set[str]:
    after = model.state_dict()
    return {k for k in before if not torch.equal(before[k], after[k])}


def test_the_decoder_of_a_monai_unet_is_its_upsampling_path() -> None:
    model = _tiny(["decoder"])
    trained = {name for name, p in model.net.named_parameters() if p.requires_grad}
    # MONAI nests Sequential(down, SkipConnection(deeper levels), up) per level: the ups are the decoder.
    ups = ("model.2.", "model.1.submodule.2.")
    assert trained == {name for name, _ in model.net.named_parameters() if name.startswith(ups)}
    assert 0 < sum(model.net.get_parameter(n).numel() for n in trained) < sum(p.numel() for p in model.parameters())
    assert segmentation_trainable_names(model.net, ["all"]) == {n for n, _ in model.net.named_parameters()}


def test_the_decoder_of_an_smp_network_is_its_decoder_and_head() -> None:
    model = SegmentationModule(arch="unet", trainable=["decoder"])
    trained = {name for name, p in model.net.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith(("decoder.", "segmentation_head.")) for n in trained)
    assert not any(p.requires_grad for p in model.net.encoder.parameters())


@pytest.mark.parametrize(
    ("trainable", "match"),
    [
        ("decoder", r"trainable must be a list.*found str.*HINT: e\.g\. trainable=\['decoder'\]"),
        (["encoder"], r"unknown group\(s\) \['encoder'\].*'all', 'decoder', 'norm', 'bias'"),
        ([], r"the selection trains nothing"),
    ],
)
def test_a_bad_selection_is_refused_with_the_valid_groups(trainable: Any, match: str) -> None:
    with pytest.raises(PrivacyConfigError, match=match):
        _tiny(trainable)


@pytest.mark.parametrize("groups", [["decoder"], ["norm"]])
def test_dpsgd_changes_only_the_selection(tmp_path: Path, groups: list[str]) -> None:
    model = _tiny(groups)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dp = DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=6, seed=3)
    _trainer(tmp_path, [dp]).fit(model, _data(tmp_path / "data"))
    assert dp.ledger is not None and dp.ledger.steps == 2
    trained = {f"net.{n}" for n, p in model.net.named_parameters() if p.requires_grad}
    assert _changed(model, before) == trained


def test_p3sgd_changes_only_the_decoder_and_no_batchnorm_statistic(tmp_path: Path) -> None:
    model = _tiny(["decoder"], norm="batch")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    statistics = [k for k in before if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert statistics
    dp = P3SGD(sample_rate=0.5, clip_norm=1.0, local_lr=0.1, seed=3)
    _trainer(tmp_path, [dp]).fit(model, _data(tmp_path / "data"))
    assert dp.ledger is not None and dp.ledger.steps == 2
    trained = {f"net.{n}" for n, p in model.net.named_parameters() if p.requires_grad}
    assert _changed(model, before) == trained  # no statistic, no encoder weight moved
