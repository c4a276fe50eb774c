"""Per-sample gradient clipping in one forward and one backward pass.

DP-SGD needs Σ_i clip_C(g_i), the sum of per-sample gradients each scaled to L2 norm ≤ C.
`PerSampleClipper` computes it without ever letting autograd build the un-clipped weight gradient:

* During the forward pass the trainable parameters are detached from the graph. A forward hook on
  every trainable layer keeps the layer's input and registers a *tensor* hook on its output.
* The backward pass then computes activation gradients only; the tensor hooks hand each layer its
  output gradient. (Tensor hooks still see the gradient of the value the layer produced when a
  later in-place op such as ResNet's ``out += identity`` or ``ReLU(inplace=True)`` changes the
  tensor. Opacus' module backward hooks fail there, Opacus issue #828.)
* Each sample's squared gradient norm is summed layer by layer. For Linear and Conv layers it is
  computed by the *ghost norm* identity ‖Σ_t g_t a_tᵀ‖² = Σ_{t,s} (a_t·a_s)(g_t·g_s) when the layer's
  spatial extent T is small, or from the materialized per-sample gradients when that is cheaper
  (Li et al. 2022; Bu et al. 2023, "mixed ghost clipping"). Other layers (GroupNorm, LayerNorm,
  embeddings, ...) use Opacus' registered per-layer grad samplers, and layers Opacus has no sampler
  for use its functorch fallback.
* With the clip coefficients c_i = min(1, C/‖g_i‖) the clipped sum of each layer is one weight
  gradient computed from the c-weighted output gradients ("book-keeping", Bu et al. 2023).

A sample whose gradient norm is not finite gets c_i = 0: its contribution is dropped (and counted),
never propagated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.errors import PrivacyConfigError, check_finite_positive

__all__ = [
    "ClipStats",
    "LossReduction",
    "NonFiniteGradientsError",
    "PerSampleClipper",
    "UnsupportedModelError",
    "check_loss_reduction",
    "clip_coefficients",
    "parameters_next_to_children",
    "trainable_layers",
]

LossReduction = Literal["mean", "sum", "none"]

_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def check_loss_reduction(owner: str, value: Any) -> LossReduction:
    """Returns ``value`` if it is 'mean', 'sum' or 'none', else raises `PrivacyConfigError`."""
    if value not in ("mean", "sum", "none"):
        raise PrivacyConfigError(
            f"`{owner}(loss_reduction={value!r})`: loss_reduction must be 'mean', 'sum' or 'none', found {value!r}. "
            "HINT: 'mean' if the loss averages the per-sample losses over the batch (the default of "
            "torch.nn.functional.cross_entropy), 'sum' if it adds them, 'none' if it returns one loss per sample."
        )
    return value


class UnsupportedModelError(PrivacyConfigError):
    """The model has a part whose per-sample gradients cannot be computed."""


class NonFiniteGradientsError(ArithmeticError):
    """Some per-sample gradients were not finite and the caller asked to be told (nothing was added)."""


def _opacus_grad_samplers() -> dict[type, Callable[..., dict[nn.Parameter, Tensor]]]:
    from opacus.grad_sample import GradSampleModule

    return dict(GradSampleModule.GRAD_SAMPLERS)


def _direct_trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def parameters_next_to_children(module: nn.Module) -> list[tuple[str, nn.Module, list[str], list[str]]]:
    """Modules holding trainable parameters *and* children with trainable parameters (other than Linear/Conv).

    Their parameters are used somewhere in their forward, outside any layer, so no per-sample rule
    applies (for example a LightningModule with its own ``nn.Parameter``). Returns
    (name, module, its parameter names, the parameterized children's names) for each.
    """
    found = []
    for name, sub in module.named_modules():
        if not _direct_trainable(sub) or isinstance(sub, (*_CONV_TYPES, nn.Linear)):
            continue
        nested = [n for n, child in sub.named_modules() if child is not sub and _direct_trainable(child)]
        if nested:
            params = [n for n, p in sub.named_parameters(recurse=False) if p.requires_grad]
            found.append((name or type(sub).__name__, sub, params, nested))
    return found


def trainable_layers(module: nn.Module, strict: bool = True) -> list[tuple[str, nn.Module]]:
    """The modules whose own parameters are trained, as (qualified name, module).

    With ``strict`` a module found by `parameters_next_to_children` raises `UnsupportedModelError`
    naming it; otherwise it is left out.
    """
    mixed = parameters_next_to_children(module)
    if mixed and strict:
        name, sub, params, nested = mixed[0]
        raise UnsupportedModelError(
            f"`{name}` ({type(sub).__name__}) holds trainable parameters {params} next to sub-modules with their own "
            f"parameters ({nested[:3]}), so their per-sample gradients cannot be computed. HINT: move the parameters "
            "into a small nn.Module of their own (whose forward uses them), or freeze them (requires_grad=False)."
        )
    excluded = {id(sub) for _, sub, _, _ in mixed}
    return [(n, sub) for n, sub in module.named_modules() if _direct_trainable(sub) and id(sub) not in excluded]


@dataclass
class _Record:
    """One call of a layer in the forward pass."""

    activation: Tensor
    version: int
    backprops: Tensor | None = None


@dataclass
class _Layer:
    name: str
    module: nn.Module
    params: list[nn.Parameter]
    kind: Literal["linear", "conv", "generic"]
    records: list[_Record] = field(default_factory=list)


@dataclass(frozen=True)
class ClipStats:
    """What clipping saw in one batch. Computed from private data: not sanitized, not for logging by default."""

    batch_size: int
    clipped: int
    norm_sum: float
    nonfinite: int


class PerSampleClipper:
    """Accumulates Σ_i min(1, C/‖g_i‖)·g_i over batches, one forward and one backward pass per batch.

    g_i is the gradient of sample i's own loss with respect to all trainable parameters of
    ``module``. The loss the model returns must be a sum or a mean over the batch of per-sample
    losses, each depending on its own sample only (no BatchNorm in training mode).

    Args:
        module: the model (its trainable layers are found once, here).
        clip_norm: C, the per-sample L2 bound.
        loss_reduction: how the returned loss combines the per-sample losses of a batch.

    Raises:
        UnsupportedModelError: a trainable parameter is not inside a layer whose per-sample
            gradient can be computed.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> net = nn.Linear(3, 1)
        >>> clipper = PerSampleClipper(net, clip_norm=1.0, loss_reduction="sum")
        >>> x = torch.randn(4, 3)
        >>> stats = clipper.accumulate(lambda: net(x).sum(), batch_size=4)
        >>> stats.batch_size, bool(clipper.flat_sum.norm() <= 4.0)
        (4, True)
    """

    def __init__(self, module: nn.Module, clip_norm: float, loss_reduction: LossReduction = "mean") -> None:
        self.clip_norm = check_finite_positive("PerSampleClipper", "clip_norm", clip_norm, "e.g. 1.0.")
        self.loss_reduction: LossReduction = check_loss_reduction("PerSampleClipper", loss_reduction)
        samplers = _opacus_grad_samplers()
        self.layers: list[_Layer] = []
        for name, sub in trainable_layers(module):
            if isinstance(sub, nn.Linear):
                kind: Literal["linear", "conv", "generic"] = "linear"
            elif isinstance(sub, _CONV_TYPES):
                kind = "conv"
            else:
                kind = "generic"
                if type(sub) not in samplers:
                    _prepare_functorch(name, sub)
            self.layers.append(_Layer(name, sub, _direct_trainable(sub), kind))
        self._samplers = samplers
        self.params = list({id(p): p for layer in self.layers for p in layer.params}.values())
        self._groups = _tied_groups(self.layers)
        if not self.params:
            raise UnsupportedModelError(
                f"`PerSampleClipper`: {type(module).__name__} has no trainable parameters. HINT: check requires_grad."
            )
        self.numel = sum(p.numel() for p in self.params)
        self._flat_sum: Tensor | None = None
        self._sum_views: dict[nn.Parameter, Tensor] = {}
        self._recording = False
        self._handles = [layer.module.register_forward_hook(self._forward_hook(layer)) for layer in self.layers]

    # ------------------------------------------------------------------ hooks
    def _forward_hook(self, layer: _Layer) -> Callable[..., Any]:
        def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
            if not self._recording:
                return None
            if not isinstance(output, Tensor) or not inputs or not isinstance(inputs[0], Tensor):
                raise UnsupportedModelError(
                    f"`{layer.name}` ({type(module).__name__}) must take a tensor and return a tensor to get "
                    f"per-sample gradients, found input {type(inputs[0]).__name__ if inputs else None} and output "
                    f"{type(output).__name__}. HINT: freeze this layer or replace it."
                )
            activation = inputs[0].detach()
            record = _Record(activation, activation._version)
            layer.records.append(record)
            replaced = None
            if not output.requires_grad:
                # Nothing upstream is trained: make the output a non-leaf that requires grad, so that the
                # backward pass reaches it and later in-place ops on it stay legal.
                replaced = output.detach().requires_grad_(True).clone()
                output = replaced

            def grad_hook(grad: Tensor) -> None:
                record.backprops = grad.detach()

            output.register_hook(grad_hook)
            return replaced

        return hook

    def remove(self) -> None:
        """Removes the forward hooks (the clipper cannot be used afterwards)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextmanager
    def _record(self) -> Iterator[None]:
        before = [p.requires_grad for p in self.params]
        for p in self.params:
            p.requires_grad_(False)
        self._recording = True
        try:
            yield
        finally:
            self._recording = False
            for p, flag in zip(self.params, before):
                p.requires_grad_(flag)

    # ------------------------------------------------------------------ the clipped sum
    @property
    def flat_sum(self) -> Tensor:
        """Σ_i clip(g_i) since the last `reset`, all parameters concatenated (fp32, or fp64 for a fp64 model).

        Allocated on the parameters' device when first used (a Trainer moves the model after setup).
        """
        first = self.params[0]
        dtype = torch.promote_types(first.dtype, torch.float32)
        if self._flat_sum is None or self._flat_sum.device != first.device or self._flat_sum.dtype != dtype:
            self._flat_sum = torch.zeros(self.numel, dtype=dtype, device=first.device)
            self._sum_views = dict(self.views(self._flat_sum))
        return self._flat_sum

    def views(self, flat: Tensor) -> list[tuple[nn.Parameter, Tensor]]:
        """Each trainable parameter with its slice of a flat vector laid out like `flat_sum`."""
        out, offset = [], 0
        for p in self.params:
            out.append((p, flat[offset : offset + p.numel()].view_as(p)))
            offset += p.numel()
        return out

    def reset(self) -> None:
        """Zeroes the accumulated clipped sum."""
        self.flat_sum.zero_()

    def accumulate(
        self,
        compute_loss: Callable[[], Tensor],
        batch_size: int,
        loss_scale: float = 1.0,
        raise_on_nonfinite: bool = False,
    ) -> ClipStats:
        """Runs ``compute_loss`` (the forward pass) and backward, and adds the batch's clipped gradients.

        Args:
            compute_loss: returns the batch's loss: a scalar (the sum or mean of the per-sample
                losses) or, with ``loss_reduction="none"``, the (B,) per-sample losses.
            batch_size: the number of samples in the batch (> 0).
            loss_scale: the loss is multiplied by it before backward and the gradients divided by it
                (fp16 loss scaling); clipping always sees the true gradients.
            raise_on_nonfinite: raise `NonFiniteGradientsError` *before adding anything* if a
                per-sample gradient is not finite (fp16: retry with a smaller loss scale) instead of
                dropping that sample.

        Returns:
            What clipping saw (private: not to be logged unless the user opts in).
        """
        try:
            with self._record():
                loss = compute_loss()
            expected = batch_size if self.loss_reduction == "none" else 1
            if not isinstance(loss, Tensor) or loss.numel() != expected:
                shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
                raise PrivacyConfigError(
                    f"`PerSampleClipper(loss_reduction={self.loss_reduction!r})`: the training step must return "
                    f"{'one loss per sample' if expected > 1 else 'a scalar loss'} for a batch of {batch_size}, "
                    f"found {shape}. HINT: with loss_reduction='none' return the (B,) per-sample losses, otherwise "
                    "the batch loss (or {'loss': loss})."
                )
            if not loss.requires_grad:
                raise UnsupportedModelError(
                    "`PerSampleClipper`: the loss does not depend on any trainable layer. HINT: check that "
                    "training_step uses the model's output and that its layers are trainable."
                )
            (loss.sum() * loss_scale).backward()
            if not any(r.backprops is not None for layer in self.layers for r in layer.records):
                raise UnsupportedModelError(
                    "`PerSampleClipper`: the loss does not depend on any trainable layer. HINT: check that "
                    "training_step uses the model's output and that its layers are trainable."
                )
            scale = (batch_size if self.loss_reduction == "mean" else 1.0) / loss_scale
            # The clipping arithmetic runs in fp32 (or fp64) whatever autocast the caller's step uses.
            with torch.no_grad(), torch.autocast(self.params[0].device.type, enabled=False):
                sq_norms, pending = self._squared_norms(batch_size, scale)
                norms = sq_norms.sqrt()
                finite = torch.isfinite(norms)
                if raise_on_nonfinite and not bool(finite.all()):
                    raise NonFiniteGradientsError(f"{int((~finite).sum())} of {batch_size} per-sample gradients")
                coeff = clip_coefficients(norms, self.clip_norm)
                self._add_clipped(pending, coeff, finite)
            return ClipStats(
                batch_size=batch_size,
                clipped=int(((norms > self.clip_norm) & finite).sum()),
                norm_sum=float(norms[finite].sum()),
                nonfinite=int((~finite).sum()),
            )
        finally:
            for layer in self.layers:
                layer.records.clear()

    def _layer_records(self, layer: _Layer, batch_size: int) -> list[_Record]:
        records = [r for r in layer.records if r.backprops is not None]
        for r in records:
            if r.activation._version != r.version:
                raise UnsupportedModelError(
                    f"`{layer.name}` ({type(layer.module).__name__}): its input was modified in place after the layer "
                    "used it, so its per-sample gradients would be wrong. HINT: lightning_dp.models.fix_model(model) "
                    "turns off inplace activations; otherwise avoid in-place ops on that tensor."
                )
            if r.activation.shape[0] != batch_size or r.backprops.shape[0] != batch_size:  # type: ignore[union-attr]
                raise UnsupportedModelError(
                    f"`{layer.name}` ({type(layer.module).__name__}) got a tensor whose first dimension is "
                    f"{r.activation.shape[0]}, but the batch holds {batch_size} samples. Per-sample gradients need "
                    "the batch dimension first in every trainable layer. HINT: keep batch-first layouts, or freeze "
                    "this layer."
                )
        return records

    def _squared_norms(self, batch_size: int, scale: float) -> tuple[Tensor, list[_Pending]]:
        """Σ over layers of each sample's squared gradient norm, and what each layer keeps for the clipped sum.

        Layers that share a parameter (tied weights) form one group: their per-sample gradients are
        summed before the norm is taken, since the norm of a sum is not the sum of the norms.
        """
        dtype = self.flat_sum.dtype
        total = torch.zeros(batch_size, dtype=torch.float64, device=self.flat_sum.device)
        pending: list[_Pending] = []
        for group in self._groups:
            records = [(layer, self._layer_records(layer, batch_size)) for layer in group]
            records = [(layer, rs) for layer, rs in records if rs]
            if not records:
                continue
            (layer, layer_records), *others = records
            if not others and len(layer_records) == 1 and layer.kind in ("linear", "conv"):
                sq, item = _ghost_or_materialized(layer, layer_records[0], scale, dtype)
            else:
                # Several calls of a layer, tied parameters, or a generic layer: per-sample gradients, summed.
                grads: dict[nn.Parameter, Tensor] = {}
                for member, member_records in records:
                    for p, g in self._per_sample_grads(member, member_records, scale).items():
                        grads[p] = grads[p] + g if p in grads else g
                sq, item = _sum_of_squares(list(grads.values())), _Materialized(grads)
            total += sq
            pending.append(item)
        return total, pending

    def _per_sample_grads(self, layer: _Layer, records: list[_Record], scale: float) -> dict[nn.Parameter, Tensor]:
        dtype = self.flat_sum.dtype
        trained = {id(p) for p in layer.params}
        out: dict[nn.Parameter, Tensor] = {}
        for r in records:
            assert r.backprops is not None
            backprops = r.backprops.to(dtype) * scale
            activation = r.activation.to(dtype) if r.activation.is_floating_point() else r.activation
            if layer.kind != "generic":
                grads = _materialize(layer.kind, layer.module, activation, backprops)
            else:
                grads = self._samplers.get(type(layer.module), _functorch_sampler)(
                    layer.module, [activation], backprops
                )
            padding = getattr(layer.module, "padding_idx", None) if isinstance(layer.module, nn.Embedding) else None
            for p, g in grads.items():
                if id(p) not in trained:  # the functorch rule also returns frozen parameters
                    continue
                g = g.to(dtype)
                if padding is not None:  # Opacus' embedding rule also gives the padding row a gradient
                    g[:, padding] = 0.0
                out[p] = out[p] + g if p in out else g
        return out

    def _add_clipped(self, pending: list[_Pending], coeff: Tensor, finite: Tensor) -> None:
        coeff = coeff.to(self.flat_sum.dtype)
        dropped = None if bool(finite.all()) else finite
        for item in pending:
            if isinstance(item, _Materialized):
                for p, g in item.grads.items():
                    if dropped is not None:  # 0·NaN is NaN: zero the dropped samples explicitly
                        g = torch.where(_expand(dropped, g), g, 0.0)
                    self._sum_views[p].add_(torch.tensordot(coeff, g, dims=1))
            else:
                _add_weighted(item, coeff, dropped, self._sum_views)


def clip_coefficients(norms: Tensor, clip_norm: float) -> Tensor:
    """min(1, C/‖g_i‖) per sample, or 0 (the sample is dropped).

    The factor is 0 for a non-finite norm and for a factor below the smallest normal fp32 number,
    which fp32 arithmetic would round up.

    Example:
        >>> clip_coefficients(torch.tensor([0.5, 4.0, float("nan"), 1e45], dtype=torch.float64), 2.0).tolist()
        [1.0, 0.5, 0.0, 0.0]
    """
    coeff = (clip_norm / norms.clamp_min(1e-300)).clamp(max=1.0)
    keep = torch.isfinite(norms) & (coeff >= torch.finfo(torch.float32).tiny)
    return torch.where(keep, coeff, 0.0)


@dataclass
class _Materialized:
    """A layer's per-sample gradients, (B, *param.shape) per parameter."""

    grads: dict[nn.Parameter, Tensor]


@dataclass
class _Ghost:
    """A ghost-normed Linear/Conv layer: its input and its (cast, scaled) output gradient."""

    module: nn.Module
    kind: Literal["linear", "conv"]
    activation: Tensor
    backprops: Tensor


_Pending = _Materialized | _Ghost


def _tied_groups(layers: list[_Layer]) -> list[list[_Layer]]:
    """The layers grouped so that layers sharing a parameter are in the same group (in layer order)."""
    owner: dict[int, int] = {}
    parent = list(range(len(layers)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, layer in enumerate(layers):
        for p in layer.params:
            if id(p) in owner:
                parent[find(i)] = find(owner[id(p)])
            else:
                owner[id(p)] = i
    groups: dict[int, list[_Layer]] = {}
    for i, layer in enumerate(layers):
        groups.setdefault(find(i), []).append(layer)
    return list(groups.values())


def _sum_of_squares(tensors: list[Tensor]) -> Tensor:
    """Per-sample Σ of squares of (B, ...) tensors, as float64; recomputed in float64 where fp32 overflowed."""
    b = tensors[0].shape[0]
    sq = torch.stack([t.reshape(b, -1).pow(2).sum(1) for t in tensors]).sum(0).double()
    if not bool(torch.isfinite(sq).all()):
        sq = torch.stack([t.reshape(b, -1).double().pow(2).sum(1) for t in tensors]).sum(0)
    return sq


def _expand(mask: Tensor, like: Tensor) -> Tensor:
    return mask.view(-1, *([1] * (like.dim() - 1)))


def _functorch_sampler(module: nn.Module, activations: list[Tensor], backprops: Tensor) -> dict[nn.Parameter, Tensor]:
    from opacus.grad_sample.functorch import ft_compute_per_sample_gradient

    return ft_compute_per_sample_gradient(module, activations, backprops)


def _prepare_functorch(name: str, module: nn.Module) -> None:
    if any(True for _ in module.buffers(recurse=False)) or any(True for _ in module.children()):
        raise UnsupportedModelError(
            f"`{name}` ({type(module).__name__}) has trainable parameters but no per-sample gradient rule, and it "
            "holds buffers or sub-modules, so the generic (functorch) rule cannot handle it either. HINT: freeze it, "
            "replace it with standard layers, or register an Opacus grad sampler for it "
            "(opacus.grad_sample.register_grad_sampler)."
        )
    from opacus.grad_sample.functorch import prepare_layer

    prepare_layer(module)


# ---------------------------------------------------------------------- Linear
def _linear_views(activation: Tensor, backprops: Tensor) -> tuple[Tensor, Tensor]:
    b = activation.shape[0]
    return activation.reshape(b, -1, activation.shape[-1]), backprops.reshape(b, -1, backprops.shape[-1])


# ---------------------------------------------------------------------- Conv
def _conv_geometry(layer: nn.Module, activation: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """The input padded as the layer pads it, and the padding left for the convolution itself (zeros)."""
    conv: Any = layer
    dims = activation.dim() - 2
    kernel, dilation = conv.kernel_size, conv.dilation
    if conv.padding == "valid":
        pads = [(0, 0)] * dims
    elif conv.padding == "same":
        pads = []
        for k, d in zip(kernel, dilation):
            total = d * (k - 1)
            pads.append((total // 2, total - total // 2))
    else:
        pads = [(p, p) for p in conv.padding]
    symmetric = all(left == right for left, right in pads)
    if conv.padding_mode == "zeros" and symmetric:
        return activation, tuple(left for left, _ in pads)
    flat: list[int] = []
    for left, right in reversed(pads):
        flat += [left, right]
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    return F.pad(activation, flat, mode=mode), (0,) * dims


def _unfold(layer: nn.Module, activation: Tensor) -> Tensor:
    """(B, C_in·k…, T): the receptive field of every output position."""
    conv: Any = layer
    x, padding = _conv_geometry(layer, activation)
    if x.dim() == 3:  # Conv1d as a Conv2d of height 1
        x = x.unsqueeze(2)
        return F.unfold(
            x,
            (1, conv.kernel_size[0]),
            dilation=(1, conv.dilation[0]),
            padding=(0, padding[0]),
            stride=(1, conv.stride[0]),
        )
    if x.dim() == 4:
        return F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=padding, stride=conv.stride)
    from opacus.utils.tensor_utils import unfold3d

    return unfold3d(x, kernel_size=conv.kernel_size, padding=padding, stride=conv.stride, dilation=conv.dilation)


def _views(
    kind: Literal["linear", "conv"], module: nn.Module, activation: Tensor, backprops: Tensor
) -> tuple[Tensor, Tensor]:
    """A Linear or Conv layer as a matrix product per sample: (B, d, T) inputs and (B, p, T) output gradients."""
    b = activation.shape[0]
    if kind == "linear":
        a, g = _linear_views(activation, backprops)
        return a.transpose(1, 2), g.transpose(1, 2)
    return _unfold(module, activation), backprops.reshape(b, backprops.shape[1], -1)


def _materialize(
    kind: Literal["linear", "conv"], module: nn.Module, activation: Tensor, backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradients of a Linear/Conv layer, (B, *param.shape) per trained parameter.

    A convolution's are one grouped weight-gradient convolution with the batch folded into the
    groups (B·groups groups): as fast as the layer's ordinary weight gradient, with no unfolded
    input in memory.
    """
    layer: Any = module
    b = activation.shape[0]
    if kind == "linear":
        a, g = _linear_views(activation, backprops)
        grads = {layer.weight: torch.bmm(g.transpose(1, 2), a)}
        bias = g.sum(1)
    else:
        x, padding = _conv_geometry(module, activation)
        dims = x.dim() - 2
        weight_shape = (b * layer.weight.shape[0], *layer.weight.shape[1:])
        _, weight, _ = torch.ops.aten.convolution_backward(
            backprops.reshape(1, b * backprops.shape[1], *backprops.shape[2:]),
            x.reshape(1, b * x.shape[1], *x.shape[2:]),
            torch.empty(weight_shape, dtype=x.dtype, device=x.device),  # only its shape is read
            None,
            list(layer.stride),
            list(padding),
            list(layer.dilation),
            False,
            [0] * dims,
            b * layer.groups,
            [False, True, False],
        )
        grads = {layer.weight: weight.reshape(b, *layer.weight.shape)}
        bias = backprops.reshape(b, backprops.shape[1], -1).sum(2)
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = bias
    return grads


# ---------------------------------------------------------------------- norms and sums
def _ghost_or_materialized(layer: _Layer, record: _Record, scale: float, dtype: torch.dtype) -> tuple[Tensor, _Pending]:
    """Squared per-sample gradient norms of a Linear/Conv layer, by whichever of the two rules is cheaper.

    With T output positions, d = fan-in and p = fan-out, the ghost norm costs ~T²(d + p) per sample and
    keeps nothing; materializing costs ~T·d·p and keeps the per-sample gradients (reused for the
    clipped sum). Grouped convolutions are always materialized (per group they are small).
    """
    assert record.backprops is not None and layer.kind != "generic"
    module: Any = layer.module
    activation, backprops = record.activation.to(dtype), record.backprops.to(dtype) * scale
    t = backprops[0].numel() // backprops.shape[-1 if layer.kind == "linear" else 1]  # output positions
    p, d = module.weight.shape[0], module.weight[0].numel()  # fan-out, fan-in
    if getattr(module, "groups", 1) == 1 and t * (d + p) < d * p:
        at, gt = _views(layer.kind, module, activation, backprops)  # (B, d, T), (B, p, T)
        return _ghost_norms(module, at, gt), _Ghost(module, layer.kind, activation, backprops)
    grads = _materialize(layer.kind, module, activation, backprops)
    return _sum_of_squares(list(grads.values())), _Materialized(grads)


#: If a ghost norm is below this fraction of its triangle-inequality bound Σ_t‖g_t‖‖a_t‖, the terms of
#: the sample's gradient nearly cancel, and fp32 round-off in the clipped sum (of order 1e-7 of the bound)
#: could be a visible fraction of the norm: such a sample is clipped on the bound instead (it can only
#: be clipped more).
GHOST_CANCELLATION = 1e-2


def _ghost_norms(module: Any, at: Tensor, gt: Tensor) -> Tensor:
    """‖Σ_t g_t a_tᵀ‖² (+ ‖Σ_t g_t‖² for the bias) per sample, in float64, without forming the gradients.

    Computed in float64 (the Gram products cancel when a sample's gradient terms nearly do), and
    replaced by the squared triangle-inequality bound where they cancel by more than
    ``GHOST_CANCELLATION``, so the norm never falls short of the contribution actually added.
    """
    at, gt = at.double(), gt.double()
    if at.shape[2] == 1:
        sq = at.pow(2).sum((1, 2)) * gt.pow(2).sum((1, 2))
    else:
        sq = (torch.bmm(at.transpose(1, 2), at) * torch.bmm(gt.transpose(1, 2), gt)).sum((1, 2))
    g_norms = gt.norm(dim=1)  # (B, T)
    sq = _guard(sq, (at.norm(dim=1) * g_norms).sum(1))
    if module.bias is not None and module.bias.requires_grad:
        sq = sq + _guard(gt.sum(2).pow(2).sum(1), g_norms.sum(1))
    return sq


def _guard(sq: Tensor, bound: Tensor) -> Tensor:
    return torch.where(sq < (GHOST_CANCELLATION * bound) ** 2, bound**2, sq)


def _add_weighted(item: _Ghost, coeff: Tensor, dropped: Tensor | None, sums: dict[nn.Parameter, Tensor]) -> None:
    """Σ_i c_i·g_i of a ghost-normed layer: one weight gradient computed from c-weighted output gradients."""
    module: Any = item.module
    activation, backprops = item.activation, item.backprops
    if dropped is not None:  # 0·NaN is NaN: zero the dropped samples explicitly
        activation = torch.where(_expand(dropped, activation), activation, 0.0)
        backprops = torch.where(_expand(dropped, backprops), backprops, 0.0)
    weighted = backprops * _expand(coeff, backprops)
    if item.kind == "linear":
        a, g = _linear_views(activation, weighted)
        sums[module.weight].add_(g.reshape(-1, g.shape[-1]).t() @ a.reshape(-1, a.shape[-1]))
        if module.bias is not None and module.bias.requires_grad:
            sums[module.bias].add_(g.sum((0, 1)))
        return
    x, padding = _conv_geometry(module, activation)
    dims = x.dim() - 2
    _, weight_grad, _ = torch.ops.aten.convolution_backward(
        weighted,
        x,
        module.weight.to(x.dtype),
        None,
        list(module.stride),
        list(padding),
        list(module.dilation),
        False,
        [0] * dims,
        module.groups,
        [False, True, False],
    )
    sums[module.weight].add_(weight_grad)
    if module.bias is not None and module.bias.requires_grad:
        sums[module.bias].add_(weighted.sum([0, *range(2, weighted.dim())]))
