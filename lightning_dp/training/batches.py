"""What a ``training_step`` returns, read the same way everywhere (plain torch, no Lightning).

A LightningModule's ``training_step`` returns its loss, or a dict whose ``"loss"`` entry is the loss. The private
steps, their start-up checks, the patient round and the public energy all read it through `returned_loss` and
`loss_of` (the room for the batch helpers the engines share).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_dp.errors import PrivacyConfigError

__all__ = ["loss_of", "returned_loss"]


def returned_loss(out: Any) -> Any:
    """The loss in what ``training_step`` returned: ``out`` itself, or its ``"loss"`` entry (None if a dict has none).

    Example:
        >>> import torch
        >>> returned_loss({"loss": torch.tensor(1.0)}), returned_loss(torch.tensor(2.0)), returned_loss({})
        (tensor(1.), tensor(2.), None)
    """
    return out.get("loss") if isinstance(out, dict) else out


def loss_of(out: Any) -> Tensor:
    """The loss tensor in what ``training_step`` returned.

    Raises:
        PrivacyConfigError: ``out`` holds no tensor (a dict without ``"loss"``, None, a float).
    """
    loss = returned_loss(out)
    if not isinstance(loss, Tensor):
        raise PrivacyConfigError(
            f"training_step returned {type(out).__name__}, not a loss tensor. HINT: return the loss (or "
            "{'loss': loss}) from training_step."
        )
    return loss
