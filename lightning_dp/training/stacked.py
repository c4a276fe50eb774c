"""Local SGD of many units at once: ``torch.func`` over stacked copies of the trainable parameters.

P3SGD trains each sampled patient's copy of the model for a few local steps on that patient's images. Run
one patient after another, a round pays Python and kernel-launch overhead per patient and per step; here
the copies of a chunk of patients are stacked along a new leading dimension and every local step is one
``vmap(grad(loss))`` over the chunk: patient k's copy sees patient k's mini-batch only, and its optimizer
step (SGD with the loop's momentum and weight decay) touches its own copy only. The model itself is never
written: `torch.func.functional_call` swaps the stacked tensors in for the duration of a call.

It is exact, not an approximation: the same mini-batches in the same order (the caller draws the orders
from the loop's generator in the loop's order), the same steps, so every patient's final parameters equal
the loop's up to float round-off. `P3SGD` takes it only where that holds, and checks it on start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

__all__ = ["StackedLocalSGD", "free_memory_bytes", "stack_batches"]


def stack_batches(batches: Sequence[Any]) -> Any:
    """Stacks same-shaped collated batches along a new leading dimension (tensors inside tuples, lists, dicts).

    Raises:
        TypeError: a field is not a tensor (a list of file names, say): it cannot be stacked.

    Example:
        >>> a, b = (torch.zeros(2, 3), torch.tensor([0, 1])), (torch.ones(2, 3), torch.tensor([1, 1]))
        >>> x, y = stack_batches([a, b])
        >>> tuple(x.shape), y.tolist()
        ((2, 2, 3), [[0, 1], [1, 1]])
    """
    first = batches[0]
    if isinstance(first, Tensor):
        return torch.stack(list(batches))
    if isinstance(first, dict):
        return {key: stack_batches([b[key] for b in batches]) for key in first}
    if isinstance(first, (tuple, list)):
        fields = [stack_batches(column) for column in zip(*batches)]
        if hasattr(first, "_fields"):  # a namedtuple
            return type(first)(*fields)
        return type(first)(fields)
    raise TypeError(f"a batch field of type {type(first).__name__} is not a tensor")


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device``: CUDA's free bytes, or the host's MemAvailable (4 GiB if unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


class _Step(nn.Module):
    """Calls ``training_step`` as its forward, so that `functional_call` can swap the module's tensors."""

    def __init__(self, module: nn.Module, training_step: Callable[..., Any]) -> None:
        super().__init__()
        self.m = module
        self._training_step = training_step

    def forward(self, batch: Any, batch_idx: int) -> Any:
        return self._training_step(batch, batch_idx)


class StackedLocalSGD:
    """Runs the same local SGD schedule on a chunk of units, one ``vmap(grad(loss))`` per local step.

    Args:
        module: the model ``training_step`` belongs to.
        training_step: ``training_step(batch, batch_idx)`` bound to ``module``; it must be a pure function of the
            parameters and the batch (no ``.item()``, no in-place buffer updates, no random layers in training mode).
        loss_of: the scalar loss in what ``training_step`` returns.
        params: the trainable parameters (a subset of ``module.parameters()``); the others stay as they are.
        lr: the learning rate of ``torch.optim.SGD`` (dampening 0, no Nesterov), as in the loop.
        momentum: its momentum.
        weight_decay: its weight decay.

    Example:
        >>> net = nn.Linear(2, 1)
        >>> step = lambda batch, i: ((net(batch[0]) - batch[1]) ** 2).mean()
        >>> sgd = StackedLocalSGD(net, step, lambda out: out, list(net.parameters()), lr=0.1)
        >>> x, y = torch.randn(3, 4, 2), torch.randn(3, 4, 1)  # 3 units of 4 samples each
        >>> one_step = [(x[u], y[u]) for u in range(3)]  # every unit's first (and only) mini-batch
        >>> weights, bias = sgd.run([one_step])
        >>> tuple(weights.shape), tuple(bias.shape)
        ((3, 1, 2), (3, 1))
    """

    def __init__(
        self,
        module: nn.Module,
        training_step: Callable[..., Any],
        loss_of: Callable[[Any], Tensor],
        params: Sequence[Tensor],
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        ids = {id(p) for p in params}
        named = {id(p): name for name, p in module.named_parameters()}
        missing = ids - set(named)
        if missing:
            raise ValueError(f"{len(missing)} of the parameters are not parameters of {type(module).__name__}")
        self.params = list(params)
        self._names = ["m." + named[id(p)] for p in self.params]
        self._call = _Step(module, training_step)
        self._loss_of = loss_of
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay

    def _grads(self, stacked: list[Tensor], batch: Any, batch_idx: int) -> list[Tensor]:
        names, call, loss_of = self._names, self._call, self._loss_of

        def loss(params: list[Tensor], one: Any) -> Tensor:
            return loss_of(functional_call(call, dict(zip(names, params)), (one, batch_idx)))

        return list(vmap(grad(loss))(stacked, batch))

    def run(self, steps: Iterable[Sequence[Any]]) -> list[Tensor]:
        """The units' parameters after their local steps, stacked along a new leading dimension.

        The k-th item of ``steps`` holds every unit's k-th mini-batch (unit u's at position u); they must have
        the same shapes (the caller groups units of equal size).
        """
        stacked: list[Tensor] = []
        buffers: list[Tensor] | None = None
        for k, batches in enumerate(steps):
            if not stacked:
                with torch.no_grad():
                    stacked = [p.detach().unsqueeze(0).repeat(len(batches), *([1] * p.dim())) for p in self.params]
            with torch.enable_grad():
                grads = self._grads(stacked, stack_batches(batches), k)
            with torch.no_grad():  # torch.optim.SGD's update, one copy per unit
                if self.weight_decay:
                    grads = [g.add(s, alpha=self.weight_decay) for g, s in zip(grads, stacked)]
                if self.momentum:
                    if buffers is None:
                        buffers = [g.clone() for g in grads]
                    else:
                        buffers = [b.mul_(self.momentum).add_(g) for b, g in zip(buffers, grads)]
                    grads = buffers
                for s, g in zip(stacked, grads):
                    s.add_(g, alpha=-self.lr)
        if not stacked:
            raise ValueError("no local steps to run")
        return stacked
