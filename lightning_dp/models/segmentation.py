r"""Binary segmentation: reference networks, a per-sample loss, and a LightningModule with Dice / IoU.

Per-sample DP-SGD clips each sample's gradient, which bounds a sample's influence only if the
loss of a batch is a sum (or mean) of per-sample losses. A Dice loss computed over the whole batch
(smp's ``DiceLoss``, MONAI's ``DiceLoss(batch=True)``) divides by a batch-wide foreground count and
couples the samples; `segmentation_loss` computes every term per sample (Dice per image, then the
mean over the batch), and ``reduction="none"`` returns the per-sample losses themselves.

Metrics follow the thesis' protocol: Dice (and IoU) of the thresholded sigmoid, with the threshold
chosen on validation data. During validation the Dice is measured at every threshold of a small
grid; at the end of validation the best one is stored in the ``threshold`` buffer (saved in
checkpoints and in ``state_dict()``), and testing uses it. Dice and IoU are torchmetrics'
``DiceScore`` and ``MeanIoU``: computed per image, then averaged over the images; an image whose
mask and prediction are both empty has no Dice and is left out of the mean (torchmetrics'
convention), an image with an empty mask and a non-empty prediction scores 0.

Example:
    >>> _ = torch.manual_seed(0)
    >>> logits = torch.randn(2, 1, 4, 4)
    >>> masks = (torch.rand(2, 1, 4, 4) > 0.5).float()
    >>> segmentation_loss(logits, masks, kind="dice", reduction="none").shape
    torch.Size([2])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, cast

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.segmentation import DiceScore, MeanIoU

from lightning_dp._quiet import QuietFrozenModes
from lightning_dp.errors import PrivacyConfigError, check_count, check_finite_positive
from lightning_dp.models._optim import configure_optimizers
from lightning_dp.models.classifier import _NORMS  # the "norm" group is the same for both model families
from lightning_dp.models.fixers import fix_model

__all__ = [
    "DEFAULT_THRESHOLDS",
    "LossKind",
    "LossReduction",
    "SegmentationArch",
    "SegmentationModule",
    "SegmentationTrainable",
    "build_segmentation_model",
    "segmentation_loss",
    "segmentation_trainable_names",
]

SegmentationArch = Literal["unet", "fpn", "deeplabv3", "monai_unet"]
LossKind = Literal["bce", "dice", "bce_dice"]
LossReduction = Literal["mean", "sum", "none"]
Norm = Literal["batch", "group"]
#: What `SegmentationModule(trainable=[...])` trains: the union of the named groups.
SegmentationTrainable = Literal["all", "decoder", "norm", "bias"]

#: The validation grid of sigmoid thresholds.
DEFAULT_THRESHOLDS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
_SMP = {"unet": "Unet", "fpn": "FPN", "deeplabv3": "DeepLabV3"}
_MONAI_HINT = "pip install lightning-dp[monai]"


def build_segmentation_model(
    arch: SegmentationArch = "unet",
    in_channels: int = 3,
    classes: int = 1,
    encoder: str = "resnet18",
    norm: Norm = "group",
    spatial_dims: int = 2,
    monai_channels: tuple[int, ...] = (16, 32, 64, 128),
    monai_res_units: int = 2,
) -> nn.Module:
    """A randomly initialised segmentation network that returns logits (no pretrained weights are downloaded).

    ``"unet"``, ``"fpn"`` and ``"deeplabv3"`` are segmentation-models-pytorch networks (2-D, with the
    ``encoder`` backbone, ``encoder_weights=None``; their input sides must be multiples of 32).
    ``"monai_unet"`` is MONAI's residual ``UNet`` (2-D or 3-D, channels ``monai_channels``, stride 2
    between levels; MONAI is imported only here). With ``norm="group"`` every BatchNorm is replaced
    by GroupNorm (`lightning_dp.models.fix_model`), which per-sample DP-SGD needs; ``"batch"`` keeps
    BatchNorm (the non-private baseline; P3SGD releases its statistics clipped and noised).

    Args:
        arch: the network.
        in_channels: input channels (3 for RGB).
        classes: output channels (1 for binary segmentation).
        encoder: the smp encoder (ignored by ``"monai_unet"``), e.g. ``"resnet18"``, ``"resnet34"``.
        norm: ``"group"`` (GroupNorm) or ``"batch"`` (BatchNorm).
        spatial_dims: 2, or 3 for ``"monai_unet"``.
        monai_channels: the feature channels of MONAI's UNet levels (at least two).
        monai_res_units: residual units per MONAI level.

    Returns:
        The network, ``(B, in_channels, *spatial) -> (B, classes, *spatial)`` logits.

    Raises:
        PrivacyConfigError: an argument is invalid (an unknown arch or encoder, 3-D with an smp network, …).
        ImportError: ``"monai_unet"`` without MONAI installed (the message says how to install it).

    Example:
        >>> net = build_segmentation_model("monai_unet", in_channels=1, spatial_dims=3, monai_channels=(8, 16))
        >>> net(torch.zeros(1, 1, 8, 8, 8)).shape
        torch.Size([1, 1, 8, 8, 8])
    """
    owner = "build_segmentation_model"
    check_count(owner, "in_channels", in_channels, "3 for RGB, 1 for grayscale.", minimum=1)
    check_count(owner, "classes", classes, "1 for binary segmentation.", minimum=1)
    if norm not in ("batch", "group"):
        raise PrivacyConfigError(
            f"`{owner}(norm={norm!r})`: norm must be 'batch' or 'group', found {norm!r}. "
            "HINT: 'group' for per-sample DP-SGD."
        )
    if arch == "monai_unet":
        net = _monai_unet(in_channels, classes, spatial_dims, monai_channels, monai_res_units)
    elif arch in _SMP:
        if spatial_dims != 2:
            raise PrivacyConfigError(
                f"`{owner}(arch={arch!r}, spatial_dims={spatial_dims!r})`: segmentation-models-pytorch networks are "
                f"2-D, found spatial_dims={spatial_dims!r}. HINT: use arch='monai_unet' for 3-D volumes, or slices."
            )
        import segmentation_models_pytorch as smp

        try:
            net = getattr(smp, _SMP[arch])(
                encoder_name=encoder, encoder_weights=None, in_channels=in_channels, classes=classes
            )
        except KeyError as exc:
            raise PrivacyConfigError(
                f"`{owner}(encoder={encoder!r})`: encoder must be a segmentation-models-pytorch encoder, found "
                f"{encoder!r}. HINT: e.g. 'resnet18', 'resnet34', 'efficientnet-b0' "
                "(segmentation_models_pytorch.encoders.get_encoder_names() lists them)."
            ) from exc
    else:
        raise PrivacyConfigError(
            f"`{owner}(arch={arch!r})`: arch must be one of unet, fpn, deeplabv3, monai_unet, found {arch!r}. "
            "HINT: or wrap your own network in a LightningModule."
        )
    if norm == "group":
        fix_model(net, warn=False)
    return net


def _monai_unet(
    in_channels: int, classes: int, spatial_dims: int, channels: Sequence[int], res_units: int
) -> nn.Module:
    owner = "build_segmentation_model"
    if spatial_dims not in (2, 3) or isinstance(spatial_dims, bool):
        raise PrivacyConfigError(
            f"`{owner}(spatial_dims={spatial_dims!r})`: spatial_dims must be 2 or 3, found {spatial_dims!r}. "
            "HINT: 3 for volumes (patches), 2 for images and slices."
        )
    if len(channels) < 2 or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in channels):
        raise PrivacyConfigError(
            f"`{owner}(monai_channels={channels!r})`: monai_channels must be at least two integers >= 1, found "
            f"{channels!r}. HINT: e.g. (16, 32, 64, 128)."
        )
    check_count(owner, "monai_res_units", res_units, "MONAI's default is 2.")
    try:
        from monai.networks.nets import UNet
    except ImportError as exc:
        raise ImportError(
            f"`{owner}(arch='monai_unet')`: MONAI must be installed for its UNet, found it missing ({exc}). "
            f"HINT: {_MONAI_HINT}, or use arch='unet' (segmentation-models-pytorch, 2-D)."
        ) from exc
    # Built with BatchNorm so that fix_model turns it into GroupNorm with a group count that divides each level.
    return UNet(
        spatial_dims=spatial_dims,
        in_channels=in_channels,
        out_channels=classes,
        channels=tuple(channels),
        strides=(2,) * (len(channels) - 1),
        num_res_units=res_units,
        norm="batch",
    )


def _decoder_modules(net: nn.Module) -> list[str]:
    """The qualified names of ``net``'s decoder sub-modules (the path from the bottleneck up, and the head).

    smp networks: ``decoder`` and ``segmentation_head``. MONAI's UNet nests one ``Sequential(down,
    SkipConnection(deeper levels), up)`` per level: every such ``up`` (child ``"2"``) is decoder.
    """
    names = [name for name in ("decoder", "segmentation_head") if isinstance(getattr(net, name, None), nn.Module)]
    if names:
        return names
    for name, module in net.named_modules():
        children = dict(module.named_children())
        if (
            isinstance(module, nn.Sequential)
            and list(children) == ["0", "1", "2"]
            and type(children["1"]).__name__ == "SkipConnection"
        ):
            names.append(f"{name}.2" if name else "2")
    return names


def segmentation_trainable_names(net: nn.Module, groups: Sequence[SegmentationTrainable]) -> set[str]:
    """The qualified names of ``net``'s parameters that the union of ``groups`` selects.

    "all": every parameter; "decoder": the decoder and the segmentation head (`_decoder_modules`: smp's
    ``decoder`` and ``segmentation_head``, MONAI UNet's up-sampling path); "norm": the weight and bias of
    every normalization layer; "bias": every bias.

    Example:
        >>> net = build_segmentation_model("monai_unet", in_channels=1, monai_channels=(4, 8), monai_res_units=0)
        >>> sorted(segmentation_trainable_names(net, ["decoder"]))
        ['model.2.conv.bias', 'model.2.conv.weight']
    """
    decoder = _decoder_modules(net)
    names: set[str] = set()
    for module_name, module in net.named_modules():
        in_decoder = any(module_name == d or module_name.startswith(d + ".") for d in decoder)
        for param_name, _ in module.named_parameters(recurse=False):
            if (
                "all" in groups
                or ("decoder" in groups and in_decoder)
                or ("norm" in groups and isinstance(module, _NORMS))
                or ("bias" in groups and param_name == "bias")
            ):
                names.add(f"{module_name}.{param_name}" if module_name else param_name)
    return names


def _resolve_segmentation_trainable(trainable: Any) -> tuple[SegmentationTrainable, ...]:
    valid = ("all", "decoder", "norm", "bias")
    if trainable is None:
        return ("all",)
    if isinstance(trainable, str) or not isinstance(trainable, Sequence):
        raise PrivacyConfigError(
            f"`SegmentationModule(trainable={trainable!r})`: trainable must be a list of group names, found "
            f"{type(trainable).__name__}. HINT: e.g. trainable=['decoder'] (in YAML: trainable: [decoder])."
        )
    unknown = [g for g in trainable if g not in valid]
    if unknown or not trainable:
        raise PrivacyConfigError(
            f"`SegmentationModule(trainable={list(trainable)!r})`: "
            + (f"unknown group(s) {unknown}" if unknown else "the selection trains nothing")
            + f"; the valid groups are {list(valid)}. HINT: e.g. trainable=['decoder'] fine-tunes the decoder and "
            "the head of a pre-trained network, leave trainable unset to train everything."
        )
    return tuple(dict.fromkeys(trainable))


_LOSS_KINDS = ("bce", "dice", "bce_dice")
_REDUCTIONS = ("mean", "sum", "none")


def _check_choice(owner: str, name: str, value: object, choices: tuple[str, ...], hint: str = "") -> None:
    """Raises `PrivacyConfigError` unless ``value`` is one of ``choices`` (the message ends with ``HINT: hint``)."""
    if value not in choices:
        allowed = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}"
        raise PrivacyConfigError(
            f"`{owner}({name}={value!r})`: {name} must be {allowed}, found {value!r}."
            + (f" HINT: {hint}" if hint else "")
        )


def segmentation_loss(
    logits: Tensor,
    masks: Tensor,
    kind: LossKind = "bce_dice",
    reduction: LossReduction = "mean",
    smooth: float = 1.0,
) -> Tensor:
    r"""A segmentation loss computed **per sample**, then reduced over the batch.

    For sample :math:`i` with probabilities :math:`p = \sigma(\text{logits}_i)` and mask :math:`y`
    (sums over all its pixels and channels):

    * ``"bce"``: the mean over its pixels of the binary cross-entropy with logits;
    * ``"dice"``: :math:`1 - (2\sum p y + s) / (\sum p + \sum y + s)` (soft Dice, smoothing ``s``;
      an empty mask predicted empty costs 0);
    * ``"bce_dice"``: their sum.

    Sample :math:`i`'s loss depends on sample :math:`i` only, never on the batch (unlike a Dice over the
    whole batch), so per-sample clipping bounds each sample's influence.

    Args:
        logits: (B, C, \*spatial) logits.
        masks: targets of the same shape, in [0, 1].
        kind: the loss.
        reduction: ``"mean"`` or ``"sum"`` over the batch, or ``"none"`` for the (B,) per-sample losses.
        smooth: Dice smoothing ``s`` (> 0).

    Returns:
        A scalar, or the (B,) per-sample losses with ``reduction="none"``.

    Raises:
        PrivacyConfigError: the shapes differ, or ``kind``, ``reduction`` or ``smooth`` is invalid.

    Example:
        >>> logits = torch.full((2, 1, 2, 2), 20.0)
        >>> masks = torch.stack([torch.ones(1, 2, 2), torch.zeros(1, 2, 2)])
        >>> segmentation_loss(logits, masks, kind="dice", reduction="none").round(decimals=3)
        tensor([0.0000, 0.8000])
    """
    owner = "segmentation_loss"
    if logits.shape != masks.shape or logits.dim() < 2:
        raise PrivacyConfigError(
            f"`{owner}(logits, masks)`: logits and masks must have the same shape (B, C, *spatial), found "
            f"{tuple(logits.shape)} and {tuple(masks.shape)}. HINT: masks are (B, 1, H, W) for binary segmentation."
        )
    _check_choice(owner, "kind", kind, _LOSS_KINDS, "'bce_dice' is a robust default.")
    _check_choice(
        owner,
        "reduction",
        reduction,
        _REDUCTIONS,
        "'none' returns the per-sample losses (DPSGD(loss_reduction='none')).",
    )
    check_finite_positive(owner, "smooth", smooth, "1.0 is usual.")
    masks = masks.to(logits.dtype)
    dims = tuple(range(1, logits.dim()))
    losses = torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device)
    if kind in ("bce", "bce_dice"):
        losses = losses + nn.functional.binary_cross_entropy_with_logits(logits, masks, reduction="none").mean(dims)
    if kind in ("dice", "bce_dice"):
        probs = logits.sigmoid()
        overlap = (probs * masks).sum(dims)
        total = probs.sum(dims) + masks.sum(dims)
        losses = losses + 1.0 - (2.0 * overlap + smooth) / (total + smooth)
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.mean()


def _check_thresholds(owner: str, threshold: Any, grid: Any) -> tuple[float, ...]:
    def ok(t: Any) -> bool:
        return isinstance(t, (int, float)) and not isinstance(t, bool) and 0.0 < t < 1.0

    if not ok(threshold):
        raise PrivacyConfigError(
            f"`{owner}(threshold={threshold!r})`: threshold must be a number in (0, 1), found {threshold!r}. "
            "HINT: it thresholds the sigmoid probability; 0.5 is the usual start."
        )
    values = tuple(grid) if grid is not None else ()
    if not all(ok(t) for t in values) or len(set(values)) != len(values):
        raise PrivacyConfigError(
            f"`{owner}(threshold_grid={grid!r})`: threshold_grid must be distinct numbers in (0, 1) (or None to keep "
            f"the threshold fixed), found {grid!r}. HINT: e.g. (0.1, 0.2, ..., 0.9)."
        )
    return tuple(float(t) for t in sorted(values))


class SegmentationModule(QuietFrozenModes, pl.LightningModule):
    """Binary segmentation with a per-sample loss, Dice and IoU, and a threshold chosen on validation data.

    Batches are ``(images, masks)`` or ``(images, masks, patients)`` as produced by
    `lightning_dp.data.SegmentationDataModule`; the patient index is ignored here. ``training_step``
    returns the loss reduced as ``loss_reduction`` says (give the same value to
    ``DPSGD(loss_reduction=...)``; P3SGD needs a scalar: ``"mean"`` or ``"sum"``) and logs only the
    batch's mean loss, as `ImageClassifier` does. Validation logs ``val/loss`` and, at the threshold of
    the grid with the best validation Dice, ``val/dice``, ``val/iou`` and ``val/threshold``; that
    threshold is stored in the ``threshold`` buffer (skipped in Lightning's sanity check). Testing logs
    ``test/loss``, ``test/dice`` and ``test/iou`` at the stored threshold. ``predict_step`` returns
    probabilities (the sigmoid of the logits) for batches of images or ``(images, …)`` tuples.

    The threshold is selected on the validation patients, not on the private training data; a
    threshold chosen on private data would be a (tiny) un-noised release.

    Args:
        arch: the network (`build_segmentation_model`).
        encoder: the smp encoder.
        in_channels: input channels.
        norm: ``"group"`` (GroupNorm, for per-sample DP-SGD) or ``"batch"``.
        spatial_dims: 2, or 3 with ``arch="monai_unet"``.
        monai_channels: MONAI UNet channels.
        monai_res_units: residual units per MONAI UNet level.
        loss: ``"bce"``, ``"dice"`` or ``"bce_dice"`` (`segmentation_loss`).
        loss_reduction: how ``training_step`` reduces the per-sample losses: ``"mean"``, ``"sum"`` or
            ``"none"`` (the (B,) losses).
        lr: learning rate.
        optimizer: ``"adam"`` or ``"sgd"``.
        momentum: SGD momentum (ignored by Adam).
        weight_decay: L2 weight decay of the optimizer.
        threshold: the initial sigmoid threshold in (0, 1), used until a validation selects one.
        threshold_grid: the thresholds tried on validation data; ``None`` keeps ``threshold`` fixed.
        lr_schedule: ``"constant"``, or ``"cosine"``: the rate decays to 0 along a half cosine over the
            run's optimizer steps (``trainer.estimated_stepping_batches``, so set ``max_epochs`` or
            ``max_steps``); the last epochs then settle instead of jumping between minima, which steadies
            the final (and validation-chosen) Dice of a short run.
        trainable: what is trained, the union of named groups (`segmentation_trainable_names`): ``"all"``
            (everything, the default), ``"decoder"`` (the decoder and the segmentation head), ``"norm"``
            (the normalization layers' affine parameters), ``"bias"``. The rest is frozen
            (``requires_grad=False``): fine-tuning a public pre-trained network privately then releases
            only the selected parameters, and the fewer they are, the less noise they carry. With
            ``norm="batch"`` and a selection, every BatchNorm stays in eval mode (its statistics are frozen;
            calling ``.train()`` on ``model.net`` itself would bypass this, and P3SGD would then release the
            statistics clipped and noised, DPSGD convert the layers to GroupNorm).

    Example:
        >>> model = SegmentationModule(arch="monai_unet", in_channels=1, monai_channels=(8, 16))
        >>> model.predict_step(torch.zeros(2, 1, 16, 16), 0).shape, float(model.threshold)
        (torch.Size([2, 1, 16, 16]), 0.5)
    """

    threshold: Tensor

    def __init__(
        self,
        arch: SegmentationArch = "unet",
        encoder: str = "resnet18",
        in_channels: int = 3,
        norm: Norm = "group",
        spatial_dims: int = 2,
        monai_channels: tuple[int, ...] = (16, 32, 64, 128),
        monai_res_units: int = 2,
        loss: LossKind = "bce_dice",
        loss_reduction: LossReduction = "mean",
        lr: float = 1e-3,
        optimizer: Literal["adam", "sgd"] = "adam",
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        threshold: float = 0.5,
        threshold_grid: tuple[float, ...] | None = DEFAULT_THRESHOLDS,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        trainable: list[SegmentationTrainable] | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        check_finite_positive(owner, "lr", lr, "e.g. 1e-3 for Adam, 0.05 for SGD.")
        _check_choice(owner, "loss", loss, _LOSS_KINDS, "every one is computed per sample.")
        _check_choice(
            owner, "loss_reduction", loss_reduction, _REDUCTIONS, "pass the same value to DPSGD(loss_reduction=...)."
        )
        _check_choice(
            owner,
            "lr_schedule",
            lr_schedule,
            ("constant", "cosine"),
            "'cosine' decays the rate to 0 over the run's optimizer steps.",
        )
        _check_choice(owner, "optimizer", optimizer, ("adam", "sgd"))
        self.grid = _check_thresholds(owner, threshold, threshold_grid)
        groups = _resolve_segmentation_trainable(trainable)
        self.save_hyperparameters()
        self.net = build_segmentation_model(
            arch,
            in_channels=in_channels,
            classes=1,
            encoder=encoder,
            norm=norm,
            spatial_dims=spatial_dims,
            monai_channels=monai_channels,
            monai_res_units=monai_res_units,
        )
        #: The groups trained (``("all",)`` when nothing is given).
        self.trainable: tuple[SegmentationTrainable, ...] = groups
        if "all" not in groups:
            selected = segmentation_trainable_names(self.net, groups)
            if not selected:
                raise PrivacyConfigError(
                    f"`SegmentationModule(arch={arch!r}, trainable={list(groups)!r})`: the selection trains no "
                    "parameter of this network. HINT: choose groups that it has (every network has 'decoder')."
                )
            for name, param in self.net.named_parameters():
                param.requires_grad_(name in selected)
            self.train()  # Lightning keeps each module's mode: the BatchNorm layers must start in eval mode
        self.loss_kind: LossKind = loss
        self.loss_reduction: LossReduction = loss_reduction
        self.register_buffer("threshold", torch.tensor(float(threshold)))
        # One Dice and one IoU per threshold of the grid (or one at the stored threshold without a grid).
        count = max(1, len(self.grid))
        self.val_dice = nn.ModuleList([_dice() for _ in range(count)])
        self.val_iou = nn.ModuleList([_iou() for _ in range(count)])
        self.test_dice = _dice()
        self.test_iou = _iou()

    def train(self, mode: bool = True) -> SegmentationModule:
        super().train(mode)
        if "all" not in getattr(self, "trainable", ("all",)):
            for module in self.net.modules():  # a frozen selection never updates running statistics
                if isinstance(module, nn.modules.batchnorm._NormBase):  # BatchNorm, InstanceNorm with statistics
                    module.eval()
        return self

    def forward(self, x: Tensor) -> Tensor:
        channels = self.hparams.get("in_channels", 3)
        if x.dim() < 3 or x.shape[1] != channels:
            found = f"{x.shape[1]} channel(s)" if x.dim() >= 3 else f"a tensor of shape {tuple(x.shape)}"
            raise PrivacyConfigError(
                f"`SegmentationModule(in_channels={channels})`: expected images of shape (B, {channels}, *spatial), "
                f"found {found}. HINT: set in_channels to your images' channel count (1 for grayscale CT/MRI; in "
                "YAML: model.init_args.in_channels: 1)."
            )
        return self.net(x)

    def _loss(self, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch[0], batch[1]
        logits = self(x)
        return segmentation_loss(logits, y, self.loss_kind, reduction="none"), logits, y

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        losses, _, _ = self._loss(batch)
        self.log("train/loss", losses.detach().mean(), prog_bar=True)
        if self.loss_reduction == "none":
            return losses
        return losses.sum() if self.loss_reduction == "sum" else losses.mean()

    # ---- validation: Dice at every threshold of the grid, the best one kept --------------------------------

    def _val_thresholds(self) -> list[float]:
        return list(self.grid) if self.grid else [float(self.threshold)]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        losses, logits, y = self._loss(batch)
        self.log("val/loss", losses.mean())
        self.update_validation(logits.sigmoid(), y)

    def update_validation(self, probs: Tensor, masks: Tensor) -> None:
        """Adds a batch of probabilities and masks to the Dice and IoU of every threshold."""
        target = (masks > 0.5).long()
        for t, dice, iou in zip(self._val_thresholds(), self.val_dice, self.val_iou):
            pred = (probs > t).long()
            cast(DiceScore, dice).update(pred, target)
            cast(MeanIoU, iou).update(pred, target)

    def compute_validation(self) -> tuple[list[float], Tensor, Tensor]:
        """``(thresholds, dice, iou)``: the validation Dice and IoU at every threshold (NaN without foreground)."""
        dice = torch.stack([cast(DiceScore, m).compute().float().reshape(()) for m in self.val_dice]).cpu()
        iou = torch.stack([cast(MeanIoU, m).compute().float().reshape(()) for m in self.val_iou]).cpu()
        return self._val_thresholds(), dice, iou

    def on_validation_epoch_end(self) -> None:
        thresholds, dice, iou = self.compute_validation()
        for metric in (*self.val_dice, *self.val_iou):
            cast(Metric, metric).reset()
        scores = torch.nan_to_num(dice, nan=-1.0)
        best = int(torch.argmax(scores))  # the lowest threshold among equals
        if self.grid and float(scores[best]) >= 0.0 and not self.trainer.sanity_checking:
            self.threshold.fill_(thresholds[best])
        self.log("val/dice", dice[best], prog_bar=True)
        self.log("val/iou", iou[best])
        self.log("val/threshold", torch.tensor(thresholds[best]))

    # ---- test and predict at the stored threshold -----------------------------------------------------------

    def sample_scores(self, batch: Any) -> Tensor:
        """Each image's Dice at the stored threshold (1.0 when mask and prediction are both empty), in [0, 1].

        What a private search's released score averages per patient (`lightning_dp.tuning.score`).
        """
        pred = (self(batch[0]).sigmoid() > self.threshold).flatten(1).float()
        true = (batch[1] > 0.5).flatten(1).float()
        total = pred.sum(1) + true.sum(1)
        return torch.where(total > 0, 2 * (pred * true).sum(1) / total.clamp_min(1.0), torch.ones_like(total))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        losses, logits, y = self._loss(batch)
        pred = (logits.sigmoid() > self.threshold).long()
        target = (y > 0.5).long()
        self.test_dice.update(pred, target)
        self.test_iou.update(pred, target)
        self.log("test/loss", losses.mean())
        self.log("test/dice", self.test_dice)
        self.log("test/iou", self.test_iou)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """The sigmoid probabilities (B, 1, *spatial) of a batch of images (or of ``(images, …)``)."""
        x = batch if isinstance(batch, Tensor) else batch[0]
        return self(x).sigmoid()

    def configure_optimizers(self) -> Any:
        return configure_optimizers(self)


def _dice() -> DiceScore:
    return DiceScore(num_classes=1, include_background=True, average="macro", input_format="one-hot")


def _iou() -> MeanIoU:
    return MeanIoU(num_classes=1, include_background=True, input_format="one-hot")
