"""Per-layer rules of the per-sample gradient engine: one rule object per layer type.

`PerSampleClipper` sees each call of a trainable layer as its input (``activation``) and the
gradient of the loss with respect to its output (``backprops``), both batch-first. A `LayerRule`
turns them into each sample's squared gradient norm over the layer's *own* trainable parameters
(``module.parameters(recurse=False)``), and into the term that the clipped sum Σ_i c_i·g_i needs
once the clip factors c_i are known. The engine asks `rule_for` once per layer, and
`lightning_dp.models.validate_model` asks the same question (`rule_problem`): a model is accepted
by one exactly when it is by the other.

Lookup, for a module of type ``T``:

1. the rule registered for ``T`` or its nearest registered base class (`register_rule`). Built in:
   Linear; Conv1d/2d/3d (any stride, dilation, groups, padding and padding mode);
   ConvTranspose1d/2d/3d (any stride, padding, output padding, dilation and groups); PReLU;
   BatchNorm1d/2d/3d and SyncBatchNorm in eval mode with running statistics (their affine weight and
   bias: parameter-efficient fine-tuning of a network whose statistics stay fixed).
2. Opacus' grad sampler registered for exactly ``T`` (GroupNorm, LayerNorm, affine InstanceNorm,
   Embedding, EmbeddingBag, RMSNorm, ...; ``opacus.grad_sample.register_grad_sampler`` adds more).
3. the functorch rule (``torch.func.vmap`` over the layer's forward), for a leaf module without
   buffers.

A module that none of them can handle (trainable parameters next to buffers or sub-modules, a
trainable BatchNorm in training mode) has no rule: `rule_for` raises `UnsupportedModelError` naming
it and the fix.

Linear layers and (transposed) convolutions choose per call between two ways, by cost
(`ProductRule`): the *ghost norm* ‖Σ_t g_t a_tᵀ‖² = Σ_{t,s} (a_t·a_s)(g_t·g_s) over the layer's T
positions costs ~T²(d + p) per sample and keeps nothing; *materializing* the per-sample gradients
costs ~T·d·p and keeps them, or the layer's input and output gradient when those are smaller
(`KeptInputsTerm`), for the clipped sum (d = fan-in, p = fan-out). The ghost norm's cost
grows with the square of the spatial size, so high-resolution layers materialize and deep,
low-resolution ones use the ghost norm (Li et al. 2022; Bu et al. 2023, "mixed ghost clipping").
After a ghost norm the layer's clipped sum is one ordinary weight gradient computed from the
c-weighted output gradients (Bu et al. 2023, "book-keeping").

With augmentation multiplicity (``PerSampleClipper.accumulate(group_size=K)``) a sample has K
consecutive rows (views) and its gradient is the sum over them (the engine applies the 1/K). Groups of
different sizes (``group_size`` a (B,) tensor of row counts: P3SGD's patients, each a group of its
images) are handled the same way, the ghost norm padding every group to the largest with zero rows:
`LayerRule.grouped_norms` materializes the rows' gradients and sums each sample's K; a `ProductRule`
takes the ghost norm over the K·T positions of a sample's views when that is cheaper, and adds the
clipped sum with each sample's clip factor applied to all of its rows.

A rule decides how much of a sample's gradient clipping sees: a wrong rule breaks the privacy
guarantee. Test a new rule against a naive loop over samples, as ``tests/unit/sanitization`` does.

Example:
    >>> type(rule_for(nn.ConvTranspose2d(4, 2, 3, stride=2))).__name__
    'ConvTransposeRule'
    >>> has_rule(nn.GroupNorm(2, 4)), has_rule(nn.BatchNorm2d(4)), has_rule(nn.BatchNorm2d(4).eval())
    (True, False, True)
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.errors import PrivacyConfigError, UnsupportedModelError

__all__ = [
    "GHOST_CANCELLATION",
    "BatchNormRule",
    "ClippedSumTerm",
    "ConvRule",
    "ConvTransposeRule",
    "FunctorchRule",
    "GhostTerm",
    "GroupSize",
    "KeptInputsTerm",
    "LayerRule",
    "LinearRule",
    "MaterializedGrads",
    "OpacusRule",
    "PReLURule",
    "ProductRule",
    "RowsTerm",
    "group_count",
    "has_rule",
    "register_rule",
    "rule_for",
    "rule_problem",
    "unregister_rule",
]

#: The flat clipped sum's slice of each trained parameter (shaped like the parameter).
Sums = Mapping[nn.Parameter, Tensor]

#: How a batch's rows form its samples: K consecutive rows each (an int), or a (B,) int64 tensor of each
#: sample's number of consecutive rows (groups of different sizes, sample-major).
GroupSize = int | Tensor

#: If a ghost norm is below this fraction of its triangle-inequality bound Σ_t‖g_t‖‖a_t‖, the terms of
#: the sample's gradient nearly cancel, and fp32 round-off in the clipped sum (of order 1e-7 of the bound)
#: could be a visible fraction of the norm: such a sample is clipped on the bound instead (it can only
#: be clipped more).
GHOST_CANCELLATION = 1e-2


# ---------------------------------------------------------------------- what a layer keeps for the clipped sum
class ClippedSumTerm(ABC):
    """What one layer keeps between a batch's norms and its clipped sum."""

    @abstractmethod
    def add_clipped(self, coeff: Tensor, keep: Tensor | None, sums: Sums) -> None:
        """Adds the layer's Σ_i coeff_i·g_i to ``sums``.

        Args:
            coeff: (B,) clip factors.
            keep: (B,) True for the samples kept, or None if all are. A dropped sample's gradient may
                be NaN and must add nothing (0·NaN is NaN).
            sums: each trained parameter's slice of the flat clipped sum; a parameter missing there is
                not trained by this engine and is skipped.
        """


@dataclass
class MaterializedGrads(ClippedSumTerm):
    """A layer's per-sample gradients, (B, *param.shape) per trained parameter."""

    grads: dict[nn.Parameter, Tensor]

    def add_clipped(self, coeff: Tensor, keep: Tensor | None, sums: Sums) -> None:
        for p, g in self.grads.items():
            if p not in sums:
                continue
            if keep is not None:
                g = torch.where(_expand(keep, g), g, 0.0)
            sums[p].add_(torch.tensordot(coeff, g, dims=1))


@dataclass
class RowsTerm(ClippedSumTerm):
    """A term over B·K rows (K consecutive rows per sample) that takes per-sample clip factors."""

    term: ClippedSumTerm
    group_size: GroupSize

    def add_clipped(self, coeff: Tensor, keep: Tensor | None, sums: Sums) -> None:
        k = self.group_size if isinstance(self.group_size, int) else self.group_size.to(coeff.device)
        self.term.add_clipped(coeff.repeat_interleave(k), None if keep is None else keep.repeat_interleave(k), sums)


@dataclass
class GhostTerm(ClippedSumTerm):
    """A ghost-normed layer call: its input and (cast) output gradient, and its materialized bias gradients.

    The weight's clipped sum is one weight gradient computed from the c-weighted output gradients.
    """

    rule: ProductRule
    module: nn.Module
    activation: Tensor
    backprops: Tensor
    bias: MaterializedGrads

    def add_clipped(self, coeff: Tensor, keep: Tensor | None, sums: Sums) -> None:
        activation, backprops = self.activation, self.backprops
        if keep is not None:
            activation = torch.where(_expand(keep, activation), activation, 0.0)
            backprops = torch.where(_expand(keep, backprops), backprops, 0.0)
        self.rule.weighted_sum(self.module, activation, backprops * _expand(coeff, backprops), sums)
        self.bias.add_clipped(coeff, keep, sums)


@dataclass
class KeptInputsTerm(GhostTerm):
    """A materialized call's clipped sum from its input and output gradient (`ProductRule._lighter_term`).

    The norms were taken on the materialized per-sample gradients; the sum is the ghost path's weighted
    weight gradient, so only the (smaller) input and output gradient are kept until the clip factors are known.

    That weight gradient adds every sample's T·d·p products in one floating-point reduction, where a norm of
    the per-sample gradient says nothing about their size: a crafted sample whose terms cancel (±H at two
    positions) has a gradient of norm 0, is not clipped, and its ±H erases the other samples' terms in the
    shared sum ((S + H) − H = 0). The samples whose norm is below ``GHOST_CANCELLATION`` of a bound on their
    terms' size (`ProductRule.term_mass`) are therefore left out of the reduction: their weight gradients
    (``exact``, one row per sample of ``exact_rows``) were materialized and normed, and are added as they are.
    """

    exact: MaterializedGrads | None = None
    exact_rows: Tensor | None = None

    def add_clipped(self, coeff: Tensor, keep: Tensor | None, sums: Sums) -> None:
        rows = self.exact_rows
        if rows is None or self.exact is None:
            super().add_clipped(coeff, keep, sums)
            return
        pooled = torch.ones_like(coeff, dtype=torch.bool)
        pooled[rows] = False
        if keep is not None:
            pooled &= keep
        activation = torch.where(_expand(pooled, self.activation), self.activation, 0.0)
        backprops = torch.where(_expand(pooled, self.backprops), self.backprops, 0.0)
        self.rule.weighted_sum(self.module, activation, backprops * _expand(coeff, backprops), sums)
        self.bias.add_clipped(coeff, keep, sums)
        self.exact.add_clipped(coeff[rows], None if keep is None else keep[rows], sums)


# ---------------------------------------------------------------------- rules
class LayerRule(ABC):
    """How the per-sample gradients of one layer type's own trainable parameters are computed.

    Subclasses implement `per_sample_grads`; the default `norms` materializes them. A rule must
    cover exactly the parameters ``module.parameters(recurse=False)`` that require grad, and the
    gradient it returns for sample i must depend on sample i's input and output gradient only.
    """

    def problem(self, module: nn.Module) -> str | None:
        """Why this rule cannot compute ``module``'s per-sample gradients, or None if it can.

        The text follows the layer's name and type in messages: "`decoder.3` (MyLayer) <problem>".
        """
        return None

    def prepare(self, module: nn.Module) -> None:  # noqa: B027 - a hook with nothing to do by default
        """Called once when `PerSampleClipper` adopts ``module``, before any forward pass."""

    @abstractmethod
    def per_sample_grads(self, module: nn.Module, activation: Tensor, backprops: Tensor) -> dict[nn.Parameter, Tensor]:
        """Per-sample gradients of ``module``'s own parameters for one call of the layer.

        Args:
            module: the layer.
            activation: its first input, batch first (cast to the engine's dtype if floating point).
            backprops: the gradient of the loss with respect to its output, batch first (cast like
                ``activation``). The engine multiplies the results by the factor that makes them the
                gradients of the per-sample losses (the batch size for a mean, 1/loss_scale), so a rule must
                be linear in ``backprops``, as every per-sample gradient is (∂L/∂θ = (∂y/∂θ)ᵀ ∂L/∂y).

        Returns:
            (B, *p.shape) per parameter p; parameters that do not require grad may be left out.
        """

    def trained_grads(self, module: nn.Module, activation: Tensor, backprops: Tensor) -> dict[nn.Parameter, Tensor]:
        """`per_sample_grads` restricted to the layer's own trained parameters, in the output gradient's dtype.

        A gradient a rule returns for another layer's parameter is dropped: its norm would be summed apart from
        that layer's own gradient (‖a‖² + ‖b‖² instead of ‖a + b‖²), a looser clip than the bound.
        """
        grads = self.per_sample_grads(module, activation, backprops)
        own = {id(p) for p in module.parameters(recurse=False)}
        return {p: g.to(backprops.dtype) for p, g in grads.items() if p.requires_grad and id(p) in own}

    def norms(self, module: nn.Module, activation: Tensor, backprops: Tensor) -> tuple[Tensor, ClippedSumTerm]:
        """(B,) squared per-sample gradient norms in float64, and what the clipped sum needs.

        Called when the layer ran once in the batch and shares no parameter with another layer
        (otherwise the engine sums `trained_grads` over the calls itself).
        """
        grads = self.trained_grads(module, activation, backprops)
        return sum_of_squares(list(grads.values()), backprops.shape[0], backprops.device), MaterializedGrads(grads)

    def grouped_norms(
        self, module: nn.Module, activation: Tensor, backprops: Tensor, group_size: GroupSize
    ) -> tuple[Tensor, ClippedSumTerm]:
        """Like `norms` for B samples of ``group_size`` consecutive rows each (B·K rows, sample-major).

        ``group_size`` is K, or a (B,) tensor of each sample's row count (groups of different sizes).
        Returns each sample's squared norm of its rows' gradients *summed*, (B,) in float64, and a term
        that takes (B,) per-sample clip factors. By default the rows' gradients are materialized and
        each sample's rows are summed.
        """
        grads = self.group_grads(module, activation, backprops, group_size)
        samples = group_count(group_size, backprops.shape[0])
        return sum_of_squares(list(grads.values()), samples, backprops.device), MaterializedGrads(grads)

    def group_grads(
        self, module: nn.Module, activation: Tensor, backprops: Tensor, group_size: GroupSize
    ) -> dict[nn.Parameter, Tensor]:
        """Each group's gradient, its rows' gradients summed: (B, *p.shape) per trained parameter.

        By default every row's gradient is materialized, then summed; a rule may compute the sums directly.
        """
        return sum_groups(self.trained_grads(module, activation, backprops), group_size)


class ProductRule(LayerRule):
    """A layer whose per-sample weight gradient is a sum of outer products Σ_t g_t a_tᵀ over T positions.

    `norms` takes the ghost norm when T·(d + p) < d·p (d = fan-in, p = fan-out, read from the weight
    as ``weight[0].numel()`` and ``weight.shape[0]``), the layer has one group and its weight is
    trained; it materializes the per-sample gradients otherwise. `grouped_norms` decides the same way
    for a sample's K·T positions over its K views.
    """

    @abstractmethod
    def positions(self, module: nn.Module, activation: Tensor, backprops: Tensor) -> int:
        """T, the number of positions the weight is applied at, per sample."""

    @abstractmethod
    def ghost_views(self, module: Any, activation: Tensor, backprops: Tensor) -> tuple[Tensor, Tensor]:
        """(B, d, T) and (B, p, T): the weight gradient of sample i is their (d × p) product over T, transposed."""

    @abstractmethod
    def weighted_sum(self, module: Any, activation: Tensor, weighted: Tensor, sums: Sums) -> None:
        """Adds the batch's weight gradient computed from the c-weighted output gradients to ``sums``."""

    def bias_grads(self, module: nn.Module, backprops: Tensor) -> Tensor:
        """(B, C_out): each sample's bias gradient, its output gradient summed over the output positions."""
        return backprops.reshape(backprops.shape[0], backprops.shape[1], -1).sum(2)

    def term_mass(self, module: Any, activation: Tensor, backprops: Tensor) -> Tensor:
        """(B,) float64: an upper bound on Σ_t ‖g_t‖·‖a_t‖, the size of a sample's weight-gradient terms.

        Σ_t ‖g_t‖‖a_t‖ ≤ ‖g‖·(Σ_t ‖a_t‖²)^½ (Cauchy–Schwarz) and Σ_t ‖a_t‖² ≤ k·‖x‖², since each input value
        (with the layer's own padding) is read at no more than k positions, k the kernel's number of taps. One pass over
        the layer's input and output gradient, where the exact sum would need the unfolded input.
        """
        x = (
            _conv_geometry(module, activation)[0]
            if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d)
            else activation
        )
        taps = math.prod(getattr(module, "kernel_size", (1,)))
        b = backprops.shape[0]
        return _scaled_norms(x.reshape(b, -1)) * _scaled_norms(backprops.reshape(b, -1)) * math.sqrt(taps)

    def use_ghost(self, module: Any, activation: Tensor, backprops: Tensor, group_size: GroupSize = 1) -> bool:
        """Whether the ghost norm is cheaper than materializing, for this call (K = ``group_size`` rows a sample).

        With groups of different sizes the ghost norm pads every group to the largest: K is that size.
        """
        weight = module.weight
        if getattr(module, "groups", 1) != 1 or not weight.requires_grad:
            return False
        k = group_size if isinstance(group_size, int) else int(group_size.max())
        t = self.positions(module, activation, backprops) * k
        p, d = weight.shape[0], weight[0].numel()
        return t * (d + p) < d * p

    def norms(self, module: nn.Module, activation: Tensor, backprops: Tensor) -> tuple[Tensor, ClippedSumTerm]:
        if not self.use_ghost(module, activation, backprops):
            grads = self.trained_grads(module, activation, backprops)
            b, device = backprops.shape[0], backprops.device
            squares = {p: sum_of_squares([g], b, device) for p, g in grads.items()}
            sq = sum(squares.values(), torch.zeros(b, dtype=torch.float64, device=device))
            return sq, self._lighter_term(module, activation, backprops, grads, squares)
        at, gt = self.ghost_views(module, activation, backprops)
        sq = _ghost_norms(at, gt)
        # The bias gradient is only (B, C_out): materialized, its norm is exact and measured on the very values added
        # to the sum. (Before a normalization layer it is ~0, and a ghost norm would be replaced by its bound.)
        bias = _trained_bias(module)
        bias_grads = {} if bias is None else {bias: self.bias_grads(module, backprops)}
        sq = sq + sum_of_squares(list(bias_grads.values()), backprops.shape[0], backprops.device)
        return sq, GhostTerm(self, module, activation, backprops, MaterializedGrads(bias_grads))

    def _lighter_term(
        self,
        module: Any,
        activation: Tensor,
        backprops: Tensor,
        grads: dict[nn.Parameter, Tensor],
        squares: Mapping[nn.Parameter, Tensor],
    ) -> ClippedSumTerm:
        """What to keep for the clipped sum of a materialized call: the smaller of two equivalent terms.

        The per-sample weight gradients (B·p·d numbers) have served their purpose once their norms are taken;
        the clipped sum Σ_i c_i·g_i is also one weight gradient of the c-weighted output gradients (the ghost
        path's `GhostTerm`), which needs only the layer's input and output gradient. When those are smaller
        (a layer with few positions and many weights: DeepLabV3's dilated convolutions at a 16² map, 6× fewer
        numbers) they are kept and the per-sample gradients freed at once, so that the peak memory holds one
        layer's per-sample gradients instead of every such layer's. The bias keeps its materialized gradients.

        ``grads`` are the call's per-sample gradients, ``squares`` each one's (B,) squared per-sample norms.
        """
        weight = module.weight
        if (
            getattr(module, "groups", 1) != 1
            or weight not in grads
            or activation.numel() + backprops.numel() >= grads[weight].numel()
        ):
            return MaterializedGrads(grads)
        bias = MaterializedGrads({p: g for p, g in grads.items() if p is not weight})
        # The ghost path's guard (`_ghost_norms`): a sample whose weight gradient is far smaller than its terms keeps
        # its materialized gradient, normed and added as it is, and stays out of the pooled reduction.
        # Written so that a NaN bound flags the sample (a NaN never passes a comparison).
        cancelling = ~(squares[weight].sqrt() >= GHOST_CANCELLATION * self.term_mass(module, activation, backprops))
        if not bool(cancelling.any()):
            return KeptInputsTerm(self, module, activation, backprops, bias)
        rows = torch.nonzero(cancelling).flatten()
        exact = MaterializedGrads({weight: grads[weight][rows]})
        return KeptInputsTerm(self, module, activation, backprops, bias, exact, rows)

    def grouped_norms(
        self, module: nn.Module, activation: Tensor, backprops: Tensor, group_size: GroupSize
    ) -> tuple[Tensor, ClippedSumTerm]:
        if not self.use_ghost(module, activation, backprops, group_size):
            return super().grouped_norms(module, activation, backprops, group_size)
        # A sample's weight gradient Σ_k Σ_t g_kt a_ktᵀ is one product over the K·T positions of its views.
        at, gt = self.ghost_views(module, activation, backprops)
        sq = _ghost_norms(_join_groups(at, group_size), _join_groups(gt, group_size))
        bias = _trained_bias(module)
        bias_grads = {} if bias is None else {bias: self.bias_grads(module, backprops)}
        samples = group_count(group_size, backprops.shape[0])
        sq = sq + sum_of_squares(list(sum_groups(bias_grads, group_size).values()), samples, backprops.device)
        # The clipped sum Σ_i c_i Σ_k g_ik is the rows' sum with each row weighted by its sample's factor.
        term = GhostTerm(self, module, activation, backprops, MaterializedGrads(bias_grads))
        return sq, RowsTerm(term, group_size)


class LinearRule(ProductRule):
    """nn.Linear on inputs of any shape (B, ..., in_features): the positions are the dimensions between."""

    def positions(self, module: nn.Module, activation: Tensor, backprops: Tensor) -> int:
        return backprops[0].numel() // backprops.shape[-1]

    def ghost_views(self, module: Any, activation: Tensor, backprops: Tensor) -> tuple[Tensor, Tensor]:
        a, g = _linear_views(activation, backprops)
        return a.transpose(1, 2), g.transpose(1, 2)

    def bias_grads(self, module: nn.Module, backprops: Tensor) -> Tensor:
        return backprops.reshape(backprops.shape[0], -1, backprops.shape[-1]).sum(1)

    def per_sample_grads(self, module: Any, activation: Tensor, backprops: Tensor) -> dict[nn.Parameter, Tensor]:
        a, g = _linear_views(activation, backprops)
        return _weight_and_bias(module, lambda: torch.bmm(g.transpose(1, 2), a), lambda: g.sum(1))

    def group_grads(
        self, module: Any, activation: Tensor, backprops: Tensor, group_size: GroupSize
    ) -> dict[nn.Parameter, Tensor]:
        # A group's weight gradient is one product over the positions of all its rows: no per-row gradient is formed.
        if isinstance(group_size, int) and group_size == 1:
            return self.trained_grads(module, activation, backprops)
        a, g = _linear_views(activation, backprops)
        a, g = _pad_groups(a, group_size), _pad_groups(g, group_size)
        a, g = a.reshape(a.shape[0], -1, a.shape[-1]), g.reshape(g.shape[0], -1, g.shape[-1])
        return _weight_and_bias(module, lambda: torch.bmm(g.transpose(1, 2), a), lambda: g.sum(1))

    def weighted_sum(self, module: Any, activation: Tensor, weighted: Tensor, sums: Sums) -> None:
        if module.weight in sums:
            a, g = _linear_views(activation, weighted)
            sums[module.weight].add_(g.reshape(-1, g.shape[-1]).t() @ a.reshape(-1, a.shape[-1]))


class _ConvolutionRule(ProductRule):
    """What a convolution and a transposed convolution share: the weight gradient is one weight-gradient convolution.

    A subclass says how the layer's input is laid out for it (`_geometry`); a per-sample weight gradient folds the
    batch into the convolution's groups, a group's sums its rows as the convolution's batch.
    """

    @abstractmethod
    def _geometry(
        self, module: Any, activation: Tensor, backprops: Tensor
    ) -> tuple[Tensor, Sequence[int], list[int] | None]:
        """The input as the weight-gradient convolution reads it, its padding, and the output padding if transposed."""

    def _taps(self, module: Any, x: Tensor, grad: Tensor, padding: Sequence[int]) -> list[_Tap] | None:
        """The live taps if the weight gradient is better formed tap by tap (`_live_taps`); None otherwise."""
        return None

    def _weight_grad(self, module: Any, activation: Tensor, grad: Tensor, per_sample: bool) -> Tensor:
        x, padding, output_padding = self._geometry(module, activation, grad)
        taps = self._taps(module, x, grad, padding)
        if taps is None:
            return _conv_weight_grad(module, x, grad, padding, output_padding, per_sample=per_sample)
        # Mostly padding: one product per live tap (batch and positions contracted for the sum).
        return _tapwise_weight_grad(module, x, grad, taps) if per_sample else _tapwise_weight_sum(module, x, grad, taps)

    def per_sample_grads(self, module: Any, activation: Tensor, backprops: Tensor) -> dict[nn.Parameter, Tensor]:
        return _weight_and_bias(
            module,
            lambda: self._weight_grad(module, activation, backprops, per_sample=True),
            lambda: self.bias_grads(module, backprops),
        )

    def group_grads(
        self, module: Any, activation: Tensor, backprops: Tensor, group_size: GroupSize
    ) -> dict[nn.Parameter, Tensor]:
        # One weight-gradient convolution with the groups folded into the convolution's groups and their rows as
        # its batch (summed by the convolution itself): no per-row gradient is formed.
        if isinstance(group_size, int) and group_size == 1:
            return self.trained_grads(module, activation, backprops)

        def weight_grad() -> Tensor:
            x, padding, output_padding = self._geometry(module, activation, backprops)
            return _conv_group_weight_grad(
                module, _pad_groups(x, group_size), _pad_groups(backprops, group_size), padding, output_padding
            )

        def bias_grad() -> Tensor:
            return sum_groups({module.bias: self.bias_grads(module, backprops)}, group_size)[module.bias]

        return _weight_and_bias(module, weight_grad, bias_grad)

    def weighted_sum(self, module: Any, activation: Tensor, weighted: Tensor, sums: Sums) -> None:
        if module.weight in sums:
            sums[module.weight].add_(self._weight_grad(module, activation, weighted, per_sample=False))


class ConvRule(_ConvolutionRule):
    """nn.Conv1d/2d/3d with any stride, dilation, groups, padding (numbers, 'same', 'valid') and padding mode.

    Materialized per-sample gradients are one grouped weight-gradient convolution with the batch
    folded into the groups (B·groups groups): as fast as the layer's ordinary weight gradient, with
    no unfolded input in memory. Grouped convolutions always materialize (per group they are small).

    A 2-d convolution whose kernel taps mostly read zero padding (a dilation near or above the input's
    size: DeepLabV3's ASPP at rates 12–36 on a 16² map, where every tap but the centre falls outside)
    materializes tap by tap instead, each tap's gradient a batched product over only the output positions
    where it reads the input (`_live_taps`); a tap that never does has a gradient of exactly zero. The same
    gradients, without the multiplications by padding.
    """

    def positions(self, module: nn.Module, activation: Tensor, backprops: Tensor) -> int:
        return backprops[0].numel() // backprops.shape[1]

    def ghost_views(self, module: Any, activation: Tensor, backprops: Tensor) -> tuple[Tensor, Tensor]:
        x, padding = _conv_geometry(module, activation)
        unfolded = _unfold(x, module.kernel_size, module.dilation, padding, module.stride)
        return unfolded, backprops.reshape(backprops.shape[0], backprops.shape[1], -1)

    def _geometry(
        self, module: Any, activation: Tensor, backprops: Tensor
    ) -> tuple[Tensor, Sequence[int], list[int] | None]:
        x, padding = _conv_geometry(module, activation)
        return x, padding, None

    def _taps(self, module: Any, x: Tensor, grad: Tensor, padding: Sequence[int]) -> list[_Tap] | None:
        return _live_taps(module, x, grad, padding)


class ConvTransposeRule(_ConvolutionRule):
    """nn.ConvTranspose1d/2d/3d with any stride, padding, output padding, dilation and groups.

    A transposed convolution is the adjoint of the convolution with the same weight, stride,
    padding and dilation; per sample its weight gradient is Σ_t x_t u_tᵀ over the *input* positions
    t, where u_t is the output gradient over the receptive field of t. Materialized, it is one
    transposed weight-gradient convolution with the batch folded into the groups (B·groups groups).
    The output padding is read from the actual shapes, so a call with ``output_size=`` is handled.
    """

    def positions(self, module: nn.Module, activation: Tensor, backprops: Tensor) -> int:
        return activation[0, 0].numel()

    def ghost_views(self, module: Any, activation: Tensor, backprops: Tensor) -> tuple[Tensor, Tensor]:
        b = activation.shape[0]
        unfolded = _unfold(backprops, module.kernel_size, module.dilation, module.padding, module.stride)
        # The convolution over the output gradient has at least as many positions as the input (more when the
        # output padding is ≥ the stride): the extra positions meet zero input.
        counts = [
            (n + 2 * p - d * (k - 1) - 1) // s + 1
            for n, p, d, k, s in zip(
                backprops.shape[2:], module.padding, module.dilation, module.kernel_size, module.stride
            )
        ]
        extra = [c - n for c, n in zip(counts, activation.shape[2:])]
        if any(e < 0 for e in extra):
            raise UnsupportedModelError(
                f"`{type(module).__name__}`: an input of spatial shape {tuple(activation.shape[2:])} gave an output of "
                f"{tuple(backprops.shape[2:])}, smaller than its stride, padding and dilation allow. HINT: report this "
                "layer configuration; freezing the layer avoids it."
            )
        pads: list[int] = []
        for e in reversed(extra):
            pads += [0, e]
        x = F.pad(activation, pads) if any(extra) else activation
        assert unfolded.shape[2] == x[0, 0].numel()  # the adjoint's positions are the (padded) input's
        return unfolded, x.reshape(b, x.shape[1], -1)

    def _geometry(
        self, module: Any, activation: Tensor, backprops: Tensor
    ) -> tuple[Tensor, Sequence[int], list[int] | None]:
        return activation, module.padding, _output_padding(module, activation, backprops)


class PReLURule(LayerRule):
    """nn.PReLU: y = max(0, x) + w·min(0, x), so ∂L/∂w = Σ_positions g·min(0, x) (per channel if w has C entries).

    Exact and cheaper than the functorch rule, which re-runs the layer's forward per sample
    (MONAI's U-Net has a PReLU after every convolution).
    """

    def per_sample_grads(self, module: Any, activation: Tensor, backprops: Tensor) -> dict[nn.Parameter, Tensor]:
        weight = module.weight
        if not weight.requires_grad:
            return {}
        product = backprops * activation.clamp(max=0)
        b = product.shape[0]
        if weight.numel() == 1 or product.dim() < 2:
            return {weight: product.reshape(b, -1).sum(1).reshape(b, *weight.shape)}
        return {weight: product.reshape(b, product.shape[1], -1).sum(2)}


class BatchNormRule(LayerRule):
    """BatchNorm in eval mode: y = x̂·w + b per channel with x̂ = (x − μ)/√(var + eps) from the *running* statistics.

    In eval mode a BatchNorm is a fixed per-channel affine map of each sample: it mixes nothing, and
    its statistics are never updated. So ∂L/∂w = Σ_positions g·x̂ and ∂L/∂b = Σ_positions g, per
    channel (dimension 1). In training mode it normalizes with the statistics of the batch (every
    sample's output depends on the others) and updates its running statistics from private data:
    refused, as is a layer without running statistics (``track_running_stats=False``), which uses the
    batch's statistics in eval mode too.
    """

    def problem(self, module: nn.Module) -> str | None:
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            return None
        return _batch_norm_problem(module)

    def per_sample_grads(self, module: Any, activation: Tensor, backprops: Tensor) -> dict[nn.Parameter, Tensor]:
        problem = _batch_norm_problem(module)
        if problem is not None:  # the mode is checked again per call: it may have changed since the engine was built
            kind = type(module).__name__
            raise UnsupportedModelError(
                f"`{kind}` {problem}. HINT: keep it in eval mode (override LightningModule.train, as "
                "ImageClassifier(trainable=[...]) does), freeze it, or replace it with GroupNorm."
            )
        b, c = backprops.shape[0], backprops.shape[1]
        grads: dict[nn.Parameter, Tensor] = {}
        weight = module.weight
        if isinstance(weight, nn.Parameter) and weight.requires_grad:
            shape = (1, c) + (1,) * (activation.dim() - 2)
            mean = module.running_mean.to(activation.dtype).view(shape)
            std = (module.running_var.to(activation.dtype) + module.eps).sqrt().view(shape)
            grads[weight] = (backprops * ((activation - mean) / std)).reshape(b, c, -1).sum(2)
        bias = _trained_bias(module)
        if bias is not None:
            grads[bias] = backprops.reshape(b, c, -1).sum(2)
        return grads


def _batch_norm_problem(module: Any) -> str | None:
    if module.training:
        return (
            "is a trainable BatchNorm in training mode: it normalizes with the statistics of the batch, mixing its "
            "samples, and updates its running statistics from private data"
        )
    if module.running_mean is None or module.running_var is None:
        return (
            "is a trainable BatchNorm without running statistics (track_running_stats=False): it normalizes with the "
            "statistics of the batch even in eval mode, mixing its samples"
        )
    return None


class OpacusRule(LayerRule):
    """One of Opacus' registered per-layer grad samplers (GroupNorm, LayerNorm, Embedding, ...).

    Args:
        sampler: ``sampler(module, [activation], backprops)`` → {parameter: (B, *shape)}, as registered
            with ``opacus.grad_sample.register_grad_sampler``.
    """

    def __init__(self, sampler: Callable[..., dict[nn.Parameter, Tensor]]) -> None:
        self.sampler = sampler

    def per_sample_grads(self, module: nn.Module, activation: Tensor, backprops: Tensor) -> dict[nn.Parameter, Tensor]:
        grads = dict(self.sampler(module, [activation], backprops))
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            # Opacus also gives the padding row a gradient; nn.Embedding gives it none.
            table = cast(nn.Parameter, module.weight)
            if table in grads:
                rows = grads[table].clone()
                rows[:, module.padding_idx] = 0.0
                grads[table] = rows
        return grads


class FunctorchRule(LayerRule):
    """The generic rule: ``torch.func.vmap`` of the layer's own forward and backward per sample (Opacus' functorch).

    It handles any leaf module whose forward uses its parameters and its first input only; it
    cannot handle modules with buffers or sub-modules.
    """

    def problem(self, module: nn.Module) -> str | None:
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            return None
        buffers = [name for name, _ in module.named_buffers(recurse=False)]
        children = [name for name, _ in module.named_children()]
        if not buffers and not children:
            return None
        held = " and ".join(
            f"{what} {names[:3]}" for what, names in (("buffers", buffers), ("sub-modules", children)) if names
        )
        return (
            "has trainable parameters but no per-sample gradient rule, and it holds "
            f"{held}, so the generic (functorch) rule cannot handle it either"
        )

    def prepare(self, module: nn.Module) -> None:
        from opacus.grad_sample.functorch import prepare_layer

        prepare_layer(module)

    def per_sample_grads(self, module: nn.Module, activation: Tensor, backprops: Tensor) -> dict[nn.Parameter, Tensor]:
        from opacus.grad_sample.functorch import ft_compute_per_sample_gradient

        return dict(ft_compute_per_sample_gradient(module, [activation], backprops))


# ---------------------------------------------------------------------- the registry
_REGISTRY: dict[type[nn.Module], LayerRule] = {}
_FUNCTORCH = FunctorchRule()


def register_rule(layer_type: type[nn.Module], rule: LayerRule) -> None:
    """Makes ``rule`` compute the per-sample gradients of ``layer_type`` and its subclasses (replacing any).

    The rule is trusted: it decides each sample's gradient norm, so a wrong rule breaks the privacy
    guarantee. Check it against a naive loop over samples before training with it.

    Args:
        layer_type: an ``nn.Module`` subclass; subclasses without a rule of their own use it too.
        rule: the rule.

    Raises:
        PrivacyConfigError: ``layer_type`` is not an nn.Module subclass or ``rule`` not a `LayerRule`.

    Example:
        >>> class Scale(nn.Module):
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.scale = nn.Parameter(torch.ones(()))
        ...     def forward(self, x: Tensor) -> Tensor:
        ...         return x * self.scale
        >>> class ScaleRule(LayerRule):
        ...     def per_sample_grads(self, module, activation, backprops):
        ...         return {module.scale: (activation * backprops).flatten(1).sum(1)}
        >>> register_rule(Scale, ScaleRule())
        >>> type(rule_for(Scale())).__name__
        'ScaleRule'
        >>> type(unregister_rule(Scale)).__name__, type(rule_for(Scale())).__name__
        ('ScaleRule', 'FunctorchRule')
    """
    if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
        raise PrivacyConfigError(
            f"`register_rule(layer_type={layer_type!r})`: layer_type must be an nn.Module subclass, found "
            f"{type(layer_type).__name__}. HINT: pass the class itself, e.g. register_rule(MyLayer, MyRule())."
        )
    if not isinstance(rule, LayerRule):
        raise PrivacyConfigError(
            f"`register_rule({layer_type.__name__}, rule={rule!r})`: rule must be a LayerRule, found "
            f"{type(rule).__name__}. HINT: subclass lightning_dp.sanitization.rules.LayerRule and implement "
            "per_sample_grads."
        )
    _REGISTRY[layer_type] = rule


def unregister_rule(layer_type: type[nn.Module]) -> LayerRule | None:
    """Removes the rule registered for exactly ``layer_type`` and returns it (None if there was none)."""
    return _REGISTRY.pop(layer_type, None)


def registered_rule(module: nn.Module) -> LayerRule | None:
    """The rule registered for ``type(module)`` or its nearest registered base class; None if there is none.

    A subclass that overrides ``forward`` computes something else than its base class: the base class's rule
    does not apply to it (it falls back to Opacus' sampler for its exact type, or the functorch rule).
    """
    kind = type(module)
    for cls in kind.__mro__:
        rule = _REGISTRY.get(cls)
        if rule is not None:
            return rule if cls is kind or getattr(kind, "forward", None) is getattr(cls, "forward", None) else None
    return None


def _candidate(module: nn.Module) -> LayerRule:
    rule = registered_rule(module)
    if rule is not None:
        return rule
    from opacus.grad_sample import GradSampleModule

    sampler = GradSampleModule.GRAD_SAMPLERS.get(type(module))
    return OpacusRule(sampler) if sampler is not None else _FUNCTORCH


def rule_problem(module: nn.Module) -> str | None:
    """Why no rule can compute ``module``'s per-sample gradients, or None if one can (see `rule_for`).

    Example:
        >>> rule_problem(nn.PReLU()) is None
        True
        >>> rule_problem(nn.BatchNorm2d(4))[:46]
        'is a trainable BatchNorm in training mode: it '
        >>> rule_problem(nn.BatchNorm2d(4).eval()) is None
        True
    """
    return _candidate(module).problem(module)


def has_rule(module: nn.Module) -> bool:
    """Whether the per-sample gradients of ``module``'s own trainable parameters can be computed.

    Example:
        >>> has_rule(nn.ConvTranspose3d(2, 2, 2, stride=2)), has_rule(nn.BatchNorm1d(3))
        (True, False)
    """
    return rule_problem(module) is None


def rule_for(module: nn.Module, name: str | None = None) -> LayerRule:
    """The rule that computes the per-sample gradients of ``module``'s own trainable parameters.

    Args:
        module: the layer.
        name: its qualified name in the model, for the error message.

    Returns:
        The registered rule of its type (or nearest base class), else Opacus' grad sampler for its
        type, else the functorch rule.

    Raises:
        UnsupportedModelError: no rule can handle it; the message names the layer and the fix.

    Example:
        >>> [type(rule_for(m)).__name__ for m in (nn.Linear(2, 2), nn.Conv2d(1, 1, 3), nn.LayerNorm(4))]
        ['LinearRule', 'ConvRule', 'OpacusRule']
    """
    rule = _candidate(module)
    problem = rule.problem(module)
    if problem is not None:
        kind = type(module).__name__
        raise UnsupportedModelError(
            f"`{name or kind}` ({kind}) {problem}. HINT: freeze it, replace it with standard layers, or register a "
            f"rule for its type: lightning_dp.sanitization.rules.register_rule({kind}, rule) (an Opacus grad sampler, "
            "opacus.grad_sample.register_grad_sampler, works too)."
        )
    return rule


register_rule(nn.Linear, LinearRule())
for _conv in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    register_rule(_conv, ConvRule())
for _transposed in (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d):
    register_rule(_transposed, ConvTransposeRule())
register_rule(nn.PReLU, PReLURule())
for _batch_norm in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm):
    register_rule(_batch_norm, BatchNormRule())


# ---------------------------------------------------------------------- helpers
def sum_of_squares(tensors: Sequence[Tensor], batch_size: int, device: torch.device) -> Tensor:
    """Per-sample Σ of squares of (B, ...) tensors, as float64; recomputed in float64 where fp32 overflowed."""
    if not tensors:
        return torch.zeros(batch_size, dtype=torch.float64, device=device)
    sq = torch.stack([t.reshape(batch_size, -1).pow(2).sum(1) for t in tensors]).sum(0).double()
    if not bool(torch.isfinite(sq).all()):
        sq = torch.stack([t.reshape(batch_size, -1).double().pow(2).sum(1) for t in tensors]).sum(0)
    return sq


def _scaled_norms(rows: Tensor) -> Tensor:
    """(B,) float64 L2 norms of (B, n) rows, each taken on the row divided by its largest magnitude.

    In the rows' own dtype (no float64 copy of a large input), with neither overflow (1e31 squared) nor underflow
    (1e-23 squared) along the way: an fp32 norm of 1e31·… is inf and of 1e-23·… is 0, and inf·0 is NaN.
    """
    largest = rows.abs().amax(dim=1, keepdim=True)
    safe = torch.where(largest > 0, largest, torch.ones_like(largest))
    return (rows / safe).norm(dim=1).double() * largest.flatten().double()


def group_count(group_size: GroupSize, rows: int) -> int:
    """B, the number of samples of a batch of ``rows`` rows grouped by ``group_size``."""
    return rows // group_size if isinstance(group_size, int) else len(group_size)


def _group_index(sizes: Tensor, device: torch.device) -> Tensor:
    """(R,) the sample of each row, for (B,) row counts."""
    sizes = sizes.to(device)
    return torch.arange(len(sizes), device=device).repeat_interleave(sizes)


def sum_groups(grads: Mapping[nn.Parameter, Tensor], group_size: GroupSize) -> dict[nn.Parameter, Tensor]:
    """(R, *shape) per-row gradients as (B, *shape): each sample's consecutive rows summed (K each, or (B,) counts)."""
    if isinstance(group_size, int):
        if group_size == 1:
            return dict(grads)
        return {p: g.reshape(-1, group_size, *g.shape[1:]).sum(1) for p, g in grads.items()}
    out = {}
    for p, g in grads.items():
        index = _group_index(group_size, g.device)
        out[p] = torch.zeros(len(group_size), *g.shape[1:], dtype=g.dtype, device=g.device).index_add_(0, index, g)
    return out


def _join_groups(t: Tensor, group_size: GroupSize) -> Tensor:
    """(R, d, T) as (B, d, K·T): a sample's K rows' positions side by side.

    With (B,) row counts K is the largest count, and a smaller group's missing rows are zeros (they add nothing
    to Σ_t g_t a_tᵀ, nor to its ghost norm).
    """
    rows, d, positions = t.shape
    if isinstance(group_size, int):
        k = group_size
        return t.reshape(rows // k, k, d, positions).transpose(1, 2).reshape(-1, d, k * positions)
    padded = _pad_groups(t, group_size)
    return padded.transpose(1, 2).reshape(-1, d, padded.shape[1] * positions)


def _expand(mask: Tensor, like: Tensor) -> Tensor:
    return mask.view(-1, *([1] * (like.dim() - 1)))


def _trained_bias(module: nn.Module) -> nn.Parameter | None:
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, nn.Parameter) and bias.requires_grad else None


def _weight_and_bias(
    module: Any, weight_grad: Callable[[], Tensor], bias_grad: Callable[[], Tensor]
) -> dict[nn.Parameter, Tensor]:
    """A weight-and-bias layer's gradients, formed for the parameters that are trained (weight first)."""
    grads: dict[nn.Parameter, Tensor] = {}
    if module.weight.requires_grad:
        grads[module.weight] = weight_grad()
    bias = _trained_bias(module)
    if bias is not None:
        grads[bias] = bias_grad()
    return grads


def _conv_weight_grad(
    module: Any,
    x: Tensor,
    grad: Tensor,
    padding: Sequence[int],
    output_padding: list[int] | None,
    per_sample: bool,
) -> Tensor:
    """A convolution's weight gradient from its input ``x`` and output gradient ``grad``.

    Transposed if ``output_padding`` is given. ``per_sample``: shape (B, *weight.shape), the batch folded
    into the groups (B·groups groups); otherwise summed over the batch.
    """
    b, weight = x.shape[0], module.weight
    transposed = output_padding is not None
    if per_sample:
        x, grad, groups = _fold_batch(x), _fold_batch(grad), b * module.groups
        shape = (b * weight.shape[0], *weight.shape[1:])
    else:
        groups, shape = module.groups, tuple(weight.shape)
    _, weight_grad, _ = torch.ops.aten.convolution_backward(
        grad,
        x,
        torch.empty(shape, dtype=x.dtype, device=x.device),  # its shape only: the weight gradient ignores its values
        None,
        list(module.stride),
        list(padding),
        list(module.dilation),
        transposed,
        output_padding if transposed else [0] * (x.dim() - 2),
        groups,
        [False, True, False],
    )
    return weight_grad.reshape(b, *weight.shape) if per_sample else weight_grad


TAPWISE_LIVE_FRACTION = 0.5
"""A 2-d convolution materializes tap by tap when at most this share of its kernel's reads fall on the input."""


@dataclass(frozen=True)
class _Tap:
    """One kernel tap (kh, kw) and the output rows/columns where it reads the input, and from where in it."""

    kh: int
    kw: int
    rows: slice  # output rows
    cols: slice  # output columns
    in_rows: slice  # the input rows they read (stride steps)
    in_cols: slice


def _tap_span(size_in: int, size_out: int, k: int, stride: int, dilation: int, pad: int) -> tuple[slice, slice] | None:
    """The output positions i with 0 ≤ i·stride − pad + k·dilation < size_in, and the input positions they read."""
    offset = k * dilation - pad
    first = max(0, -(offset // stride))  # the smallest i ≥ 0 with i·stride + offset ≥ 0
    last = min(size_out - 1, (size_in - 1 - offset) // stride)
    if last < first:
        return None
    start = first * stride + offset
    return slice(first, last + 1), slice(start, start + (last - first) * stride + 1, stride)


def _live_taps(
    module: Any, x: Tensor, backprops: Tensor, padding: Sequence[int], live_fraction: float = TAPWISE_LIVE_FRACTION
) -> list[_Tap] | None:
    """The taps of a 2-d, ungrouped convolution that read the input somewhere, if few of its reads do; else None.

    ``x`` is the input as `_conv_geometry` returns it (explicitly padded for other padding modes, in which case
    ``padding`` is 0 and the padded values count as input). None when the layer is not a 2-d ungrouped
    convolution or more than ``live_fraction`` of its reads fall on the input (the grouped weight-gradient
    convolution is faster there).
    """
    if x.dim() != 4 or module.groups != 1 or x.dtype != backprops.dtype:
        return None
    (kh_size, kw_size), (sh, sw), (dh, dw) = module.kernel_size, module.stride, module.dilation
    (h, w), (ho, wo) = x.shape[2:], backprops.shape[2:]
    row_spans = [_tap_span(h, ho, k, sh, dh, padding[0]) for k in range(kh_size)]
    col_spans = [_tap_span(w, wo, k, sw, dw, padding[1]) for k in range(kw_size)]
    live = sum(r[0].stop - r[0].start for r in row_spans if r) * sum(c[0].stop - c[0].start for c in col_spans if c)
    if live > live_fraction * kh_size * kw_size * ho * wo:
        return None
    return [
        _Tap(kh, kw, r[0], c[0], r[1], c[1])
        for kh, r in enumerate(row_spans)
        if r is not None
        for kw, c in enumerate(col_spans)
        if c is not None
    ]


def _tapwise_weight_grad(module: Any, x: Tensor, grad: Tensor, taps: Sequence[_Tap]) -> Tensor:
    """(B, *weight.shape): each sample's weight gradient, tap by tap over the positions where the tap reads input."""
    b, weight = x.shape[0], module.weight
    out = torch.zeros(b, *weight.shape, dtype=grad.dtype, device=grad.device)
    for tap in taps:
        g = grad[:, :, tap.rows, tap.cols].reshape(b, grad.shape[1], -1)
        a = x[:, :, tap.in_rows, tap.in_cols].reshape(b, x.shape[1], -1)
        out[:, :, :, tap.kh, tap.kw] = torch.bmm(g, a.transpose(1, 2))
    return out


def _tapwise_weight_sum(module: Any, x: Tensor, grad: Tensor, taps: Sequence[_Tap]) -> Tensor:
    """The batch's weight gradient (summed over the samples), tap by tap like `_tapwise_weight_grad`."""
    weight = module.weight
    out = torch.zeros(weight.shape, dtype=grad.dtype, device=grad.device)
    for tap in taps:
        g = grad[:, :, tap.rows, tap.cols].transpose(0, 1).reshape(grad.shape[1], -1)
        a = x[:, :, tap.in_rows, tap.in_cols].transpose(0, 1).reshape(x.shape[1], -1)
        out[:, :, tap.kh, tap.kw] = g @ a.t()
    return out


def _conv_group_weight_grad(
    module: Any, x: Tensor, grad: Tensor, padding: Sequence[int], output_padding: list[int] | None
) -> Tensor:
    """(B, *weight.shape): each group's weight gradient summed over its K rows, from (B, K, C, *S) inputs and gradients.

    The groups are folded into the channels (B·groups convolution groups) and the K rows are the convolution's batch,
    over which its weight gradient sums. A padding row (zeros) adds nothing.
    """
    b, k = x.shape[0], x.shape[1]
    weight = module.weight
    fold = lambda t: t.transpose(0, 1).reshape(k, b * t.shape[2], *t.shape[3:])  # noqa: E731
    transposed = output_padding is not None
    _, weight_grad, _ = torch.ops.aten.convolution_backward(
        fold(grad),
        fold(x),
        torch.empty((b * weight.shape[0], *weight.shape[1:]), dtype=x.dtype, device=x.device),
        None,
        list(module.stride),
        list(padding),
        list(module.dilation),
        transposed,
        output_padding if transposed else [0] * (x.dim() - 3),
        b * module.groups,
        [False, True, False],
    )
    return weight_grad.reshape(b, *weight.shape)


def _pad_groups(t: Tensor, group_size: GroupSize) -> Tensor:
    """(R, *rest) rows as (B, K, *rest): each sample's rows, groups shorter than the largest K padded with zero rows."""
    if isinstance(group_size, int):
        return t.reshape(-1, group_size, *t.shape[1:])
    sizes = group_size.to(t.device)
    index = _group_index(sizes, t.device)
    slot = torch.arange(t.shape[0], device=t.device) - (torch.cumsum(sizes, 0) - sizes)[index]
    padded = torch.zeros(len(sizes), int(sizes.max()), *t.shape[1:], dtype=t.dtype, device=t.device)
    padded[index, slot] = t
    return padded


def _fold_batch(t: Tensor) -> Tensor:
    """(B, C, *S) as (1, B·C, *S): the batch folded into the channels (for a B-times grouped convolution)."""
    return t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:])


def _linear_views(activation: Tensor, backprops: Tensor) -> tuple[Tensor, Tensor]:
    b = activation.shape[0]
    return activation.reshape(b, -1, activation.shape[-1]), backprops.reshape(b, -1, backprops.shape[-1])


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


def _unfold(
    x: Tensor,
    kernel: Sequence[int],
    dilation: Sequence[int],
    padding: Sequence[int],
    stride: Sequence[int],
) -> Tensor:
    """(B, C·k…, T): the zero-padded receptive field of every output position of a 1-, 2- or 3-d convolution."""
    if x.dim() == 3:  # 1-d as 2-d of height 1
        return F.unfold(
            x.unsqueeze(2),
            (1, kernel[0]),
            dilation=(1, dilation[0]),
            padding=(0, padding[0]),
            stride=(1, stride[0]),
        )
    if x.dim() == 4:
        return F.unfold(x, tuple(kernel), dilation=tuple(dilation), padding=tuple(padding), stride=tuple(stride))
    from opacus.utils.tensor_utils import unfold3d

    return unfold3d(
        x, kernel_size=tuple(kernel), padding=tuple(padding), stride=tuple(stride), dilation=tuple(dilation)
    )


def _output_padding(module: Any, activation: Tensor, backprops: Tensor) -> list[int]:
    """The output padding of this call of a transposed convolution, from its input and output shapes."""
    return [
        o - ((i - 1) * s - 2 * p + d * (k - 1) + 1)
        for i, o, s, p, d, k in zip(
            activation.shape[2:],
            backprops.shape[2:],
            module.stride,
            module.padding,
            module.dilation,
            module.kernel_size,
        )
    ]


def _ghost_norms(at: Tensor, gt: Tensor) -> Tensor:
    """‖Σ_t g_t a_tᵀ‖² per sample, in float64, without forming the gradients.

    Computed in float64 (the Gram products cancel when a sample's gradient terms nearly do), and
    replaced by the squared triangle-inequality bound where they cancel by more than
    ``GHOST_CANCELLATION``, so the norm never falls short of the contribution actually added.
    """
    at, gt = at.double(), gt.double()
    if at.shape[2] == 1:
        sq = at.pow(2).sum((1, 2)) * gt.pow(2).sum((1, 2))
    else:
        sq = (torch.bmm(at.transpose(1, 2), at) * torch.bmm(gt.transpose(1, 2), gt)).sum((1, 2))
    return _guard(sq, (at.norm(dim=1) * gt.norm(dim=1)).sum(1))


def _guard(sq: Tensor, bound: Tensor) -> Tensor:
    return torch.where(sq < (GHOST_CANCELLATION * bound) ** 2, bound**2, sq)
