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


class _Mixed(nn.Module):
    """An fp32 layer, a bf16 parameter, a non-contiguous parameter and a BatchNorm: every branch of `load`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3)
        self.low = nn.Parameter(torch.randn(5).to(torch.bfloat16))
        self.transposed = nn.Parameter(torch.randn(4, 3).t())  # a (3, 4) view: not contiguous
        self.norm = nn.BatchNorm1d(3)


def test_loading_theta_plus_an_update_writes_their_sum_without_a_model_sized_temporary() -> None:
    net = _Mixed()
    assert not net.transposed.is_contiguous()
    state = ModelState(net, variance_floor=0.25)
    theta = state.vector()
    update = torch.randn(theta.shape, generator=torch.Generator().manual_seed(2)).abs() + 0.5
    state.load(theta, add=update, alpha=-3.0)  # every running variance (1 before) goes below 0: floored at 0.25
    got = state.vector()
    assert torch.equal(net.norm.running_var, torch.full((3,), 0.25)), "the floor still applies"
    state.load(torch.add(theta, update, alpha=-3.0))
    expected = state.vector()
    # One fp32 rounding of θ + α·u either way (a vectorized kernel may fuse the multiply-add on one path only).
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert net.low.dtype == torch.bfloat16 and not net.transposed.is_contiguous(), "tensors are written in place"


def test_a_kept_workspace_carries_nothing_from_one_patients_change_to_the_next() -> None:
    net = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    state = ModelState(net)
    theta = state.vector()
    generator = torch.Generator().manual_seed(3)
    changes = [scale * torch.randn(theta.shape, generator=generator) for scale in (10.0, 0.01)]
    out = torch.zeros_like(theta)
    expected = torch.zeros_like(theta, dtype=torch.float64)
    for change in changes:  # the second, small change must not see the first, large one left in the workspace
        state.load(theta + change)
        moved = state.vector().double() - theta.double()  # as loaded: a negative running variance is clamped at 0
        norm, clipped, finite = state.add_clipped_change(theta, out, 1.0)
        assert finite and norm == pytest.approx(float(moved.norm()), rel=1e-6)
        expected += moved * min(1.0, 1.0 / float(moved.norm()))
    assert clipped is False, "the second change is below the clip norm"
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-7)
    state.wipe_workspaces()
    assert not state.workspace("change").any(), "a wiped workspace holds no patient's raw change"
