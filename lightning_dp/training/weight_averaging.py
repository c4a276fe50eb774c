"""Which callbacks average weights: the predicate the DP callbacks and `ReleasedWeightAveraging` share.

`DPCallback` asks it when it reads a checkpoint written with weight averaging, and `DPSGD` when it
converts BatchNorm after an averaging callback copied the model; `ReleasedWeightAveraging` asks it to
refuse Lightning's own averaging beside it. It imports neither side, so that the DP callbacks
(``callbacks/base.py``) and the averaging callback (``callbacks/averaging.py``, which needs
`DPCallback`) do not import each other, and ``lightning_dp.training`` imports nothing of
``lightning_dp.callbacks``.

Example:
    >>> import pytorch_lightning as pl
    >>> averages_weights(pl.Callback())
    False
"""

from __future__ import annotations

from typing import ClassVar

import pytorch_lightning as pl

__all__ = ["AveragesReleasedWeights", "averages_weights", "is_lightning_weight_averaging"]


class AveragesReleasedWeights:
    """Marks a callback that averages the weights a DP callback releases (`ReleasedWeightAveraging`).

    Such a callback writes the average as a checkpoint's ``state_dict`` and the last released weights
    as its ``current_model_state``, as Lightning's `WeightAveraging` does.
    """

    averages_released_weights: ClassVar[bool] = True


def is_lightning_weight_averaging(callback: pl.Callback) -> bool:
    """Whether ``callback`` is Lightning's `WeightAveraging` or `EMAWeightAveraging` (Lightning ≥ 2.5 has them)."""
    try:
        from pytorch_lightning.callbacks import WeightAveraging
    except ImportError:  # pragma: no cover - an older Lightning
        return False
    return isinstance(callback, WeightAveraging)


def averages_weights(callback: pl.Callback) -> bool:
    """Whether ``callback`` averages weights: ours (`AveragesReleasedWeights`) or Lightning's `WeightAveraging`."""
    return isinstance(callback, AveragesReleasedWeights) or is_lightning_weight_averaging(callback)
