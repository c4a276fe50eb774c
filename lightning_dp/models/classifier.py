"""A plain image classifier LightningModule (the non-private baseline and the default private model)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import pytorch_lightning as pl
import torch
import torchmetrics
from torch import Tensor, nn

from lightning_dp._quiet import QuietFrozenModes
from lightning_dp.errors import PrivacyConfigError, check_count, check_finite_positive
from lightning_dp.models._optim import configure_optimizers
from lightning_dp.models.fixers import group_norm_for

__all__ = ["Architecture", "ImageClassifier", "Norm", "TrainableGroup", "build_backbone", "trainable_parameter_names"]

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

#: What `ImageClassifier(trainable=[...])` trains: the union of the named groups.
TrainableGroup = Literal["all", "head", "norm", "bias"]
#: The normalization layers whose weight and bias the "norm" group trains.
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm)


def trainable_parameter_names(net: nn.Module, head: str, groups: Sequence[TrainableGroup]) -> set[str]:
    """The qualified names of ``net``'s parameters that the union of ``groups`` selects.

    "all": every parameter; "head": those of the sub-module ``head``; "norm": the weight and bias of
    every normalization layer (BatchNorm*, GroupNorm, LayerNorm, InstanceNorm); "bias": every bias.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(4, 2))
        >>> sorted(trainable_parameter_names(net, "3", ["norm", "head"]))
        ['1.bias', '1.weight', '3.bias', '3.weight']
        >>> sorted(trainable_parameter_names(net, "3", ["bias"]))
        ['0.bias', '1.bias', '3.bias']
    """
    names: set[str] = set()
    for module_name, module in net.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if (
                "all" in groups
                or ("head" in groups and (module_name == head or module_name.startswith(head + ".")))
                or ("norm" in groups and isinstance(module, _NORMS))
                or ("bias" in groups and param_name == "bias")
            ):
                names.add(full)
    return names


def _resolve_trainable(trainable: Sequence[TrainableGroup] | None, freeze_backbone: bool) -> tuple[TrainableGroup, ...]:
    """The validated groups; ``freeze_backbone=True`` is an alias of ``["head"]``."""
    valid = get_args(TrainableGroup)
    if trainable is None:
        return ("head",) if freeze_backbone else ("all",)
    if isinstance(trainable, str) or not isinstance(trainable, Sequence):
        raise PrivacyConfigError(
            f"`ImageClassifier(trainable={trainable!r})`: trainable must be a list of group names, found "
            f"{type(trainable).__name__}. HINT: e.g. trainable=['norm', 'head'] (in YAML: trainable: [norm, head])."
        )
    unknown = [g for g in trainable if g not in valid]
    if unknown:
        raise PrivacyConfigError(
            f"`ImageClassifier(trainable={list(trainable)!r})`: unknown group(s) {unknown}; the valid ones are "
            f"{list(valid)}. HINT: e.g. trainable=['norm', 'head'] fine-tunes the normalization layers and the head."
        )
    if not trainable:
        raise PrivacyConfigError(
            "`ImageClassifier(trainable=[])`: the selection trains nothing. HINT: name at least one of "
            f"{list(valid)}, or leave trainable unset to train everything."
        )
    groups = tuple(dict.fromkeys(trainable))  # deduplicated, in the given order
    if freeze_backbone and set(groups) != {"head"}:
        raise PrivacyConfigError(
            f"`ImageClassifier(freeze_backbone=True, trainable={list(trainable)!r})`: freeze_backbone=True means "
            "trainable=['head'] and contradicts this selection. HINT: give only trainable (freeze_backbone is its "
            "alias for the head alone)."
        )
    return groups


def build_backbone(arch: Architecture, num_classes: int, norm: Norm = "batch", in_channels: int = 3) -> nn.Module:
    """A randomly initialised network (no pretrained weights: nothing is downloaded at run time).

    ``norm="group"`` builds the torchvision networks with GroupNorm instead of BatchNorm (what
    per-sample DP-SGD needs; `small_cnn` always uses GroupNorm). ``in_channels`` other than 3 replaces the
    first convolution by one of the same shape that reads that many channels (1 for grayscale).

    Example:
        >>> build_backbone("resnet18", 2, in_channels=1).conv1
        Conv2d(1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False)
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
    check_count("ImageClassifier", "in_channels", in_channels, "3 for RGB, 1 for grayscale.", minimum=1)
    if arch in ("resnet18", "resnet34"):
        net = getattr(torchvision.models, arch)(**kwargs)
        if in_channels != 3:
            net.conv1 = _reading(net.conv1, in_channels)
        return net
    if arch == "mobilenet_v2":
        net = torchvision.models.mobilenet_v2(**kwargs)
        if in_channels != 3:
            net.features[0][0] = _reading(net.features[0][0], in_channels)
        return net
    if arch == "small_cnn":
        return SmallCNN(num_classes, in_channels)
    raise PrivacyConfigError(
        f"`ImageClassifier(arch={arch!r})`: arch must be one of resnet18, resnet34, mobilenet_v2, small_cnn, "
        f"found {arch!r}. HINT: pass a supported name or subclass ImageClassifier."
    )


def _reading(conv: nn.Conv2d, in_channels: int) -> nn.Conv2d:
    """A freshly initialised convolution like ``conv`` that reads ``in_channels`` channels."""
    return nn.Conv2d(
        in_channels,
        conv.out_channels,
        conv.kernel_size,  # type: ignore[arg-type]
        stride=conv.stride,  # type: ignore[arg-type]
        padding=conv.padding,  # type: ignore[arg-type]
        bias=conv.bias is not None,
    )


def load_public_weights(path: str | Path, net: nn.Module) -> dict[str, Tensor]:
    """The backbone state dict in ``path``, checked against ``net`` (keys and shapes), ready to load.

    ``path`` holds a Lightning checkpoint (its ``state_dict``, keys ``net.…``) or a plain state dict
    (keys ``net.…`` or the backbone's own). Only tensors are read (``torch.load(weights_only=True)``).

    Raises:
        PrivacyConfigError: no such file, a file that is not a checkpoint or state dict, or keys or shapes
            that differ from ``net``'s (the first few are named, with a hint).
    """
    where = f"`ImageClassifier(init_weights={str(path)!r})`"
    file = Path(path)
    if not file.is_file():
        raise PrivacyConfigError(
            f"{where}: no such file. HINT: it is the public model to start from; make it with a non-private run on "
            "public data first, e.g. `lightning-dp fit --config configs/public_pretrain_synthetic.yaml` (it writes "
            "runs/public_resnet18_synthetic/public.ckpt)."
        )
    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is the same user error
        raise PrivacyConfigError(
            f"{where}: not a checkpoint or state dict readable with torch.load(weights_only=True): {exc}. HINT: "
            "save the public weights with torch.save(model.state_dict(), path) or a Lightning ModelCheckpoint."
        ) from None
    state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise PrivacyConfigError(
            f"{where}: found no state dict of tensors in the file. HINT: save it with torch.save(model.state_dict(), "
            "path) or a Lightning ModelCheckpoint."
        )
    if any(str(k).startswith("net.") for k in state):
        state = {k[len("net.") :]: v for k, v in state.items() if k.startswith("net.")}
    expected = net.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [
        f"{k}: {tuple(state[k].shape)} in the file, {tuple(v.shape)} here"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} key(s) missing (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})")
        if shapes:
            parts.append(f"{len(shapes)} of another shape (e.g. {shapes[:2]})")
        raise PrivacyConfigError(
            f"{where}: the weights do not fit this network: {'; '.join(parts)}. HINT: use the arch, norm, "
            "num_classes and in_channels the public model was trained with."
        )
    return state


class ImageClassifier(QuietFrozenModes, pl.LightningModule):
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
        in_channels: channels of the input images (3 for RGB, 1 for grayscale: CT, MRI, X-ray). A batch with
            another number of channels is refused with the number found and this hint.
        freeze_backbone: train only the classifier head (an alias of ``trainable=["head"]``): the usual
            recipe for DP fine-tuning of a network pre-trained on public data.
        trainable: what is trained, the union of named groups: ``"all"`` (everything, the default),
            ``"head"`` (the classifier head), ``"norm"`` (weight and bias of every normalization layer:
            BatchNorm, GroupNorm, LayerNorm, InstanceNorm), ``"bias"`` (every bias). Everything else is
            frozen. Unless ``"all"`` is named, every module but the head stays in eval mode, so BatchNorm
            normalizes with its running statistics, which are never updated: no statistic of the private
            data is released, and per-sample DP-SGD can train a BatchNorm's affine (parameter-efficient
            private fine-tuning, e.g. ``["norm", "head"]``).
        init_weights: a file of *public* weights to start from (no privacy cost: they must not come from
            the private patients): a Lightning checkpoint of an ``ImageClassifier`` with the same ``arch``,
            ``norm``, ``num_classes`` and ``in_channels`` (e.g. the last checkpoint of a non-private run on
            public data: ``configs/public_pretrain_synthetic.yaml``), or a ``state_dict`` saved with
            ``torch.save`` (of the module or of its backbone ``net``). Loaded in full, before any
            training; a missing file or a mismatched key or shape is refused with the keys and a hint.
            Resuming from a checkpoint (``ckpt_path``) then replaces these weights by the checkpoint's.
        lr_schedule: ``"constant"``, or ``"cosine"``: the rate decays to 0 along a half cosine over the run's
            optimizer steps (``trainer.estimated_stepping_batches``), so the last epochs settle instead of
            jumping between minima (the non-private baseline's final accuracy then no longer depends on the
            CPU thread count).

    Raises:
        PrivacyConfigError: an unknown group (the message lists the valid ones), a selection that trains
            no parameter, or ``freeze_backbone=True`` beside a ``trainable`` other than ``["head"]``.

    Example:
        >>> model = ImageClassifier(arch="small_cnn", num_classes=2)
        >>> model(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 2])
        >>> peft = ImageClassifier(arch="small_cnn", num_classes=2, trainable=["norm", "head"])
        >>> sum(p.numel() for p in peft.parameters() if p.requires_grad), peft.net.features.training
        (962, False)
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
        trainable: list[TrainableGroup] | None = None,
        in_channels: int = 3,
        init_weights: str | None = None,
        lr_schedule: Literal["constant", "cosine"] = "constant",
    ) -> None:
        super().__init__()
        check_finite_positive("ImageClassifier", "lr", lr, "e.g. 0.05 for SGD, 1e-3 for Adam.")
        if lr_schedule not in ("constant", "cosine"):
            raise PrivacyConfigError(
                f"`ImageClassifier(lr_schedule={lr_schedule!r})`: lr_schedule must be 'constant' or 'cosine', found "
                f"{lr_schedule!r}. HINT: 'cosine' decays the rate to 0 over the run's optimizer steps."
            )
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise PrivacyConfigError(
                f"`ImageClassifier(num_classes={num_classes!r})`: num_classes must be an integer >= 2, found "
                f"{num_classes!r}. HINT: binary classification uses num_classes=2."
            )
        groups = _resolve_trainable(trainable, freeze_backbone)
        self.save_hyperparameters()
        self.net = build_backbone(arch, num_classes, norm, in_channels)
        if init_weights is not None:
            self.net.load_state_dict(load_public_weights(init_weights, self.net))
        self.in_channels = in_channels
        self.freeze_backbone = freeze_backbone
        #: The groups trained (resolved: freeze_backbone=True is ("head",), nothing given is ("all",)).
        self.trainable: tuple[TrainableGroup, ...] = groups
        if "all" not in groups:
            selected = trainable_parameter_names(self.net, _HEADS[arch], groups)
            if not selected:
                raise PrivacyConfigError(
                    f"`ImageClassifier(arch={arch!r}, trainable={list(groups)!r})`: the selection trains no parameter "
                    f"of this network. HINT: add 'head' (or choose groups that {arch} has)."
                )
            for name, param in self.net.named_parameters():
                param.requires_grad_(name in selected)
            self.train()  # Lightning keeps each module's mode: the backbone must start in eval mode
        task: Literal["binary", "multiclass"] = "multiclass"
        metrics: dict[str, torchmetrics.Metric | torchmetrics.MetricCollection] = {
            "acc": torchmetrics.Accuracy(task=task, num_classes=num_classes),
            "auroc": torchmetrics.AUROC(task=task, num_classes=num_classes),
        }
        self.val_metrics = torchmetrics.MetricCollection(metrics, prefix="val/")
        self.test_metrics = self.val_metrics.clone(prefix="test/")

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            found = f"{x.shape[1]} channel(s)" if x.dim() == 4 else f"a {x.dim()}-D tensor of shape {tuple(x.shape)}"
            raise PrivacyConfigError(
                f"`ImageClassifier(in_channels={self.in_channels})`: expected images of shape (B, {self.in_channels}, "
                f"H, W), found {found}. HINT: set in_channels to your images' channel count (1 for grayscale; in "
                "YAML: model.init_args.in_channels: 1), or convert the images in the dataset's transform."
            )
        return self.net(x)

    def train(self, mode: bool = True) -> ImageClassifier:
        super().train(mode)
        if "all" not in getattr(self, "trainable", ("all",)):
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

    def sample_scores(self, batch: Any) -> Tensor:
        """1.0 for each sample of ``batch`` classified right, 0.0 otherwise (a private search's released score)."""
        return (self(batch[0]).argmax(-1) == batch[1]).float()

    def test_step(self, batch: Any, batch_idx: int) -> None:
        loss, logits, y = self._shared(batch)
        self.test_metrics.update(logits.softmax(-1), y)
        self.log("test/loss", loss)
        self.log_dict(self.test_metrics)

    def configure_optimizers(self) -> Any:
        return configure_optimizers(self)
