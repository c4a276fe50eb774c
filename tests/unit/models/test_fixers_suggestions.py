"""The fixes `validate_model` suggests work when applied (issue 23: a suggested fix the validator then refused)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_dp.models import validate_model
from tests.helpers.per_sample_reference import check_clipped_sum

layers = pytest.importorskip("opacus.layers")


class _Recurrent(nn.Module):
    def __init__(self, kind: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = kind(3, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_the_suggested_opacus_recurrent_layer_is_accepted_and_clipped_per_sample(kind: str) -> None:
    problems = validate_model(_Recurrent(getattr(nn, kind)))
    assert [p.layer for p in problems] == [kind]
    suggested = f"DP{kind}"
    assert f"opacus.layers.{suggested}" in problems[0].fix
    torch.manual_seed(0)
    model = _Recurrent(getattr(layers, suggested)).double()
    assert validate_model(model) == [], "the suggested replacement must pass the same validator"
    x, y = torch.randn(8, 4, 3, dtype=torch.float64), torch.randint(2, (8,))
    check_clipped_sum(model, _loss, x, y)
