"""An in-memory data set of adversarial units: an image may be ``None`` (reading it raises)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["UnitImages"]


class UnitImages(Dataset[Any]):
    """Images (flat float vectors) and labels; reading an image that is ``None`` raises ``OSError``."""

    def __init__(self, images: list[np.ndarray | None], labels: list[int]) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[i]
        if image is None:
            raise OSError(f"cannot read image {i}")
        return torch.from_numpy(np.asarray(image, dtype=np.float32)), torch.tensor(self.labels[i])
