"""Start-up checks that per-sample clipping really bounds one sample's influence (plain torch, no Lightning).

Per-sample clipping bounds a sample's influence by C only if the gradient of a batch is the sum of
its samples' own gradients, all of it computed per sample, and nothing else the step changes
depends on the data. A class-weighted or ``ignore_index`` mean, a batch-aggregated Dice loss, a
layer that mixes samples, a batch-level transform in ``collate_fn`` (MixUp, CutMix) or a buffer
updated from the data breaks that. These checks run on a **float64 copy** of the model, so that
fp32 round-off in deep models is not mistaken for coupling (and the real model's buffers are never
touched), over several batches chosen without looking at private values: batches diverse in their
targets from a public-seeded scan of the dataset, random subsets under a public seed, a batch with
its targets permuted, and the first real chunk of the first step. The outcome is one bit: pass, or
an error naming the cause; no value computed from the samples is reported.
"""

from __future__ import annotations

import copy
import math
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_dp.sanitization.buffers import BufferSnapshot
from lightning_dp.sanitization.per_sample import LossReduction, PerSampleClipper

__all__ = [
    "Cause",
    "IndependenceCheck",
    "collate_is_per_sample",
    "diverse_indices",
    "dropout_off",
    "eval_mode",
    "float64_copy",
    "public_subsets",
    "take",
    "take_range",
    "with_targets_rolled",
]

#: Why a check failed: a batch-level coupling in the forward pass, a gradient not computed per sample,
#: a buffer updated from the data, or a loss whose reduction is not the declared one.
Cause = Literal["coupled", "not_per_sample", "buffers"]

#: Relative tolerance of the decomposition checks in float64. Round-off there is ~1e-13; user code that
#: casts back to fp32 (``logits.float()``) adds ~1e-7. A coupling through a batch normalizer moves the
#: gradient by at least the reciprocal of the batch's element count (an ``ignore_index`` pixel among 64k: 1.5e-5).
FLOAT64_TOLERANCE = 1e-6
#: The fallback when the model cannot run in float64: fp32 round-off is up to ~2.4e-3 on a U-Net.
FLOAT32_TOLERANCE = 5e-3
#: Half-precision parameters round by ~1e-3 per weight.
HALF_TOLERANCE = 5e-2
#: The public seed of the checks' sample choice (never the secret sampling seed).
PUBLIC_SEED = 20_190_611


def _batched(t: Tensor, size: int) -> bool:
    return t.dim() > 0 and t.shape[0] == size


def take(batch: Any, i: int, size: int) -> Any:
    """Sample ``i`` of a collated batch of ``size``, as a batch of one (every tensor sliced on dim 0)."""
    return take_range(batch, i, i + 1, size)


def take_range(batch: Any, start: int, stop: int, size: int) -> Any:
    """Samples ``start:stop`` of a collated batch of ``size`` (tensors whose first dimension is ``size``)."""
    return apply_to_collection(batch, Tensor, lambda t: t[start:stop] if _batched(t, size) else t)


def take_indices(batch: Any, indices: Sequence[int], size: int) -> Any:
    """The samples ``indices`` of a collated batch of ``size``, in that order."""
    index = torch.tensor(list(indices), dtype=torch.long)
    return apply_to_collection(batch, Tensor, lambda t: t[index.to(t.device)] if _batched(t, size) else t)


def tensor_leaves(obj: Any) -> list[Tensor]:
    """Every tensor in a nested tuple / list / dict, in order."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for key in obj for t in tensor_leaves(obj[key])]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensor_leaves(item)]
    return []


def to_float64(obj: Any) -> Any:
    """``obj`` with every floating-point tensor cast to float64."""
    return apply_to_collection(obj, Tensor, lambda t: t.double() if t.is_floating_point() else t)


@contextmanager
def dropout_off(module: nn.Module) -> Iterator[None]:
    """Dropout layers in eval mode (their masks differ between runs; nothing else changes)."""
    dropouts = [m for m in module.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training]
    for m in dropouts:
        m.eval()
    try:
        yield
    finally:
        for m in dropouts:
            m.train()


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Every submodule in eval mode; each one's own mode restored afterwards (a frozen part stays frozen)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def float64_copy(module: nn.Module, share: Iterable[object] = (), float64: bool = True) -> nn.Module:
    """A deep copy of ``module`` in float64: parameters, buffers and tensors held as plain attributes.

    Objects in ``share`` (a Trainer the module points to) are referenced, not copied. Forward hooks
    of a `PerSampleClipper` on the original are not carried over. ``float64=False`` keeps the dtypes.
    """
    memo: dict[int, Any] = {id(obj): obj for obj in share}
    clone = copy.deepcopy(module, memo)
    if float64:
        clone.double()
    for sub in clone.modules():
        for name, value in list(vars(sub).items()):
            if (
                float64
                and isinstance(value, Tensor)
                and value.is_floating_point()
                and not isinstance(value, nn.Parameter)
            ):
                setattr(sub, name, value.double())
        for key, hook in list(sub._forward_hooks.items()):
            if "PerSampleClipper" in getattr(hook, "__qualname__", ""):
                del sub._forward_hooks[key]
    return clone


def bind(step: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:
    """``step`` (a method bound to some module) bound to ``module`` instead."""
    function = getattr(step, "__func__", None)
    return types.MethodType(function, module) if function is not None else step


def collate_is_per_sample(collate_fn: Callable[[list[Any]], Any], items: Sequence[Any]) -> bool:
    """Whether ``collate_fn(items)`` holds, sample by sample, exactly what collating each item alone gives.

    False for batch-level transforms (MixUp, CutMix, torchvision's ``v2.MixUp`` in ``collate_fn``):
    there one sample's content reaches other samples of the batch, which per-sample clipping does
    not bound.
    """
    batch = collate_fn(list(items))
    size = len(items)
    for i, item in enumerate(items):
        alone = tensor_leaves(collate_fn([item]))
        sliced = tensor_leaves(take(batch, i, size))
        if len(alone) != len(sliced):
            return False
        for a, b in zip(alone, sliced):
            if a.shape != b.shape or a.dtype != b.dtype or not _same_values(a, b):
                return False
    return True


def _same_values(a: Tensor, b: Tensor) -> bool:
    """Equal element by element, a NaN equal to a NaN (a sample with a NaN pixel is collated as it is)."""
    if torch.equal(a, b):
        return True
    if not a.is_floating_point() or not torch.equal(a.isnan(), b.isnan()):
        return False
    return torch.equal(a.masked_fill(a.isnan(), 0.0), b.masked_fill(b.isnan(), 0.0))


def _target_signature(item: Any) -> tuple[float, ...]:
    """A coarse, public summary of an item's targets (everything but its first tensor): label values, mask fractions."""
    leaves = tensor_leaves(item)[1:]
    signature: list[float] = []
    for t in leaves:
        values = t.detach().double().reshape(-1)
        if values.numel() <= 16:
            signature.extend(round(float(v), 4) for v in values)
        else:  # a mask: how much of it is foreground, in tenths
            signature.append(round(float(values.mean()), 1))
    return tuple(signature)


def diverse_indices(dataset: Any, count: int = 8, scan: int = 256, seed: int = PUBLIC_SEED) -> list[int]:
    """Up to ``count`` indices whose targets differ as much as possible, from ``scan`` items in a public order.

    Class-weighted losses couple samples only when a batch holds several classes; on a 5 %-positive
    set a handful of fixed samples are all negatives most of the time. Items are visited in an order
    drawn from a fixed public seed and picked round-robin over their target signatures.
    """
    n = len(dataset)
    order = np.random.default_rng(seed).permutation(n)[: min(n, scan)].tolist()
    groups: dict[tuple[float, ...], list[int]] = {}
    for i in order:
        groups.setdefault(_target_signature(dataset[i]), []).append(i)
    picked: list[int] = []
    queues = list(groups.values())
    while len(picked) < min(count, len(order)):
        for queue in queues:
            if queue and len(picked) < count:
                picked.append(queue.pop(0))
    return picked


def public_subsets(n: int, count: int = 2, size: int = 6, seed: int = PUBLIC_SEED + 1) -> list[list[int]]:
    """``count`` random subsets of ``range(n)`` of at most ``size`` indices, under a public seed."""
    rng = np.random.default_rng(seed)
    return [sorted(rng.choice(n, size=min(n, size), replace=False).tolist()) for _ in range(count)]


def with_targets_rolled(items: Sequence[Any]) -> list[Any] | None:
    """Items whose targets (every element after the first) are taken from the next item; None if not tuples."""
    if len(items) < 2 or not all(isinstance(it, (tuple, list)) and len(it) >= 2 for it in items):
        return None
    out = []
    for i, item in enumerate(items):
        donor = items[(i + 1) % len(items)]
        out.append(type(item)([item[0], *donor[1:]]) if isinstance(item, list) else (item[0], *donor[1:]))
    return out


class IndependenceCheck:
    """Checks, batch by batch, that one sample's influence on a step is what per-sample clipping bounds.

    Args:
        module: the model to check on (a float64 copy: `float64_copy`); its buffers may change.
        training_step: ``training_step(batch, batch_idx)`` bound to ``module``.
        loss_of: the loss tensor in what ``training_step`` returns.
        loss_reduction: how the returned loss combines per-sample losses (``"none"``: it is the (B,) losses).
        tolerance: relative tolerance of the gradient comparisons.

    Example:
        >>> net = nn.Linear(3, 2).double()
        >>> check = IndependenceCheck(net, lambda b, i: net(b[0]).logsumexp(1).mean(), lambda out: out, "mean")
        >>> check.check((torch.randn(4, 3, dtype=torch.float64),), 4) is None
        True
    """

    def __init__(
        self,
        module: nn.Module,
        training_step: Callable[[Any, int], Any],
        loss_of: Callable[[Any], Tensor],
        loss_reduction: LossReduction,
        tolerance: float = FLOAT64_TOLERANCE,
    ) -> None:
        self.module = module
        self.training_step = training_step
        self.loss_of = loss_of
        self.loss_reduction = loss_reduction
        self.tolerance = tolerance
        self.clipper = PerSampleClipper(module, 1.0, loss_reduction)
        self.clipper.clip_norm = math.inf  # the engine's un-clipped sum: compared with plain autograd

    def close(self) -> None:
        self.clipper.remove()

    def _reduced(self, loss: Tensor, size: int) -> Tensor:
        """The batch loss as the sum of per-sample losses (what per-sample gradients are gradients of)."""
        return loss.sum() * (size if self.loss_reduction == "mean" else 1)

    def _gradient(self, loss: Tensor, params: list[nn.Parameter]) -> Tensor:
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return torch.cat(
            [(torch.zeros_like(p) if g is None else g).reshape(-1).double() for p, g in zip(params, grads)]
        )

    def check(self, batch: Any, size: int) -> Cause | None:
        """None if ``batch`` (``size`` samples) passes; else why not."""
        module, step = self.module, self.training_step
        singles = [take(batch, i, size) for i in range(size)]
        params = [p for p in module.parameters() if p.requires_grad]
        before = BufferSnapshot(self.module)  # every dtype: an int count or a bool flag is a release too
        with dropout_off(module):
            alone_losses = [self._reduced(self.loss_of(step(s, 0)), 1) for s in singles]
            alone_grads = [self._gradient(loss, params) for loss in alone_losses]
            # A sample whose loss or gradient is not finite (a NaN pixel) is dropped by per-sample clipping. Left in,
            # it would make every comparison below NaN, and pass: the check runs on the other samples.
            kept = [
                i
                for i, (loss, grad) in enumerate(zip(alone_losses, alone_grads))
                if math.isfinite(float(loss.detach())) and bool(torch.isfinite(grad).all())
            ]
            if len(kept) < size:
                if len(kept) < 2:
                    return None  # nothing to couple in this batch; the other batches are checked
                batch, size = take_indices(batch, kept, size), len(kept)
                alone_losses = [alone_losses[i] for i in kept]
                alone_grads = [alone_grads[i] for i in kept]
            alone = sum(alone_grads)
            together_loss = self._reduced(self.loss_of(step(batch, 0)), size)
            together = self._gradient(together_loss, params)
            self.clipper.reset()
            self.clipper.accumulate(lambda: self.loss_of(step(batch, 0)), size)
            mine = {id(p): g for p, g in self.clipper.views(self.clipper.flat_sum)}
            engine = torch.cat([mine.get(id(p), torch.zeros_like(p)).reshape(-1).double() for p in params])
            self.clipper.reset()
        if before.changed():
            return "buffers"
        scale = float(alone.norm()) + 1e-30  # type: ignore[union-attr]
        value = sum(float(loss.detach()) for loss in alone_losses)
        value_gap = abs(float(together_loss.detach()) - value)
        if float((together - alone).norm()) > self.tolerance * scale or value_gap > self.tolerance * (
            abs(value) + 1e-30
        ):
            return "coupled"
        if float((engine - alone).norm()) > self.tolerance * scale:
            return "not_per_sample"
        return None

    def declared_reduction(self, single: Any) -> Literal["mean", "sum"] | None:
        """The loss's real reduction ('mean' or 'sum'), read from a sample and its duplicate; None if unclear."""
        doubled = apply_to_collection(single, Tensor, lambda t: torch.cat([t, t]) if _batched(t, 1) else t)
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                one = self.loss_of(self.training_step(single, 0))
                two = self.loss_of(self.training_step(doubled, 0))
        finally:
            self.module.train(was_training)
        if self.loss_reduction == "none" or not (math.isfinite(float(one)) and abs(float(one)) > 1e-6):
            return None
        ratio = float(two) / float(one)
        return "mean" if abs(ratio - 1) < 1e-3 else "sum" if abs(ratio - 2) < 1e-3 else None
