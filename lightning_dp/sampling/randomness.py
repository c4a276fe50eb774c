"""Each privacy unit's training randomness from a stream of its own, keyed by a secret seed and the unit.

Augmentation (random flips, rotations, colour jitter in a dataset's transform), dropout masks and anything else
random that a unit's update draws is *part of the mechanism*. The accountant's argument (one unit moves the
clipped sum by at most C) holds when every unit's randomness depends on that unit alone. Drawn from one global
stream instead, a unit's flips and masks depend on how many draws the units processed before it made, so adding
one unit changes every later unit's randomness; and when that global stream is seeded publicly
(``seed_everything: 0`` in a config), the change is a deterministic function of data an adversary has: one unit
then moves the sum by several C (issue 31 measured 3.8·C under P3SGD and 6.4·C under DP-SGD at q = 1).

`UnitStreams` gives each unit of a step its own stream, seeded from ``(secret, purpose, unit key)`` by SHA-256:
the step's secret is drawn from the DP callback's secret generator (the OS CSPRNG unless the user sets the
callback's ``seed``), never from ``seed_everything``. Inside ``streams.unit(key)`` the global generators that
transforms and layers draw from (torch's CPU generator and the current device's, NumPy's and Python's ``random``)
are that unit's stream; on exit the unit's position is kept (for a unit whose work is interleaved with others')
and the outer generators are restored exactly, so the public stream is not advanced by private work either.

`per_row_dropout` does the same for the rows of a batch: each ``nn.Dropout``-family layer draws every row's mask
from the stream of the unit that row belongs to.

A unit's key must name the unit by what it is, not by where it is: a patient's id; for a sample, the key its dataset
gives it (`sample_key`: the sample-key protocol, `KeyedDataset`), or its index in the dataset where the dataset gives
none. The index is sound only while the secret stays secret: inserting one sample before others shifts their indices,
and so their draws, which with a public seed (the callback's ``seed``, or an audit that fixes it) moves the clipped
sum by several C (an independent review measured 6.58·C through augmentation and 6.44·C through dropout).

Example:
    >>> streams = UnitStreams(secret=1234, purpose="data")
    >>> before = torch.get_rng_state()
    >>> with streams.unit("patient-7"):
    ...     a = torch.rand(2)
    >>> with UnitStreams(secret=1234, purpose="data").unit("patient-7"):
    ...     b = torch.rand(2)
    >>> torch.equal(a, b), torch.equal(torch.get_rng_state(), before)
    (True, True)
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Subset

__all__ = [
    "KeyedDataset",
    "UnitStreams",
    "draws_random_numbers",
    "per_row_dropout",
    "sample_key",
    "training_dropout",
    "unit_seed",
]

_DOMAIN = "lightning-dp/unit-randomness/v1"


def unit_seed(secret: int, purpose: str, key: object) -> int:
    """A 63-bit seed: SHA-256 of the secret, the purpose and the unit's key (its ``repr``).

    Example:
        >>> unit_seed(1, "data", 3) == unit_seed(1, "data", 3), unit_seed(1, "data", 3) != unit_seed(1, "step", 3)
        (True, True)
    """
    digest = hashlib.sha256(f"{_DOMAIN}/{int(secret)}/{purpose}/{key!r}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@runtime_checkable
class KeyedDataset(Protocol):
    """The sample-key protocol: a dataset that names each of its samples by a key of the sample's own.

    ``sample_key(index)`` is a hashable value with a stable ``repr`` (strings, numbers, tuples of them) that
    identifies the sample at ``index`` by what it is, not by where it is: adding or removing other samples leaves it
    unchanged (a patient id with the image's file name, a digest of the image, a manifest row's own id). DP-SGD keys
    each sample's random streams by it (its augmentation in ``__getitem__``, its dropout masks). Two samples may share
    a key: they then draw the same numbers, which is harmless (each sample's draws still depend on its own key alone).
    The library's patient datasets provide it (`lightning_dp.data.PatientImageDataset`,
    `lightning_dp.data.PatientSegmentationDataset`).
    """

    def sample_key(self, index: int) -> Hashable: ...


def sample_key(dataset: Any, index: int) -> Hashable:
    """The key of sample ``index``'s random streams: ``dataset.sample_key(index)``, else ``index`` itself.

    A `torch.utils.data.Subset` passes the key of its dataset's sample on. The index is the fallback: sound only with
    a secret seed (the callbacks' default), since inserting a sample shifts the indices after it (see the module's
    docstring); give the dataset a ``sample_key`` method (`KeyedDataset`) to make the draws stable.

    Example:
        >>> class Named(list):
        ...     def sample_key(self, index):
        ...         return f"s{index}"
        >>> sample_key([10, 20], 1), sample_key(Named([0] * 5), 4), sample_key(Subset(Named([0] * 5), [4]), 0)
        (1, 's4', 's4')
    """
    own = getattr(dataset, "sample_key", None)
    if callable(own):
        return own(index)
    if isinstance(dataset, Subset) and callable(getattr(dataset.dataset, "sample_key", None)):
        return sample_key(dataset.dataset, dataset.indices[index])
    return index


@dataclass
class _State:
    cpu: Tensor
    device: Tensor | None
    numpy: Any
    python: Any


def _capture(device: torch.device | None) -> _State:
    return _State(
        torch.get_rng_state(),
        torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None,
        np.random.get_state(),
        random.getstate(),
    )


def _restore(state: _State, device: torch.device | None) -> None:
    torch.set_rng_state(state.cpu)
    if state.device is not None and device is not None:
        torch.cuda.set_rng_state(state.device, device)
    np.random.set_state(state.numpy)
    random.setstate(state.python)


def _same(a: _State, b: _State) -> bool:
    numpy_same = a.numpy[0] == b.numpy[0] and np.array_equal(a.numpy[1], b.numpy[1]) and a.numpy[2:] == b.numpy[2:]
    device_same = a.device is None or b.device is None or torch.equal(a.device, b.device)
    return torch.equal(a.cpu, b.cpu) and device_same and numpy_same and a.python == b.python


def draws_random_numbers(run: Callable[[], Any], device: torch.device | None = None) -> bool:
    """Whether ``run()`` draws from torch's (CPU or ``device``'s), NumPy's or Python's global generators.

    The generators are restored afterwards.

    Example:
        >>> draws_random_numbers(lambda: torch.zeros(3)), draws_random_numbers(lambda: torch.rand(3))
        (False, True)
    """
    cuda = device if device is not None and device.type == "cuda" else None
    before = _capture(cuda)
    try:
        run()
        after = _capture(cuda)
    finally:
        _restore(before, cuda)
    return not _same(before, after)


def _seed(seed: int, device: torch.device | None) -> None:
    torch.default_generator.manual_seed(seed)
    if device is not None and device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


class UnitStreams:
    """The random streams of one step's units, each seeded from (``secret``, ``purpose``, the unit's key).

    Args:
        secret: the step's secret seed (drawn from the DP callback's secret generator, fresh every step).
        purpose: separates streams used for different things in one step ("data", "step", "order", ...).
        device: the accelerator whose generator is switched too (None: the CPU only).
    """

    def __init__(self, secret: int, purpose: str, device: torch.device | None = None) -> None:
        self.secret = int(secret)
        self.purpose = purpose
        self.device = device if device is not None and device.type == "cuda" else None
        self._positions: dict[object, _State] = {}

    def seed_of(self, key: object) -> int:
        """The seed of ``key``'s stream."""
        return unit_seed(self.secret, self.purpose, key)

    def generator(self, key: object) -> torch.Generator:
        """A CPU ``torch.Generator`` of ``key``'s own (e.g. the order of a patient's images)."""
        return torch.Generator().manual_seed(unit_seed(self.secret, self.purpose + "/generator", key))

    @contextmanager
    def unit(self, key: object) -> Iterator[None]:
        """The global generators draw from ``key``'s stream inside the block (continued where its last block ended)."""
        outer = _capture(self.device)
        try:
            position = self._positions.get(key)
            if position is None:
                _seed(self.seed_of(key), self.device)
            else:
                _restore(position, self.device)
            yield
            self._positions[key] = _capture(self.device)
        finally:
            _restore(outer, self.device)

    def fetch(self, dataset: Any, indices: Sequence[int], key: object, repeat: int = 1) -> list[Any]:
        """``dataset[i]`` for each of ``indices`` (each ``repeat`` times), drawing from ``key``'s stream."""
        with self.unit(key):
            return [dataset[int(i)] for i in indices for _ in range(repeat)]


#: The functional form of each dropout layer (row by row it is called with the layer's own settings).
_DROPOUTS: dict[type[nn.Module], Callable[..., Tensor]] = {
    nn.Dropout: torch.nn.functional.dropout,
    nn.Dropout1d: torch.nn.functional.dropout1d,
    nn.Dropout2d: torch.nn.functional.dropout2d,
    nn.Dropout3d: torch.nn.functional.dropout3d,
    nn.AlphaDropout: torch.nn.functional.alpha_dropout,
    nn.FeatureAlphaDropout: torch.nn.functional.feature_alpha_dropout,
}


def training_dropout(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The dropout layers of ``module`` in training mode, as (qualified name, layer)."""
    return [
        (name, m) for name, m in module.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training
    ]


@contextmanager
def per_row_dropout(module: nn.Module, streams: UnitStreams, row_keys: Sequence[object]) -> Iterator[None]:
    """Every training-mode dropout layer of ``module`` draws row r's mask from ``row_keys[r]``'s stream.

    A layer applied to a tensor whose first dimension is not the batch's rows raises `ValueError` (its masks could
    not be told apart by row). Layers of a type not in torch's dropout family are left as they are.
    """
    layers = [(name, m) for name, m in training_dropout(module) if type(m) in _DROPOUTS]

    def keyed(name: str, layer: nn.Module) -> Callable[[Tensor], Tensor]:
        functional = _DROPOUTS[type(layer)]

        def forward(x: Tensor) -> Tensor:
            if x.dim() == 0 or x.shape[0] != len(row_keys):
                raise ValueError(
                    f"`{name}` ({type(layer).__name__}) got a tensor whose first dimension is "
                    f"{x.shape[0] if x.dim() else 'missing'}, but the batch has {len(row_keys)} rows: its masks "
                    "cannot be drawn per sample. HINT: keep the batch dimension first, or remove the layer."
                )
            rows = []
            for r, key in enumerate(row_keys):
                with streams.unit(key):
                    rows.append(functional(x[r : r + 1], layer.p, True, False))
            return torch.cat(rows)

        return forward

    for name, layer in layers:
        layer.forward = keyed(name, layer)
    try:
        yield
    finally:
        for _, layer in layers:
            del layer.forward
