"""The fixes `validate_model` suggests work when applied (issue 23: a suggested fix the validator then refused)."""

from __future__ import annotations

from pathlib import Path

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


class PatchEmbeddingBlock(nn.Module):
    """MONAI's pattern (UNETR, ViT): a position embedding added next to a child layer, in a class users cannot edit."""

    def __init__(self) -> None:
        super().__init__()
        self.patch_embeddings = nn.Conv2d(1, 4, 2, stride=2)
        self.position_embeddings = nn.Parameter(torch.zeros(1, 4, 2, 2))

    def forward(self, x: Tensor) -> Tensor:
        return self.patch_embeddings(x) + self.position_embeddings


def test_the_suggested_fix_for_parameters_next_to_a_layer_can_be_applied_to_a_library_class() -> None:
    model = nn.Sequential(PatchEmbeddingBlock(), nn.Flatten(), nn.Linear(16, 2))
    (problem,) = validate_model(model)
    assert problem.name == "0" and "model.get_parameter('0.position_embeddings').requires_grad_(False)" in problem.fix
    model.get_parameter("0.position_embeddings").requires_grad_(False)  # the fix, as written
    assert validate_model(model) == []
    x, y = torch.randn(6, 1, 4, 4, dtype=torch.float64), torch.randint(2, (6,))
    check_clipped_sum(model.double(), _loss, x, y)


def test_the_monai_extra_installs_what_monais_transformer_networks_need() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]
    for extra in ("monai", "dev"):
        names = {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in project["optional-dependencies"][extra]}
        assert {"monai", "einops"} <= names, f"lightning-dp[{extra}] cannot build MONAI's UNETR / ViT / SwinUNETR"


def test_monai_unetr_trains_per_sample_once_its_position_embeddings_are_frozen() -> None:
    pytest.importorskip("einops")
    from monai.networks.nets import UNETR

    torch.manual_seed(0)
    net = UNETR(1, 1, img_size=(16, 16), spatial_dims=2, feature_size=4, hidden_size=16, mlp_dim=16, num_heads=2)
    (problem,) = validate_model(net)
    assert "vit.patch_embedding.position_embeddings" in problem.fix
    net.get_parameter("vit.patch_embedding.position_embeddings").requires_grad_(False)
    assert validate_model(net) == []
    x = torch.randn(3, 1, 16, 16, dtype=torch.float64)
    check_clipped_sum(net.double(), lambda m, a, b: ((m(a) - b) ** 2).mean(), x, torch.rand_like(x))


def test_monai_swin_unetr_is_refused_plainly_with_an_alternative() -> None:
    pytest.importorskip("einops")
    from monai.networks.nets import SwinUNETR

    net = SwinUNETR(in_channels=1, out_channels=1, spatial_dims=2, feature_size=12, depths=(1, 1, 1, 1))
    problems = validate_model(net)
    assert problems and all(p.layer == "WindowAttention" for p in problems)
    assert all("not support Swin" in p.problem and "P3SGD" in p.fix for p in problems)
    assert not any("requires_grad_(False)" in p.fix for p in problems), "freezing its attention is no fix"
