"""`ModelState`: a noised running variance is loaded floored, never at or below zero (issue 22)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dp.errors import PrivacyConfigError
from lightning_dp.sanitization import ModelState


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6))
    with torch.no_grad():
        net[4].running_var.copy_(torch.tensor([0.5, 1.0, 2.0, 4.0, 0.0, float("nan")]))  # "pre-trained"
    return net


def test_a_noised_variance_never_reaches_evaluation_below_the_floor() -> None:
    net = _net()
    state = ModelState(net, variance_floor=0.1)
    theta = state.vector()
    noised = theta + 10.0 * torch.randn(theta.shape, generator=torch.Generator().manual_seed(1))
    state.load(noised)
    floor0 = torch.full((6,), 0.1)
    floor1 = 0.1 * torch.tensor([0.5, 1.0, 2.0, 4.0, 1.0, 1.0])  # a pre-trained 0 or NaN: v0 = 1
    assert (net[1].running_var >= floor0).all() and (net[4].running_var >= floor1).all()
    assert (net[1].running_var == floor0).any(), "noise of std 10 drives some variances below the floor"
    # Only the variances are post-processed: parameters and means are the noised release as it is.
    loaded = state.vector()
    variance = torch.zeros_like(theta, dtype=torch.bool)
    offset = sum(p.numel() for p in net.parameters())
    for _ in range(2):  # the buffers, in order: running_mean, running_var of each BatchNorm
        variance[offset + 6 : offset + 12] = True
        offset += 12
    assert torch.equal(loaded[~variance], noised[~variance])
    floors = torch.cat([floor0, floor1])
    assert torch.equal(loaded[variance], torch.where(noised[variance] >= floors, noised[variance], floors))
    with torch.no_grad():
        assert torch.isfinite(net.eval()(torch.randn(8, 4))).all()


def test_the_floor_follows_the_buffers_to_another_dtype_and_the_default_keeps_the_old_clamp() -> None:
    net = _net()
    state = ModelState(net, variance_floor=0.5)
    net.double()  # replaces the buffers: the floor is looked up by layer name at refresh
    state.refresh()
    state.load(torch.full((state.numel,), -1.0, dtype=torch.float64))
    assert net[1].running_var.dtype == torch.float64 and torch.equal(net[1].running_var, torch.full((6,), 0.5))
    net = _net()
    state = ModelState(net)
    state.load(torch.full((state.numel,), -1.0))
    assert torch.equal(net[1].running_var, torch.zeros(6))


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_a_bad_floor_is_refused(bad: float) -> None:
    with pytest.raises(PrivacyConfigError, match=r"variance_floor must be a number in \[0, 1\]"):
        ModelState(_net(), variance_floor=bad)
