"""Making ordinary models trainable with per-sample gradients.

Per-sample DP-SGD needs every sample's gradient to depend on that sample only. BatchNorm breaks
this (it normalizes with statistics of the whole batch, and its running statistics are an
un-sanitized release of private data), so it is replaced by GroupNorm. In-place activations and
residual additions (``ReLU(inplace=True)``, ``out += identity``) need no change: lightning-dp's
per-sample engine reads output gradients through tensor hooks, which in-place ops do not disturb.

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True))
    >>> [p.problem for p in validate_model(net)]
    ['BatchNorm mixes the samples of a batch and its running statistics are computed from private data']
    >>> fix_model(net, warn=False)
    ['1: BatchNorm2d(8) -> GroupNorm(8, 8)']
    >>> validate_model(net)
    []
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_dp.errors import PrivacyWarning

__all__ = [
    "ModelProblem",
    "batch_norm_layers",
    "fix_model",
    "group_norm_for",
    "is_eval_batch_norm",
    "is_frozen_batch_norm",
    "validate_model",
]

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
_RECURRENT = (nn.RNN, nn.LSTM, nn.GRU)


@dataclass(frozen=True)
class ModelProblem:
    """Something in a model that per-sample DP-SGD cannot train as it is, and how to fix it."""

    name: str
    layer: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.name or '<root>'} ({self.layer}): {self.problem}. FIX: {self.fix}"


def is_eval_batch_norm(module: nn.Module) -> bool:
    """A BatchNorm in eval mode with running statistics: a fixed per-sample affine map that mixes nothing.

    Its statistics never change; its affine weight and bias may be trained (parameter-efficient
    fine-tuning: `lightning_dp.sanitization.rules.BatchNormRule` computes their per-sample gradients).
    Without running statistics (``track_running_stats=False``) a BatchNorm uses the batch's statistics
    in eval mode too, so it is not one.

    Example:
        >>> bn = nn.BatchNorm2d(4).eval()
        >>> is_eval_batch_norm(bn), is_eval_batch_norm(nn.BatchNorm2d(4, track_running_stats=False).eval())
        (True, False)
        >>> is_eval_batch_norm(bn.train())
        False
    """
    return (
        isinstance(module, _BATCH_NORMS)
        and not module.training
        and module.running_mean is not None
        and module.running_var is not None
    )


def is_frozen_batch_norm(module: nn.Module) -> bool:
    """A BatchNorm in eval mode with running statistics and no trainable parameter (see `is_eval_batch_norm`).

    The frozen backbone of the standard DP transfer recipe keeps its public (pre-trained) statistics
    this way; per-sample DP-SGD can train the layers around it as they are.

    Example:
        >>> bn = nn.BatchNorm2d(4).eval().requires_grad_(False)
        >>> is_frozen_batch_norm(bn), is_frozen_batch_norm(bn.train())
        (True, False)
    """
    return is_eval_batch_norm(module) and not any(p.requires_grad for p in module.parameters(recurse=False))


def batch_norm_layers(module: nn.Module, include_frozen: bool = True, include_eval: bool = True) -> list[str]:
    """The qualified names of ``module``'s BatchNorm layers.

    Args:
        module: the model.
        include_frozen: False leaves out the frozen ones (`is_frozen_batch_norm`).
        include_eval: False leaves out every one in eval mode with running statistics, frozen or with a
            trainable affine (`is_eval_batch_norm`): what remains mixes the samples of a batch.
    """
    return [
        name
        for name, sub in module.named_modules()
        if isinstance(sub, _BATCH_NORMS)
        and (include_frozen or not is_frozen_batch_norm(sub))
        and (include_eval or not is_eval_batch_norm(sub))
    ]


def group_norm_for(num_channels: int, max_groups: int = 32, **kwargs: Any) -> nn.GroupNorm:
    """GroupNorm with the largest divisor of ``num_channels`` that is ≤ ``max_groups`` as the group count.

    Example:
        >>> group_norm_for(64).num_groups, group_norm_for(24).num_groups, group_norm_for(144).num_groups
        (32, 24, 24)
    """
    groups = max(d for d in range(1, min(num_channels, max_groups) + 1) if num_channels % d == 0)
    return nn.GroupNorm(groups, num_channels, **kwargs)


def _is_windowed_attention(module: nn.Module) -> bool:
    """A Swin transformer's window attention (MONAI's): it runs on images × windows rows, never per image."""
    kind = type(module)
    return kind.__name__ == "WindowAttention" and kind.__module__.startswith("monai.")


def validate_model(module: nn.Module) -> list[ModelProblem]:
    """Lists what stops ``module`` from being trained with per-sample gradients; empty if nothing does.

    Checks: BatchNorm layers (one in eval mode with running statistics is fine, frozen or with a
    trainable affine: it mixes nothing and its statistics do not change); InstanceNorm with running
    statistics; recurrent layers (use Opacus' ``DPLSTM``/``DPGRU``/``DPRNN``); trainable parameters
    that do not belong to a layer whose per-sample gradient can be computed
    (`lightning_dp.sanitization.rules.rule_problem`, the answer `PerSampleClipper` gets too).

    Example:
        >>> up = nn.Sequential(nn.ConvTranspose2d(8, 4, 3, stride=2), nn.InstanceNorm2d(4, affine=True), nn.PReLU())
        >>> validate_model(up)  # each layer has a per-sample rule
        []
    """
    from lightning_dp.sanitization.per_sample import parameters_next_to_children, trainable_layers
    from lightning_dp.sanitization.rules import rule_problem

    problems: list[ModelProblem] = []
    windowed: set[int] = set()
    for name, sub in module.named_modules():
        kind = type(sub).__name__
        if isinstance(sub, _BATCH_NORMS) and not is_eval_batch_norm(sub):
            problems.append(
                ModelProblem(
                    name,
                    kind,
                    "BatchNorm mixes the samples of a batch and its running statistics are computed from private data",
                    "lightning_dp.models.fix_model(model) replaces it by GroupNorm (DPSGD does so, with a warning)",
                )
            )
        elif isinstance(sub, _INSTANCE_NORMS) and sub.track_running_stats:
            problems.append(
                ModelProblem(
                    name,
                    kind,
                    "its running statistics are computed from private data and released un-sanitized",
                    "construct it with track_running_stats=False",
                )
            )
        elif isinstance(sub, _RECURRENT) and any(p.requires_grad for p in sub.parameters()):
            problems.append(
                ModelProblem(
                    name,
                    kind,
                    "per-sample gradients of torch's fused recurrent layers cannot be computed",
                    f"use opacus.layers.DP{kind} (a drop-in replacement) or freeze the layer",
                )
            )
        elif _is_windowed_attention(sub):
            windowed.add(id(sub))
            problems.append(
                ModelProblem(
                    name,
                    kind,
                    "it folds each image's attention windows into the batch dimension, so the layers inside it see "
                    "images × windows rows and no gradient can be attributed to one image: per-sample DP-SGD does "
                    "not support Swin transformers (MONAI's SwinUNETR, SwinTransformer), and freezing these layers "
                    "would freeze all of its attention",
                    "train this model with lightning_dp.callbacks.P3SGD (patient-level DP: it needs no per-sample "
                    "gradients, any model works), or use MONAI's UNETR (freeze its position_embeddings) or UNet "
                    "with DPSGD",
                )
            )
    for name, sub, params, nested in parameters_next_to_children(module):
        if id(sub) in windowed:
            continue
        full = [p if sub is module else f"{name}.{p}" for p in params]
        freeze = "; ".join(f"model.get_parameter({n!r}).requires_grad_(False)" for n in full[:3])
        problems.append(
            ModelProblem(
                name,
                type(sub).__name__,
                f"it holds trainable parameters {params} next to sub-modules with their own parameters "
                f"({nested[:3]}), so their per-sample gradients cannot be computed",
                f"freeze them ({freeze}{'; ...' if len(full) > 3 else ''}): this works on a library's class (MONAI's "
                "UNETR position_embeddings, for one), and they keep their initial or pre-trained values; in a class "
                "of your own you can instead move them into a small nn.Module of their own (whose forward uses them)",
            )
        )
    for name, sub in trainable_layers(module, strict=False):
        if isinstance(sub, (*_BATCH_NORMS, *_RECURRENT)):
            continue
        problem = rule_problem(sub)  # the same answer PerSampleClipper gets from rule_for
        if problem is not None:
            kind = type(sub).__name__
            problems.append(
                ModelProblem(
                    name,
                    kind,
                    f"it {problem}",
                    "freeze it, replace it with standard layers, or register a per-sample rule for its type "
                    f"(lightning_dp.sanitization.rules.register_rule({kind}, rule), or an Opacus grad sampler)",
                )
            )
    return problems


def fix_model(module: nn.Module, warn: bool = True, keep_frozen: bool = True, keep_eval: bool = False) -> list[str]:
    """Replaces the BatchNorm layers of ``module`` by GroupNorm, in place, and returns what changed.

    The GroupNorm keeps the BatchNorm's affine weight and bias, eps, device and dtype. For
    BatchNorm2d/3d the number of groups is the largest divisor of the channel count ≤ 32; a
    BatchNorm1d becomes GroupNorm(1, C), a LayerNorm over the features (its input is usually a
    feature vector, where groups of one value would always normalize to 0). The parameters of the
    model change, so call this *before* creating optimizers (the DPSGD callback does it in
    ``setup``, before Lightning calls ``configure_optimizers``).

    Args:
        module: the model; modified in place.
        warn: emit a `PrivacyWarning` listing the replacements.
        keep_frozen: keep frozen BatchNorm layers (eval mode, no trainable parameter; `is_frozen_batch_norm`):
            they mix nothing, and replacing them would throw away their pre-trained statistics.
        keep_eval: also keep the BatchNorm layers in eval mode whose affine is trained (`is_eval_batch_norm`;
            per-sample DP-SGD trains their weight and bias with `BatchNormRule`). Only if they stay in eval mode:
            DPSGD checks that at every step.

    Returns:
        One line per replaced layer, ``"name: BatchNorm2d(C) -> GroupNorm(G, C)"``.
    """
    changes: list[str] = []
    for parent_name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, _BATCH_NORMS) or (keep_frozen and is_frozen_batch_norm(child)):
                continue
            if keep_eval and is_eval_batch_norm(child):
                continue
            affine = child.affine and child.weight is not None and child.bias is not None
            like = child.weight if affine else next(iter(child.buffers()), None)
            factory: dict[str, Any] = {} if like is None else {"device": like.device, "dtype": like.dtype}
            # BatchNorm1d usually normalizes feature vectors: a group of one value would always be 0.
            max_groups = 1 if isinstance(child, nn.BatchNorm1d) else 32
            replacement = group_norm_for(child.num_features, max_groups, eps=child.eps, affine=affine, **factory)
            if affine:
                with torch.no_grad():
                    replacement.weight.copy_(child.weight)
                    replacement.bias.copy_(child.bias)
                replacement.weight.requires_grad_(child.weight.requires_grad)
                replacement.bias.requires_grad_(child.bias.requires_grad)
            setattr(parent, child_name, replacement)
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            changes.append(
                f"{full}: {type(child).__name__}({child.num_features}) -> "
                f"GroupNorm({replacement.num_groups}, {child.num_features})"
            )
    if changes and warn:
        shown = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
        warnings.warn(
            f"lightning-dp replaced {len(changes)} BatchNorm layer(s) by GroupNorm for per-sample DP-SGD: {shown}. "
            "BatchNorm mixes samples and releases private running statistics. HINT: build the model with GroupNorm "
            "(e.g. ImageClassifier(norm='group')) so that its checkpoints load without this conversion.",
            PrivacyWarning,
            stacklevel=2,
        )
    return changes
