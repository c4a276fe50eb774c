"""Every buffer of a module, whatever its dtype: what it was, whether a step changed it, and putting it back.

A buffer is in ``state_dict()`` and in a published checkpoint whatever its dtype: a running class count
(``int64``) or a flag set from the labels (``bool``) is as much a release as a running mean. A step can change
a buffer in place (``self.count += …``) or re-assign it (``self.count = self.count + …``: the module then holds a
new tensor and the old one is unchanged), or register a new one; all three are seen here, by name.

So is a parameter, whatever its ``requires_grad`` says: a weight average or a running input mean kept in an
``nn.Parameter`` and updated by ``training_step`` is in the checkpoint too. With ``parameters=True`` a snapshot
also holds every parameter by value (restored like buffers). By value, not by version counter: a write through
``.data`` (``self.ema.data.mul_(…)``) bumps none.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["BufferSnapshot", "reseat", "reseat_parameters", "same_values"]


def same_values(a: Tensor, b: Tensor) -> bool:
    """Same dtype, shape and values, a NaN equal to a NaN (a constant NaN in a buffer is not a change)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()) or not torch.equal(a.isnan(), b.isnan()):
        return False
    return torch.equal(a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0))


def _same(now: Tensor, old: Tensor) -> bool:
    """`same_values`, False for a tensor that cannot be compared (a leftover of a torch.func transform)."""
    try:
        return same_values(now, old)
    except RuntimeError:
        return False


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), leaf


class BufferSnapshot:
    """The buffers of ``module`` (all dtypes) as they are now, by qualified name.

    Args:
        module: the module.
        names: the buffers to hold (qualified names); all of them if None. Only then is a buffer registered
            after the snapshot counted as a change (and removed by `restore`).
        parameters: also hold every parameter by value (frozen or trainable: a write, a re-assignment or a parameter
            registered since is a change, and `restore` undoes it).

    Example:
        >>> net = nn.BatchNorm1d(2)
        >>> snap = BufferSnapshot(net)
        >>> _ = net(torch.randn(4, 2))  # training mode: running statistics and the int64 step count change
        >>> snap.changed()
        ['running_mean', 'running_var', 'num_batches_tracked']
        >>> snap.restore(); snap.changed(), int(net.num_batches_tracked)
        ([], 0)
    """

    def __init__(self, module: nn.Module, names: list[str] | None = None, parameters: bool = False) -> None:
        self.module = module
        self.complete = names is None
        named = dict(module.named_buffers())
        chosen = list(named) if names is None else names
        self.entries = [(name, named[name], named[name].detach().clone()) for name in chosen]
        params = dict(module.named_parameters()) if parameters else {}
        #: Parameters, by value: (name, the Parameter, its value).
        self.params = [(n, p, p.detach().clone()) for n, p in params.items()]
        self.parameters = parameters

    def tensors(self) -> list[Tensor]:
        """The held buffers (the tensor objects that were in the module at the snapshot)."""
        return [ref for _, ref, _ in self.entries]

    def changed(self) -> list[str]:
        """Names of the buffers whose value, dtype or shape differs now (re-assigned, removed or registered)."""
        now = dict(self.module.named_buffers())
        changed = [name for name, _, old in self.entries if name not in now or not _same(now[name], old)]
        if self.complete:
            known = {name for name, _, _ in self.entries}
            changed += [name for name in now if name not in known]
        if self.parameters:
            params = dict(self.module.named_parameters())
            changed += [n for n, p, old in self.params if params.get(n) is not p or not _same(p.detach(), old)]
            known = {n for n, _, _ in self.params}
            changed += [n for n in params if n not in known]
        return changed

    @torch.no_grad()
    def restore(self, values: list[Tensor] | None = None) -> None:
        """Puts the held tensors back into the module with their values at the snapshot (or ``values``).

        A re-assigned buffer gets its original tensor back; with a complete snapshot a buffer registered since is
        removed.
        """
        values = [old for _, _, old in self.entries] if values is None else values
        reseat(self.module, [(name, ref) for name, ref, _ in self.entries], remove_others=self.complete)
        for (_, ref, _), old in zip(self.entries, values):
            if ref.shape != old.shape:  # resized in place
                ref.data = old.clone()
            else:
                ref.copy_(old)
        if self.parameters:
            reseat_parameters(self.module, [(n, p) for n, p, _ in self.params])
            for _, p, old in self.params:
                if p.shape != old.shape:
                    p.data = old.clone()
                else:
                    p.data.copy_(old)


def reseat_parameters(module: nn.Module, parameters: list[tuple[str, nn.Parameter]]) -> None:
    """Makes each named parameter of ``module`` the given Parameter again; parameters registered since are removed.

    Values are not touched.
    """
    held = set()
    for name, ref in parameters:
        owner, leaf = _owner(module, name)
        if owner._parameters.get(leaf) is not ref:  # re-assigned, set to None or deleted
            owner.__dict__.pop(leaf, None)
            owner._buffers.pop(leaf, None)
            owner._parameters[leaf] = ref
        held.add(name)
    for name in [n for n, _ in module.named_parameters() if n not in held]:
        owner, leaf = _owner(module, name)
        delattr(owner, leaf)


def reseat(module: nn.Module, buffers: list[tuple[str, Tensor]], remove_others: bool = False) -> None:
    """Makes each named buffer of ``module`` the given tensor object again (undoes a re-assignment).

    With ``remove_others``, buffers registered under other names are removed. Values are not touched.
    """
    held = set()
    for name, ref in buffers:
        owner, leaf = _owner(module, name)
        if owner._buffers.get(leaf) is not ref:  # re-assigned, set to None or deleted
            if leaf in owner._buffers:
                owner._buffers[leaf] = ref
            else:
                owner.__dict__.pop(leaf, None)  # a plain attribute now holds the name
                owner.register_buffer(leaf, ref)
        held.add(name)
    if remove_others:
        for name in [n for n, _ in module.named_buffers() if n not in held]:
            owner, leaf = _owner(module, name)
            delattr(owner, leaf)
