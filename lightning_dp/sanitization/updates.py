"""Model updates as flat fp32 vectors, and per-unit clipping.

What a P3SGD round releases is the change of everything in the model that training changes: all
trainable parameters *and* the running statistics of normalization layers in training mode
(BatchNorm, InstanceNorm with ``track_running_stats``), plus any buffer the user names. They go
through the same clipping and noise. Every other buffer — integer buffers (``num_batches_tracked``),
the buffers of modules in eval mode (a frozen backbone), and constants such as an input-normalization
mean, a pruning mask or a spectral-norm vector — is restored after each unit's local update, and so is
every frozen parameter (``requires_grad=False``: a weight average or a running input mean that ``training_step``
keeps in a frozen ``nn.Parameter`` is as much a release as a buffer): no statistic of private data leaves
un-sanitized, and no constant drifts with the noise.

A released running variance is noised like everything else, so it can come out near zero or negative. What
is loaded into the buffer is floored at a public ``variance_floor`` (a fraction of the variance the module had
when `ModelState` was built: 1 for a fresh BatchNorm, the pre-trained value otherwise). The floor is
post-processing of the noised release: the clipped update, the noise drawn and ε are unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from lightning_dp.errors import PrivacyConfigError, check_in_interval
from lightning_dp.sanitization.buffers import reseat, reseat_parameters

__all__ = ["ClipResult", "ModelState", "clip_factor", "clip_update"]


class ModelState:
    """The released tensors of a module as one flat fp32 vector.

    Released: the trainable parameters, the running statistics of normalization layers in training
    mode, and the float buffers named in ``release_buffers``, as they are when `refresh` is called (at
    the start of every round). All other buffers and the frozen parameters are kept aside and restored by `load`.

    Args:
        module: the model.
        release_buffers: qualified names of further float buffers that training updates and that are
            to be released (clipped and noised) with the parameters; every other buffer is restored.
        variance_floor: f in [0, 1]. Every running variance loaded by `load` is at least f·v₀, per channel, with
            v₀ the running variance of that normalization layer when this `ModelState` is built (a public value:
            the initial or pre-trained model; a channel whose v₀ is not a finite number > 0 uses v₀ = 1). The
            floor is post-processing of the noised release: it changes neither the clipped update nor the
            noise nor ε, only what the buffer holds afterwards (and therefore θ of the next round). Without it
            (f = 0, variances only clamped at 0) a noised variance near 0 makes evaluation divide by √eps
            (×316 per BatchNorm layer) and a deep network's outputs overflow to inf and NaN. The cost: a channel
            whose true variance is below f·v₀ is under-scaled at evaluation by at most √(true / (f·v₀)).

    Example:
        >>> net = nn.BatchNorm1d(2)
        >>> state = ModelState(net)
        >>> state.numel  # weight, bias, running_mean, running_var
        8
        >>> state.refresh() or ModelState(net.eval()).numel  # in eval mode its statistics are not trained
        4
        >>> state = ModelState(net.train(), variance_floor=0.1)
        >>> state.load(torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, -3.0]))  # noise drove a variance below zero
        >>> net.running_var.tolist()
        [0.5, 0.10000000149011612]
    """

    def __init__(self, module: nn.Module, release_buffers: Sequence[str] = (), variance_floor: float = 0.0) -> None:
        variance_floor = check_in_interval(
            "ModelState",
            "variance_floor",
            variance_floor,
            0.0,
            1.0,
            low_closed=True,
            high_closed=True,
            hint="0.1 floors every released running variance at 10 % of its initial value.",
        )
        self.module = module
        named = dict(module.named_buffers())
        for name in release_buffers:
            if name not in named or not named[name].is_floating_point():
                found = "no such buffer" if name not in named else f"a {named[name].dtype} buffer"
                raise PrivacyConfigError(
                    f"`release_buffers=[{name!r}]`: {name!r} must name a floating-point buffer of "
                    f"{type(module).__name__}, found {found}. HINT: the names are those of "
                    f"module.named_buffers(), e.g. {list(named)[:3]}."
                )
        self.release_buffers = tuple(release_buffers)
        self.variance_floor = variance_floor
        # Public floors, per normalization layer (by qualified name: moving a module to a device replaces its
        # buffers), computed once from the variances the module starts with.
        self._floors: dict[str, Tensor] = {}
        self._workspaces: dict[str, Tensor] = {}
        for name, m in module.named_modules():
            if isinstance(m, _NormBase) and m.running_var is not None:
                v0 = m.running_var.detach().double().cpu()
                v0 = torch.where(torch.isfinite(v0) & (v0 > 0), v0, torch.ones_like(v0))
                self._floors[name] = (self.variance_floor * v0).float()
        self.refresh()

    def refresh(self) -> None:
        """Re-reads which tensors are released (requires_grad and train/eval modes can change)."""
        module = self.module
        named_norms = [
            (name, m)
            for name, m in module.named_modules()
            if isinstance(m, _NormBase) and m.training and m.track_running_stats
        ]
        norms = [m for _, m in named_norms]
        self.variances = [m.running_var for m in norms if m.running_var is not None]
        #: (running variance, its floor) for every released variance; the floor lives on the buffer's device.
        self.variance_floors: list[tuple[Tensor, Tensor]] = []
        for name, m in named_norms:
            var = m.running_var
            if var is None:
                continue
            floor = self._floors.get(name)
            if floor is None or floor.shape != var.shape:  # a layer added or resized after construction
                floor = torch.zeros(var.shape)
            self.variance_floors.append((var, floor.to(device=var.device, dtype=var.dtype)))
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._param_names = list(module.named_parameters())
        statistics = {id(t) for m in norms for t in (m.running_mean, m.running_var) if t is not None}
        named = dict(module.named_buffers())  # one name per tensor
        statistics |= {id(named[name]) for name in self.release_buffers}
        self._buffer_names = list(named.items())
        self._float_names = [n for n, b in named.items() if b.is_floating_point() and id(b) in statistics]
        self.float_buffers = [named[n] for n in self._float_names]
        released = {id(b) for b in self.float_buffers}
        #: What `load` restores: the buffers that are not released and the frozen parameters.
        self.other_buffers = [b for b in named.values() if id(b) not in released] + [
            p for p in module.parameters() if not p.requires_grad
        ]
        self.numel = sum(t.numel() for t in self._released())

    @property
    def float_buffer_names(self) -> list[str]:
        """The qualified names of the released float buffers (running statistics, ``release_buffers``)."""
        return list(self._float_names)

    def _released(self) -> list[Tensor]:
        return self.params + self.float_buffers

    def _released_now(self) -> list[Tensor]:
        """The released tensors as the module holds them now: a local update may have re-assigned a buffer."""
        now = dict(self.module.named_buffers())
        return self.params + [now.get(n, b) for n, b in zip(self._float_names, self.float_buffers)]

    @torch.no_grad()
    def vector(self, out: Tensor | None = None) -> Tensor:
        """A detached fp32 copy of the released tensors, concatenated (into ``out`` if given, e.g. a `workspace`)."""
        parts = [t.detach().reshape(-1).float() for t in self._released()]
        return torch.cat(parts) if out is None else torch.cat(parts, out=out)

    def workspace(self, name: str) -> Tensor:
        """A fp32 vector of `numel` values on the released tensors' device, kept for the next call with ``name``.

        A round needs a few model-sized vectors (θ_t, the clipped sum, one unit's change). Allocated afresh
        every round, each costs the kernel's page faults again (18 ms for ResNet-18's 11 M values on a 2-core
        CPU, against 1.5 ms to overwrite one kept). What a workspace holds is not cleared by this call: the
        caller overwrites it, and clears what must not outlive the round with `wipe_workspaces`.
        """
        released = self._released()
        device = released[0].device if released else torch.device("cpu")
        kept = self._workspaces.get(name)
        if kept is None or kept.numel() != self.numel or kept.device != device:
            kept = self._workspaces[name] = torch.zeros(self.numel, dtype=torch.float32, device=device)
        return kept

    @torch.no_grad()
    def wipe_workspaces(self) -> None:
        """Zeroes every workspace: a unit's raw change and the un-noised clipped sum do not outlive their round."""
        for kept in self._workspaces.values():
            kept.zero_()

    def drop_workspaces(self) -> None:
        """Frees every workspace (at the end of a fit: no model-sized vectors held on the device for nothing)."""
        self._workspaces.clear()

    @torch.no_grad()
    def add_clipped_change(self, theta: Tensor, out: Tensor, clip_norm: float) -> tuple[float, bool, bool]:
        """Adds clip_C(current − ``theta``) to ``out``, tensor by tensor (the change goes through a kept workspace).

        Returns (norm of the change, whether it was clipped, whether it was finite). A non-finite
        change adds nothing.
        """
        change = self.workspace("change")
        if theta.dtype != torch.float32 or theta.device != change.device:  # not a `vector()`: a change of its own
            change = torch.empty(theta.numel(), dtype=torch.float32, device=theta.device)
        triples = []
        offset = 0
        for t in self._released_now():
            n = t.numel()
            before = theta[offset : offset + n]
            diff = torch.sub(t.detach().reshape(-1), before, out=change[offset : offset + n])
            triples.append((t.detach().reshape(-1), before, diff, out[offset : offset + n]))
            offset += n
        norms = [torch.linalg.vector_norm(d) for _, _, d, _ in triples]
        parts = torch.stack(norms).double().square().tolist() if norms else []
        sq = 0.0
        wide = []  # tensors whose change (or its norm) overflows fp32: computed in float64
        for (current, before, _, _), part in zip(triples, parts):
            wide.append(not math.isfinite(part))
            if wide[-1]:  # a finite change whose difference or square overflowed fp32
                part = float(torch.dist(current.double(), before.double())) ** 2
            sq += part
        norm = math.sqrt(sq)
        scale, clipped, finite = clip_factor(norm, clip_norm)
        if finite:
            for (current, before, diff, target), in_float64 in zip(triples, wide):
                if in_float64:  # scaled before it is rounded to fp32: 3e38 − (−3e38) is inf in fp32
                    target.add_(((current.double() - before.double()) * scale).to(target.dtype))
                else:
                    target.add_(diff, alpha=scale)
        return (norm if finite else math.inf), clipped, finite

    @torch.no_grad()
    def snapshot_other_buffers(self) -> list[Tensor]:
        """Copies of the tensors `load` restores (the buffers that are not released, the frozen parameters)."""
        return [b.detach().clone() for b in self.other_buffers]

    @torch.no_grad()
    def load(
        self,
        vector: Tensor,
        other_buffers: list[Tensor] | None = None,
        *,
        add: Tensor | None = None,
        alpha: float = 1.0,
    ) -> None:
        """Writes ``vector`` (plus ``alpha``·``add`` if given) back into the module's tensors, cast to their dtypes.

        With ``add``, ``vector + alpha·add`` is written tensor by tensor, with no model-sized temporary.

        A buffer or parameter re-assigned since `refresh` (``self.count = self.count + …`` in ``training_step``) gets
        its original tensor back, and one registered since is removed: the module holds no tensor a patient's data
        made. ``other_buffers`` (from `snapshot_other_buffers`) are copied back, every one: a write through ``.data``
        (``self.ema.data.mul_(…)``) bumps no version counter, so nothing short of a copy (or a comparison) sees it.
        """
        reseat(self.module, self._buffer_names, remove_others=True)
        reseat_parameters(self.module, self._param_names)
        offset = 0
        for t in self._released():
            n = t.numel()
            source = vector[offset : offset + n].view_as(t)
            if add is None:
                t.copy_(source.to(t.dtype))
            else:
                extra = add[offset : offset + n].view_as(t)
                same = t.dtype == source.dtype == extra.dtype and t.device == source.device == extra.device
                if same and t.is_contiguous():
                    torch.add(source, extra, alpha=alpha, out=t)
                else:
                    t.copy_(torch.add(source, extra, alpha=alpha).to(t.dtype))
            offset += n
        if other_buffers is not None:
            for b, saved in zip(self.other_buffers, other_buffers):
                b.copy_(saved)
        # Noise can push a running variance to zero or below; flooring it is post-processing (costs no privacy).
        # A NaN variance (only a NaN in the model itself can put one there) becomes the floor as well.
        for var, floor in self.variance_floors:
            torch.where(var >= floor, var, floor, out=var)


@dataclass(frozen=True)
class ClipResult:
    """A clipped update and what clipping saw (for logging: these are not released)."""

    update: Tensor
    norm: float
    clipped: bool
    finite: bool


def clip_update(update: Tensor, clip_norm: float) -> ClipResult:
    """Scales ``update`` to L2 norm at most ``clip_norm``; a non-finite update becomes zero.

    The update is fp32 (or wider) whatever the model's precision; its norm is computed in float64.

    Example:
        >>> r = clip_update(torch.tensor([3.0, 4.0]), clip_norm=1.0)
        >>> r.update.tolist(), r.norm, r.clipped
        ([0.6000000238418579, 0.800000011920929], 5.0, True)
        >>> clip_update(torch.tensor([float("nan"), 1.0]), 1.0).update.tolist()
        [0.0, 0.0]
    """
    update = update.float() if update.dtype in (torch.float16, torch.bfloat16) else update
    # In float64: the norm of a finite fp32 vector can overflow fp32 (e.g. an entry of 2e19).
    value = float(torch.linalg.vector_norm(update, dtype=torch.float64))
    scale, clipped, finite = clip_factor(value, clip_norm)
    if not finite:
        return ClipResult(torch.zeros_like(update), float("inf"), True, False)
    return ClipResult(update * scale, value, clipped, True)


_FP32_TINY = float(torch.finfo(torch.float32).tiny)


def clip_factor(norm: float, clip_norm: float) -> tuple[float, bool, bool]:
    """(min(1, C/norm), norm > C, kept): the factor that clips an update of L2 norm ``norm`` to C.

    The factor is 0 and the update dropped for a non-finite norm and for a factor below the smallest
    normal fp32 number (fp32 arithmetic would round it up).

    Example:
        >>> clip_factor(5.0, 1.0), clip_factor(0.5, 1.0), clip_factor(float("nan"), 1.0)
        ((0.2, True, True), (1.0, False, True), (0.0, True, False))
    """
    if not math.isfinite(norm):
        return 0.0, True, False
    factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    if factor < _FP32_TINY:  # fp32 arithmetic would round such a factor up: drop the update instead
        return 0.0, True, False
    return factor, norm > clip_norm, True
