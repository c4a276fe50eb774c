"""Per-sample gradient clipping in one forward and one backward pass.

DP-SGD needs Σ_i clip_C(g_i), the sum of per-sample gradients each scaled to L2 norm ≤ C.
`PerSampleClipper` computes it without ever letting autograd build the un-clipped weight gradient:

* During the forward pass the trainable parameters are detached from the graph. A forward hook on
  every trainable layer keeps the layer's input and registers a *tensor* hook on its output.
* The backward pass then computes activation gradients only; the tensor hooks hand each layer its
  output gradient. (Tensor hooks still see the gradient of the value the layer produced when a
  later in-place op such as ResNet's ``out += identity`` or ``ReLU(inplace=True)`` changes the
  tensor. Opacus' module backward hooks fail there, Opacus issue #828.)
* Each sample's squared gradient norm is summed layer by layer, each layer by its rule
  (`lightning_dp.sanitization.rules`: one rule per layer type, `register_rule` adds one). Linear
  layers and (transposed) convolutions take the *ghost norm* ‖Σ_t g_t a_tᵀ‖² = Σ_{t,s} (a_t·a_s)(g_t·g_s)
  when the layer's spatial extent T is small, or the materialized per-sample gradients when that is
  cheaper (Li et al. 2022; Bu et al. 2023, "mixed ghost clipping"). Other layers (GroupNorm,
  LayerNorm, embeddings, ...) use Opacus' registered per-layer grad samplers, and parameter-holding
  leaf layers without buffers that nothing else covers use its functorch fallback.
* A layer that ran once and shares no parameter is evaluated as soon as the backward pass reaches
  its output, so its input and output gradient are released then rather than all held to the end
  (on a U-Net this keeps the step's peak memory near the non-private one).
* With the clip coefficients c_i = min(1, C/‖g_i‖) the clipped sum of a ghost-normed layer is one
  weight gradient computed from the c-weighted output gradients ("book-keeping", Bu et al. 2023).

A sample whose gradient norm is not finite gets c_i = 0: its contribution is dropped (and counted),
never propagated.

*Augmentation multiplicity* (De et al. 2022, ``group_size=K`` in `PerSampleClipper.accumulate`): each
sample arrives as K rows (K augmented views, sample-major), its gradient g_i is the *mean* of its views'
gradients, and that mean is what is clipped to C. Each sample still adds one contribution of norm ≤ C
to the sum, so the sensitivity, and with it the privacy accounting, is that of K = 1.

*Groups of different sizes* (``group_size`` a sequence of B row counts): sample i is n_i consecutive rows
and its gradient is the mean over them. P3SGD's vectorized round uses it with a patient as the sample and
the patient's images as its rows: one forward and backward pass gives every patient's mean-loss gradient,
each clipped as a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_dp.errors import PrivacyConfigError, UnsupportedModelError, check_count, check_finite_positive
from lightning_dp.sanitization.rules import (
    ClippedSumTerm,
    GroupSize,
    LayerRule,
    MaterializedGrads,
    registered_rule,
    rule_for,
    sum_groups,
    sum_of_squares,
)

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


def check_loss_reduction(owner: str, value: Any) -> LossReduction:
    """Returns ``value`` if it is 'mean', 'sum' or 'none', else raises `PrivacyConfigError`."""
    if value not in ("mean", "sum", "none"):
        raise PrivacyConfigError(
            f"`{owner}(loss_reduction={value!r})`: loss_reduction must be 'mean', 'sum' or 'none', found {value!r}. "
            "HINT: 'mean' if the loss averages the per-sample losses over the batch (the default of "
            "torch.nn.functional.cross_entropy), 'sum' if it adds them, 'none' if it returns one loss per sample."
        )
    return value


class NonFiniteGradientsError(ArithmeticError):
    """Some per-sample gradients were not finite and the caller asked to be told (nothing was added)."""


def _direct_trainable(module: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters registered on ``module`` itself, less aliases of its sub-modules' parameters.

    An alias (Opacus' ``DPLSTM`` registers ``weight_ih_l0`` on itself for ``l0.ih.weight``, to keep
    ``nn.LSTM``'s state-dict names) belongs to the sub-module whose forward uses it, and the sub-module's
    rule computes its per-sample gradient. Were the parent to use it outside the sub-module too, the
    start-up check's comparison with autograd (`lightning_dp.training.checks`) would refuse the model.
    """
    own = [p for p in module.parameters(recurse=False) if p.requires_grad]
    if not own:
        return own
    below = {id(p) for child in module.children() for p in child.parameters()}
    return [p for p in own if id(p) not in below]


def parameters_next_to_children(module: nn.Module) -> list[tuple[str, nn.Module, list[str], list[str]]]:
    """Modules holding trainable parameters *and* children with trainable parameters (other than registered layers).

    Their parameters are used somewhere in their forward, outside any layer, so no per-sample rule
    applies (for example a LightningModule with its own ``nn.Parameter``). A module whose type has a
    registered rule (`lightning_dp.sanitization.rules.register_rule`: Linear, Conv, ConvTranspose, ...)
    is not listed. Returns (name, module, its parameter names, the parameterized children's names) for each.
    """
    found = []
    for name, sub in module.named_modules():
        if not _direct_trainable(sub) or registered_rule(sub) is not None:
            continue
        nested = [n for n, child in sub.named_modules() if child is not sub and _direct_trainable(child)]
        if nested:
            direct = {id(p) for p in _direct_trainable(sub)}
            params = [n for n, p in sub.named_parameters(recurse=False) if id(p) in direct]
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
            f"parameters ({nested[:3]}), so their per-sample gradients cannot be computed. HINT: freeze them "
            "(model.get_parameter(qualified name).requires_grad_(False); lightning_dp.models.validate_model(model) "
            "names each), which works on a library's class too; in a class of your own you can instead move them "
            "into a small nn.Module of their own (whose forward uses them)."
        )
    excluded = {id(sub) for _, sub, _, _ in mixed}
    return [(n, sub) for n, sub in module.named_modules() if _direct_trainable(sub) and id(sub) not in excluded]


@dataclass
class _Record:
    """One call of a layer in the forward pass.

    ``done`` holds the call's squared norms and clipped-sum term when they were computed during the
    backward pass (its input and output gradient are then released: ``activation`` is None).
    """

    activation: Tensor | None
    version: int
    backprops: Tensor | None = None
    done: tuple[Tensor, ClippedSumTerm] | None = None

    @property
    def reached(self) -> bool:
        """Whether the loss's gradient reached this call's output."""
        return self.backprops is not None or self.done is not None


@dataclass(frozen=True)
class _Pass:
    """What the backward pass of one `PerSampleClipper.accumulate` needs to evaluate layers as it reaches them.

    ``batch_size`` counts samples; each sample has ``group_size`` consecutive rows in the batch (K each, or a
    (B,) tensor of counts).
    """

    batch_size: int
    dtype: torch.dtype
    group_size: GroupSize = 1

    @property
    def rows(self) -> int:
        """The batch dimension of every layer's input and output gradient."""
        k = self.group_size
        return self.batch_size * k if isinstance(k, int) else int(k.sum())

    @property
    def plain(self) -> bool:
        """One row per sample."""
        return isinstance(self.group_size, int) and self.group_size == 1

    def describe(self) -> str:
        """The batch's rows in words, for messages."""
        k = self.group_size
        if isinstance(k, int):
            return f"{self.rows} rows ({self.batch_size} samples x {k} views)" if k > 1 else f"{self.rows} samples"
        return f"{self.rows} rows ({self.batch_size} groups of {int(k.min())} to {int(k.max())} rows)"


@dataclass
class _Layer:
    name: str
    module: nn.Module
    params: list[nn.Parameter]
    rule: LayerRule
    records: list[_Record] = field(default_factory=list)


@dataclass(frozen=True)
class ClipStats:
    """What clipping saw in one batch, step or round. Computed from private data: not sanitized, not logged by default.

    Counts units (samples, not the rows of their augmented views; or patients), ``norm_sum`` sums the units' norms
    before clipping (the finite ones). Stats add up (``a + b``) and travel between DDP ranks as a float64 tensor.

    Example:
        >>> total = ClipStats() + ClipStats.of_unit(2.0, clipped=True, finite=True) + ClipStats(3, 1, 1.5, 0)
        >>> total, ClipStats.from_tensor(total.to_tensor()) == total
        (ClipStats(batch_size=4, clipped=2, norm_sum=3.5, nonfinite=0), True)
    """

    batch_size: int = 0
    clipped: int = 0
    norm_sum: float = 0.0
    nonfinite: int = 0

    @classmethod
    def of_unit(cls, norm: float, clipped: bool, finite: bool) -> ClipStats:
        """One unit's stats: its norm counts only if finite."""
        return cls(1, int(clipped), norm if finite else 0.0, int(not finite))

    def __add__(self, other: ClipStats) -> ClipStats:
        return ClipStats(
            self.batch_size + other.batch_size,
            self.clipped + other.clipped,
            self.norm_sum + other.norm_sum,
            self.nonfinite + other.nonfinite,
        )

    def to_tensor(self, device: torch.device | str | None = None) -> Tensor:
        """(units, clipped, norm sum, non-finite) as float64, e.g. to sum over DDP ranks."""
        values = [float(self.batch_size), float(self.clipped), self.norm_sum, float(self.nonfinite)]
        return torch.tensor(values, dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, values: Tensor) -> ClipStats:
        """The inverse of `to_tensor` (counts rounded to integers)."""
        units, clipped, norm_sum, nonfinite = values.double().cpu().tolist()
        return cls(round(units), round(clipped), norm_sum, round(nonfinite))


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
        self.layers: list[_Layer] = []
        for name, sub in trainable_layers(module):
            rule = rule_for(sub, name)
            rule.prepare(sub)
            self.layers.append(_Layer(name, sub, _direct_trainable(sub), rule))
        self.params = list({id(p): p for layer in self.layers for p in layer.params}.values())
        self._groups = _tied_groups(self.layers)
        # A layer that shares no parameter is evaluated as soon as its output gradient is known (if it ran once), so
        # that its input and output gradient are freed during the backward pass instead of all being held to its end.
        self._alone = {id(group[0]) for group in self._groups if len(group) == 1}
        self._pass: _Pass | None = None
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
                if self._pass is not None and id(layer) in self._alone and len(layer.records) == 1:
                    self._evaluate(layer, record, self._pass)

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
        group_size: int | Sequence[int] | Tensor = 1,
    ) -> ClipStats:
        """Runs ``compute_loss`` (the forward pass) and backward, and adds the batch's clipped gradients.

        With ``group_size=K`` > 1 (augmentation multiplicity, De et al. 2022) the batch holds
        ``batch_size`` samples as K rows each, sample-major: rows i·K … i·K + K − 1 are sample i's K
        views. Sample i's loss is the mean of its views' losses, so its gradient is the mean of their
        gradients, g_i = (1/K)·Σ_k ∇ℓ(view_ik), and g_i is what is clipped to C. The returned loss is
        over the rows: their mean (``"mean"``, i.e. Σ_rows/(B·K)), their sum (``"sum"``) or the (B·K,)
        row losses (``"none"``). Privacy is unchanged: each sample still adds exactly one clipped
        contribution of norm ≤ C, however many views it has. With K = 1 this is the plain path.

        ``group_size`` may also be a sequence of ``batch_size`` row counts n_1 … n_B (groups of different
        sizes, sample-major): sample i is its n_i consecutive rows, its loss the mean of theirs, its gradient
        g_i = (1/n_i)·Σ_rows ∇ℓ_row, clipped to C as a whole. With ``"mean"`` the returned loss is the mean
        over all Σ n_i rows.

        Args:
            compute_loss: returns the batch's loss: a scalar (the sum or mean of the per-sample
                losses) or, with ``loss_reduction="none"``, the (B,) per-sample losses ((B·K,) per-row
                losses with ``group_size=K``).
            batch_size: the number of samples in the batch (> 0), not counting their views.
            loss_scale: the loss is multiplied by it before backward and the gradients divided by it
                (fp16 loss scaling); clipping always sees the true gradients.
            raise_on_nonfinite: raise `NonFiniteGradientsError` *before adding anything* if a
                per-sample gradient is not finite (fp16: retry with a smaller loss scale) instead of
                dropping that sample.
            group_size: K, the number of consecutive rows (augmented views) of each sample (≥ 1), or each
                sample's own number of rows (a sequence or 1-d tensor of ``batch_size`` integers ≥ 1).

        Returns:
            What clipping saw, per sample (private: not to be logged unless the user opts in).

        Raises:
            PrivacyConfigError: ``group_size`` is not an integer ≥ 1 (or a sequence of ``batch_size`` of them), or
                the loss has the wrong shape.
        """
        check_finite_positive("PerSampleClipper.accumulate", "loss_scale", loss_scale, "1.0, or the fp16 loss scale.")
        groups = _check_group_size(group_size, batch_size)
        rows = _Pass(batch_size, torch.float32, groups).rows
        try:
            with self._record():
                loss = compute_loss()
            expected = rows if self.loss_reduction == "none" else 1
            if not isinstance(loss, Tensor) or loss.numel() != expected:
                shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
                if isinstance(groups, int):
                    views = f" ({batch_size} samples x {groups} views)" if groups > 1 else ""
                else:
                    views = f" ({batch_size} groups of {int(groups.min())} to {int(groups.max())} rows)"
                raise PrivacyConfigError(
                    f"`PerSampleClipper(loss_reduction={self.loss_reduction!r})`: the training step must return "
                    f"{'one loss per sample' if expected > 1 else 'a scalar loss'} for a batch of {rows}{views}, "
                    f"found {shape}. HINT: with loss_reduction='none' return the (B,) per-sample losses, otherwise "
                    "the batch loss (or {'loss': loss})."
                )
            if not loss.requires_grad:
                raise UnsupportedModelError(
                    "`PerSampleClipper`: the loss does not depend on any trainable layer. HINT: check that "
                    "training_step uses the model's output and that its layers are trainable."
                )
            state = _Pass(batch_size, self.flat_sum.dtype, groups)
            self._pass = state
            (loss.sum() * loss_scale).backward()
            self._pass = None
            if not any(r.reached for layer in self.layers for r in layer.records):
                raise UnsupportedModelError(
                    "`PerSampleClipper`: the loss does not depend on any trainable layer. HINT: check that "
                    "training_step uses the model's output and that its layers are trainable."
                )
            # The rules work on the raw output gradients: per-sample gradients are linear in them, so the factor that
            # turns them into the gradients of the per-sample losses (the batch size for a mean, 1/loss_scale) is
            # applied once, to the norms and to the clip factors, instead of to a copy of every layer's gradient.
            # With K views a sample's raw gradient is the sum over its rows; its loss is the mean of its views'
            # losses: the factor is n for a mean over the n·K rows (Σ_rows/(nK)), 1/K for a sum or per-row losses.
            # With (B,) row counts n_i the factor is per sample: R/n_i for a mean over the R rows, 1/n_i otherwise.
            scale: float | Tensor
            if isinstance(groups, int):
                scale = (batch_size if self.loss_reduction == "mean" else 1.0 / groups) / loss_scale
            else:
                counts = groups.to(device=self.flat_sum.device, dtype=torch.float64)
                scale = (rows if self.loss_reduction == "mean" else 1.0) / counts / loss_scale
            # The clipping arithmetic runs in fp32 (or fp64) whatever autocast the caller's step uses.
            with torch.no_grad(), torch.autocast(self.params[0].device.type, enabled=False):
                sq_norms, pending = self._squared_norms(state)
                norms = sq_norms.sqrt() * scale
                finite = torch.isfinite(norms)
                if raise_on_nonfinite and not bool(finite.all()):
                    raise NonFiniteGradientsError(f"{int((~finite).sum())} of {batch_size} per-sample gradients")
                coeff = clip_coefficients(norms, self.clip_norm)
                self._add_clipped(pending, coeff * scale, finite)
            return ClipStats(
                batch_size=batch_size,
                clipped=int(((norms > self.clip_norm) & finite).sum()),
                norm_sum=float(norms[finite].sum()),
                nonfinite=int((~finite).sum()),
            )
        finally:
            self._pass = None
            for layer in self.layers:
                layer.records.clear()

    def _evaluate(self, layer: _Layer, record: _Record, state: _Pass) -> None:
        """Computes a layer call's norms and clipped-sum term during the backward pass, and releases its tensors."""
        _check_record(layer, record, state)
        with torch.no_grad(), torch.autocast(self.params[0].device.type, enabled=False):
            record.done = self._call_norms(layer, record, state)
        record.activation = record.backprops = None

    def _call_norms(self, layer: _Layer, record: _Record, state: _Pass) -> tuple[Tensor, ClippedSumTerm]:
        """The squared per-sample norms and clipped-sum term of the only call of a layer that shares nothing."""
        activation, backprops = _inputs(record, state.dtype)
        if state.plain:
            # The rule picks ghost norm or materialized gradients.
            return layer.rule.norms(layer.module, activation, backprops)
        # Views: the norm of each sample's gradient summed over its rows (ghost norm or materialized, by cost).
        return layer.rule.grouped_norms(layer.module, activation, backprops, state.group_size)

    def _layer_records(self, layer: _Layer, state: _Pass) -> list[_Record]:
        records = [r for r in layer.records if r.reached]
        for r in records:
            if r.done is None:
                _check_record(layer, r, state)
        return records

    def _squared_norms(self, state: _Pass) -> tuple[Tensor, list[ClippedSumTerm]]:
        """Σ over layers of each sample's squared gradient norm, and what each layer keeps for the clipped sum.

        Layers that share a parameter (tied weights) form one group: their per-sample gradients are
        summed before the norm is taken, since the norm of a sum is not the sum of the norms. So are the
        rows of a sample's views (``state.group_size`` > 1).
        """
        batch_size = state.batch_size
        total = torch.zeros(batch_size, dtype=torch.float64, device=self.flat_sum.device)
        pending: list[ClippedSumTerm] = []
        for group in self._groups:
            records = [(layer, self._layer_records(layer, state)) for layer in group]
            records = [(layer, rs) for layer, rs in records if rs]
            if not records:
                continue
            (layer, layer_records), *others = records
            if not others and len(layer_records) == 1:
                # One call of a layer that shares nothing.
                record = layer_records[0]
                if record.done is None:
                    record.done = self._call_norms(layer, record, state)
                sq, item = record.done
            else:
                # Several calls of a layer, or tied parameters: per-sample gradients, summed before the norm.
                grads: dict[nn.Parameter, Tensor] = {}
                for member, member_records in records:
                    for p, g in self._per_sample_grads(member, member_records).items():
                        grads[p] = grads[p] + g if p in grads else g
                grads = sum_groups(grads, state.group_size)
                sq, item = sum_of_squares(list(grads.values()), batch_size, total.device), MaterializedGrads(grads)
            total += sq
            pending.append(item)
        return total, pending

    def _per_sample_grads(self, layer: _Layer, records: list[_Record]) -> dict[nn.Parameter, Tensor]:
        dtype = self.flat_sum.dtype
        trained = {id(p) for p in layer.params}
        out: dict[nn.Parameter, Tensor] = {}
        for r in records:
            activation, backprops = _inputs(r, dtype)
            for p, g in layer.rule.trained_grads(layer.module, activation, backprops).items():
                if id(p) not in trained:
                    continue
                out[p] = out[p] + g if p in out else g
        return out

    def _add_clipped(self, pending: list[ClippedSumTerm], coeff: Tensor, finite: Tensor) -> None:
        coeff = coeff.to(self.flat_sum.dtype)
        keep = None if bool(finite.all()) else finite
        for item in pending:
            item.add_clipped(coeff, keep, self._sum_views)


def _check_group_size(group_size: Any, batch_size: int) -> GroupSize:
    """K (an int ≥ 1), or the (B,) int64 row counts of groups of different sizes (an int if they are all equal)."""
    owner = "PerSampleClipper.accumulate"
    if isinstance(group_size, (Sequence, Tensor)) and not isinstance(group_size, str):
        counts = [group_size[i] for i in range(len(group_size))]
        ints = [int(c) if isinstance(c, (int, Tensor)) and not isinstance(c, bool) else None for c in counts]
        exact = all(
            i is not None and (not isinstance(c, Tensor) or (c.numel() == 1 and not c.is_floating_point()))
            for i, c in zip(ints, counts)
        )
        if not exact or len(ints) != batch_size or any(i is None or i < 1 for i in ints):
            shown = group_size.tolist() if isinstance(group_size, Tensor) else list(group_size)
            raise PrivacyConfigError(
                f"`{owner}(group_size={shown[:8]}{'...' if len(shown) > 8 else ''})`: group_size must be one "
                f"integer >= 1 or {batch_size} of them (batch_size={batch_size}), found {len(shown)} values. "
                "HINT: one row count per sample, in the order of the samples' rows."
            )
        values = [int(i) for i in ints if i is not None]
        if len(set(values)) == 1:
            return values[0]
        return torch.tensor(values, dtype=torch.long)
    return check_count(
        owner,
        "group_size",
        group_size,
        "the number of augmented views of each sample (augmentation multiplicity), 1 for none.",
        minimum=1,
    )


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


def _check_record(layer: _Layer, record: _Record, state: _Pass) -> None:
    """Raises `UnsupportedModelError` if a call's input changed in place since, or its batch dimension is not first."""
    assert record.activation is not None and record.backprops is not None
    if record.activation._version != record.version:
        raise UnsupportedModelError(
            f"`{layer.name}` ({type(layer.module).__name__}): its input was modified in place after the layer "
            "used it, so its per-sample gradients would be wrong. HINT: lightning_dp.models.fix_model(model) "
            "turns off inplace activations; otherwise avoid in-place ops on that tensor."
        )
    rows = state.rows
    if record.activation.shape[0] != rows or record.backprops.shape[0] != rows:
        raise UnsupportedModelError(
            f"`{layer.name}` ({type(layer.module).__name__}) got a tensor whose first dimension is "
            f"{record.activation.shape[0]}, but the batch holds {state.describe()}. Per-sample gradients need "
            "the batch dimension first in every trainable layer. HINT: keep batch-first layouts, or freeze "
            "this layer."
        )


def _inputs(record: _Record, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A call's input (cast to ``dtype`` if floating point) and its output gradient (cast; not copied if already)."""
    assert record.activation is not None and record.backprops is not None
    activation = record.activation.to(dtype) if record.activation.is_floating_point() else record.activation
    return activation, record.backprops.to(dtype)
