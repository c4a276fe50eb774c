"""A plain image classifier LightningModule (the non-private baseline and the default private model)."""

from __future__ import annotations

from typing import Any, Literal

import pytorch_lightning as pl
import torch
import torchmetrics
from torch import Tensor, nn

from lightning_dp.errors import PrivacyConfigError, check_finite_positive
from lightning_dp.models.fixers import group_norm_for

__all__ = ["Architecture", "ImageClassifier", "Norm", "build_backbone"]

Architecture = Literal["resnet18", "resnet34", "mobilenet_v2", "small_cnn"]


class SmallCNN(nn.Module):
    """A four-layer CNN with GroupNorm (works with per-sample gradients out of the box)."""

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for i in range(4):
            out = width * 2 ** min(i, 2)
            layers += [nn.Conv2d(channels, out, 3, padding=1), nn.GroupNorm(8, out), nn.ReLU(), nn.MaxPool2d(2)]
            channels = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


Norm = Literal["batch", "group"]
_HEADS = {"resnet18": "fc", "resnet34": "fc", "mobilenet_v2": "classifier", "small_cnn": "head"}


def build_backbone(arch: Architecture, num_classes: int, norm: Norm = "batch") -> nn.Module:
    """A randomly initialised network (no pretrained weights: nothing is downloaded at run time).

    ``norm="group"`` builds the torchvision networks with GroupNorm instead of BatchNorm (what
    per-sample DP-SGD needs; `small_cnn` always uses GroupNorm).
    """
    import torchvision

    if norm not in ("batch", "group"):
        raise PrivacyConfigError(
            f"`ImageClassifier(norm={norm!r})`: norm must be 'batch' or 'group', found {norm!r}. "
            "HINT: 'group' for per-sample DP-SGD."
        )
    kwargs: dict[str, object] = {"weights": None, "num_classes": num_classes}
    if norm == "group":
        kwargs["norm_layer"] = group_norm_for
    if arch == "resnet18":
        return torchvision.models.resnet18(**kwargs)
    if arch == "resnet34":
        return torchvision.models.resnet34(**kwargs)
    if arch == "mobilenet_v2":
        return torchvision.models.mobilenet_v2(**kwargs)
    if arch == "small_cnn":
        return SmallCNN(num_classes)
    raise PrivacyConfigError(
        f"`ImageClassifier(arch={arch!r})`: arch must be one of resnet18, resnet34, mobilenet_v2, small_cnn, "
        f"found {arch!r}. HINT: pass a supported name or subclass ImageClassifier."
    )


class ImageClassifier(pl.LightningModule):
    """Image classification with torchmetrics accuracy and AUROC.

    Batches are ``(images, labels)`` or ``(images, labels, patients)`` as produced by
    `lightning_dp.data.PatientDataModule`; the patient index is ignored here.

    Args:
        arch: backbone name.
        num_classes: number of classes.
        lr: learning rate.
        momentum: SGD momentum (ignored by Adam).
        weight_decay: L2 weight decay (the P3SGD paper uses 1e-4).
        optimizer: ``"sgd"`` or ``"adam"``.
        norm: ``"batch"`` (BatchNorm) or ``"group"`` (GroupNorm, for per-sample DP-SGD).
        freeze_backbone: train only the classifier head; the backbone's parameters are frozen and it
            stays in eval mode (its BatchNorm statistics are not updated). The usual recipe for DP
            fine-tuning of a network pre-trained on public data.

    Example:
        >>> model = ImageClassifier(arch="small_cnn", num_classes=2)
        >>> model(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 2])
    """

    def __init__(
        self,
        arch: Architecture = "resnet18",
        num_classes: int = 2,
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        optimizer: Literal["sgd", "adam"] = "sgd",
        norm: Norm = "batch",
        freeze_backbone: bool = False,
    ) -> None:
        super().__init__()
        check_finite_positive("ImageClassifier", "lr", lr, "e.g. 0.05 for SGD, 1e-3 for Adam.")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise PrivacyConfigError(
                f"`ImageClassifier(num_classes={num_classes!r})`: num_classes must be an integer >= 2, found "
                f"{num_classes!r}. HINT: binary classification uses num_classes=2."
            )
        self.save_hyperparameters()
        self.net = build_backbone(arch, num_classes, norm)
        self.freeze_backbone = freeze_backbone
        if freeze_backbone:
            for name, param in self.net.named_parameters():
                param.requires_grad_(name.startswith(_HEADS[arch] + "."))
            self.train()  # Lightning keeps each module's mode: the backbone must start in eval mode
        task: Literal["binary", "multiclass"] = "multiclass"
        metrics: dict[str, torchmetrics.Metric | torchmetrics.MetricCollection] = {
            "acc": torchmetrics.Accuracy(task=task, num_classes=num_classes),
            "auroc": torchmetrics.AUROC(task=task, num_classes=num_classes),
        }
        self.val_metrics = torchmetrics.MetricCollection(metrics, prefix="val/")
        self.test_metrics = self.val_metrics.clone(prefix="test/")

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def train(self, mode: bool = True) -> ImageClassifier:
        super().train(mode)
        if self.freeze_backbone:
            head = _HEADS[self.hparams["arch"]]
            for name, child in self.net.named_children():
                if name != head:
                    child.eval()
        return self

    def _shared(self, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch[0], batch[1]
        logits = self(x)
        return nn.functional.cross_entropy(logits, y), logits, y

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, _, _ = self._shared(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, logits, y = self._shared(batch)
        self.val_metrics.update(logits.softmax(-1), y)
        self.log("val/loss", loss)
        self.log_dict(self.val_metrics, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        loss, logits, y = self._shared(batch)
        self.test_metrics.update(logits.softmax(-1), y)
        self.log("test/loss", loss)
        self.log_dict(self.test_metrics)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        if hp["optimizer"] == "adam":
            return torch.optim.Adam(self.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"])
        return torch.optim.SGD(self.parameters(), lr=hp["lr"], momentum=hp["momentum"], weight_decay=hp["weight_decay"])
