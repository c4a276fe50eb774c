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

`IndependenceCheck` checks one batch; `independence` is the start-up check built on it (the batches it
runs on, the float64 copy or its fallback), which DPSGD (`start_checks`, `check_first_chunk`, with its
refusals: `refuse_cause`, `loss_tensor`) and P3SGD's batched round
(`lightning_dp.training.patient_rounds.independence_reason`) both run.
"""

from __future__ import annotations

import copy
import math
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_dp.errors import PrivacyConfigError
from lightning_dp.sanitization.buffers import BufferSnapshot
from lightning_dp.sanitization.per_sample import LossReduction, PerSampleClipper, UnsupportedModelError
from lightning_dp.training.batches import returned_loss

__all__ = [
    "Cause",
    "Failure",
    "Independence",
    "IndependenceCheck",
    "check_batches",
    "check_first_chunk",
    "collate_is_per_sample",
    "diverse_indices",
    "dropout_off",
    "eval_mode",
    "float64_copy",
    "independence",
    "loss_tensor",
    "public_subsets",
    "readable",
    "refuse_cause",
    "start_checks",
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
#: Samples of the first real chunk that the start-up check also runs on (before the first release).
FIRST_CHUNK_CHECKED = 8


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


def readable(dataset: Any, indices: Iterable[int], limit: int | None = None) -> list[tuple[int, Any]]:
    """``(i, dataset[i])`` for each of ``indices`` whose read does not raise (the first ``limit`` of them, if given).

    The start-up checks read private training items. One unreadable image (a corrupt file) must not stop the start:
    run or no run would tell one bit about that image, and across hospitals it would stop the consortium. An item
    whose read raises is skipped and its error dropped, never shown (its message can quote a path or a value), as a
    site's round drops a failing patient.

    Example:
        >>> readable({0: "a", 2: "c"}, [0, 1, 2])
        [(0, 'a'), (2, 'c')]
    """
    found: list[tuple[int, Any]] = []
    for i in indices:
        if limit is not None and len(found) >= limit:
            break
        try:
            item = dataset[i]
        except Exception:  # noqa: BLE001 - whatever the read raises: the item is skipped, its message unseen
            continue
        found.append((i, item))
    return found


def diverse_indices(dataset: Any, count: int = 8, scan: int = 256, seed: int = PUBLIC_SEED) -> list[int]:
    """Up to ``count`` readable indices whose targets differ as much as possible, from ``scan`` items in a public order.

    Class-weighted losses couple samples only when a batch holds several classes; on a 5 %-positive
    set a handful of fixed samples are all negatives most of the time. Items are visited in an order
    drawn from a fixed public seed and picked round-robin over their target signatures. An item whose read
    raises is skipped (`readable`): fewer than ``count`` come back when fewer of the scanned items can be read.
    """
    n = len(dataset)
    order = np.random.default_rng(seed).permutation(n)[: min(n, scan)].tolist()
    groups: dict[tuple[float, ...], list[int]] = {}
    for i, item in readable(dataset, order):
        groups.setdefault(_target_signature(item), []).append(i)
    picked: list[int] = []
    queues = list(groups.values())
    while len(picked) < min(count, sum(len(queue) for queue in queues)):
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
        #: Batches compared so far (a batch with fewer than two finite samples is passed over, not compared).
        self.compared = 0

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
        # Buffers of every dtype (an int count or a bool flag is a release too) and parameters, frozen or not.
        before = BufferSnapshot(self.module, parameters=True)
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
            self.compared += 1
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


# ---------------------------------------------------------------------- DPSGD's start-up check


def loss_tensor(out: Any, loss_reduction: LossReduction) -> Tensor:
    """The loss in what ``training_step`` returned (a tensor, or ``{'loss': tensor}``), checked for its shape.

    Raises:
        PrivacyConfigError: not a scalar tensor (or, with ``loss_reduction='none'``, not a tensor).
    """
    loss = returned_loss(out)
    if not isinstance(loss, Tensor) or (loss_reduction != "none" and loss.numel() != 1):
        raise PrivacyConfigError(
            f"`DPSGD`: training_step returned {type(out).__name__}, not a "
            f"{'tensor of per-sample losses' if loss_reduction == 'none' else 'scalar loss tensor'}. HINT: "
            "return the batch loss (or {'loss': loss}) from training_step, or per-sample losses with "
            "DPSGD(loss_reduction='none')."
        )
    return loss


def refuse_cause(name: str, cause: Cause | None) -> None:
    """Raises DPSGD's error for a failed check of model ``name`` (nothing when ``cause`` is None).

    Raises:
        UnsupportedModelError: the cause, with what usually causes it and the fix.
    """
    if cause == "buffers":
        raise UnsupportedModelError(
            f"`DPSGD`: a training step of {name} changes buffers of the model (running statistics that are not "
            "BatchNorm's: a custom normalizer, a quantization observer, ActNorm), counts and flags (int and bool "
            "buffers), or parameters outside the gradient step (a weight average or an input mean kept in an "
            "nn.Parameter, frozen or not). They would be released without noise. HINT: freeze them (eval mode, or "
            "compute them from public data before training)."
        )
    if cause == "coupled":
        raise UnsupportedModelError(
            f"`DPSGD`: the gradient of a batch is not the sum of its samples' own gradients: {name} or its loss "
            "couples the samples of a batch, so clipping each sample would not bound its influence. HINT: a loss "
            "reduced over the whole batch divides or aggregates by batch statistics — a class-weighted or "
            "ignore_index mean, a Dice loss over the whole batch (smp's DiceLoss, MONAI's DiceLoss with "
            "batch=True). Compute each sample's loss on that sample alone — for Dice, the Dice of each sample "
            "over its own pixels (MONAI's DiceLoss(batch=False, reduction='none'), reduced per sample) — and "
            "either average them over the batch (loss_reduction='mean') or return the (B,) per-sample losses "
            "with DPSGD(loss_reduction='none') (needed for class-weighted and ignore_index losses); remove "
            "batch-dependent layers (BatchNorm; lightning_dp.models.validate_model lists known ones)."
        )
    if cause == "not_per_sample":
        raise UnsupportedModelError(
            f"`DPSGD`: part of {name}'s gradient is not computed per sample: a parameter is used outside its own "
            "layer (e.g. weight tying through F.linear(x, embedding.weight), or a penalty on the parameters "
            "inside training_step). HINT: use the layer itself (tie by sharing the module), and put weight decay "
            "in the optimizer."
        )


#: What the start-up check found wrong: the collate_fn mixes samples, the loss's reduction is not the declared one
#: (or, where it must be shown, could not be read), one of `IndependenceCheck`'s causes, or nothing could be checked
#: ("unchecked": fewer than two training items could be read, or no batch held two samples with finite losses).
Failure = Literal["collate", "reduction", "coupled", "not_per_sample", "buffers", "unchecked"]


@dataclass
class Independence:
    """What `independence` found.

    Attributes:
        check: the check, kept open (its copy of the model) for a later batch (`check_first_chunk`); None on failure.
        float64: whether the check runs on a float64 copy (False: the model's own dtype; it cannot run in float64).
        failure: what failed (None: everything passed).
        reduction: the reduction the loss showed (``"mean"``, ``"sum"``, or None when it could not be read).
    """

    check: IndependenceCheck | None
    float64: bool
    failure: Failure | None = None
    reduction: Literal["mean", "sum"] | None = None


def check_batches(dataset: Any, rolled_targets: bool = True) -> list[list[Any]]:
    """The items of the batches the start-up check runs on, chosen without looking at private values (see above).

    A batch of items diverse in their targets, random subsets under a public seed, and (``rolled_targets``) the first
    batch with its targets taken from the next item. A batch of one item is doubled.
    An item whose read raises is left out (`readable`). Fewer than two readable items (of a dataset of two or more):
    no batches, and the check cannot run (`independence` says so; it never passes unchecked).
    """
    index_sets = [diverse_indices(dataset), *public_subsets(len(dataset))]
    read = [readable(dataset, ix) for ix in index_sets]
    if len({i for pairs in read for i, _ in pairs}) < min(2, len(dataset)):
        return []
    item_sets = [[item for _, item in pairs] for pairs in read if pairs]
    item_sets = [items if len(items) > 1 else items * 2 for items in item_sets]
    rolled = with_targets_rolled(item_sets[0]) if rolled_targets else None
    if rolled is not None:
        item_sets.append(rolled)
    return item_sets


def independence(
    module: Any,
    share: Iterable[object],
    training_step: Callable[..., Any],
    loss_of: Callable[[Any], Tensor],
    loss_reduction: LossReduction,
    dataset: Any,
    collate: Callable[[list[Any]], Any],
    to_device: Callable[[Any], Any],
    rolled_targets: bool = True,
    trust_declared: bool = True,
) -> Independence:
    """The start-up check that per-sample clipping bounds each sample's influence (DPSGD's, and P3SGD's batched pass).

    ``collate`` must not mix samples; the loss's reduction must be the declared one; the gradient of a batch must be
    the sum of its samples' own gradients, all of it computed per sample; no buffer may change from data. Run on a
    float64 copy of the model over the batches of `check_batches`; a model that cannot run in float64 (a dtype its own
    code fixes: ``x.float()``, fp32 constants) is checked on a copy in its own dtype instead, with a looser tolerance.
    Only pass or fail comes out of it. An item whose read raises is skipped; when fewer than two items can be read,
    or no batch holds two samples with finite losses, nothing was checked and it fails (``"unchecked"``).

    Args:
        module: the model (a copy is checked; ``share`` is referenced by the copy, not copied).
        share: objects the copy keeps (the Trainer the module points to).
        training_step: the module's own ``training_step`` (bound to the module; rebound to the copy).
        loss_of: the loss in what ``training_step`` returns.
        loss_reduction: the declared reduction.
        dataset: the training dataset.
        collate: the training loader's ``collate_fn``.
        to_device: moves a collated batch to the model's device.
        rolled_targets: also check a batch whose targets are rolled by one item (DPSGD).
        trust_declared: a loss whose reduction cannot be read from a sample and its duplicate (a loss of ~0, or
            ``loss_reduction="none"``) passes as declared; False: it fails (P3SGD's batched pass needs it shown).

    Returns:
        What was found; on a pass, the check kept open (close it, or hand it to `check_first_chunk`).

    Raises:
        UnsupportedModelError: the per-sample engine has no rule for a layer of the copy.
    """
    item_sets = check_batches(dataset, rolled_targets)
    if not item_sets:  # too few readable items: nothing is checked, so nothing passes
        return Independence(None, False, "unchecked")
    if not all(collate_is_per_sample(collate, items) for items in item_sets):
        return Independence(None, False, "collate")
    half = any(p.dtype in (torch.float16, torch.bfloat16) for p in module.parameters())
    for float64 in (True, False) if not half else (False,):
        clone = float64_copy(module, share=share, float64=float64)
        tolerance = FLOAT64_TOLERANCE if float64 else HALF_TOLERANCE if half else FLOAT32_TOLERANCE
        check = IndependenceCheck(clone, bind(training_step, clone), loss_of, loss_reduction, tolerance)
        try:
            batches = [(to_device(collate(items)), len(items)) for items in item_sets]
            if float64:
                batches = [(to_float64(b), size) for b, size in batches]
            found = check.declared_reduction(take(batches[0][0], 0, batches[0][1]))
            if (found is not None or not trust_declared) and found != loss_reduction:
                check.close()
                return Independence(None, float64, "reduction", found)
            for batch, size in batches:
                cause = check.check(batch, size)
                if cause is not None:
                    check.close()
                    return Independence(None, float64, cause, found)
            if check.compared == 0:  # every batch was passed over: the model was not checked
                check.close()
                return Independence(None, float64, "unchecked", found)
            return Independence(check, float64, None, found)
        except (RuntimeError, TypeError):  # a dtype the model's own code fixes: retry on a copy in its own dtype
            check.close()
            if not float64:
                raise
        except BaseException:
            check.close()
            raise
    raise AssertionError("unreachable: the last copy either returns or raises")  # pragma: no cover


def start_checks(found: Independence, model_name: str, loss_reduction: LossReduction) -> tuple[IndependenceCheck, bool]:
    """DPSGD's start-up check: what `independence` found, a failure raised as DPSGD's error.

    Run once more on the first real chunk before the first release (`check_first_chunk`).

    Returns:
        The check, kept open for `check_first_chunk`, and whether it runs in float64.

    Raises:
        PrivacyConfigError: the loss's reduction is not the declared one, or nothing could be checked.
        UnsupportedModelError: a check failed (`refuse_cause`), or ``collate`` mixes samples.
    """
    if found.failure == "collate":
        raise UnsupportedModelError(
            "`DPSGD`: the training DataLoader's collate_fn does not collate samples one by one: collating a "
            "batch gives other values for a sample than collating it alone (a batch-level transform such as "
            "MixUp or CutMix mixes samples), so one sample would reach the others' gradients, which "
            "per-sample clipping does not bound. HINT: apply per-sample augmentation in the dataset's "
            "__getitem__ and collate with torch.utils.data.default_collate."
        )
    if found.failure == "unchecked":
        raise PrivacyConfigError(
            "`DPSGD`: the start-up check could not run: fewer than two training samples could be read, or none of "
            "its batches held two samples with a finite loss, so nothing shows that clipping each sample bounds its "
            "influence. HINT: check that the training dataset's items can be read (dataset[i] raises for an "
            "unreadable file) and that the model's loss is finite at its initial weights."
        )
    if found.failure == "reduction":
        raise PrivacyConfigError(
            f"`DPSGD(loss_reduction={loss_reduction!r})`: training_step's loss is the {found.reduction} of the "
            f"per-sample losses, not their {loss_reduction}. HINT: DPSGD(loss_reduction={found.reduction!r})."
        )
    refuse_cause(model_name, found.failure)
    assert found.check is not None
    return found.check, found.float64


def check_first_chunk(check: IndependenceCheck, name: str, chunk: Any, size: int, float64: bool) -> None:
    """The start-up check once more, on the first samples of the first real chunk (before anything is released).

    Closes ``check`` afterwards. ``name`` is the model's class name, for `refuse_cause`.
    """
    try:
        count = min(size, FIRST_CHUNK_CHECKED)
        if count >= 2:
            part = take_range(chunk, 0, count, size)
            refuse_cause(name, check.check(to_float64(part) if float64 else part, count))
    finally:
        check.close()
