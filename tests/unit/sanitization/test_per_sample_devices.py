"""The per-sample engine on another device and dtype gives the CPU's float64 clipped sum, for every layer-rule family.

Every case of test_per_sample.py and test_rules.py (Linear, Conv1/2/3d, ConvTranspose1/2/3d, GroupNorm, LayerNorm,
eval-mode BatchNorm, Embedding, PReLU, the functorch fallback, tied and re-used layers, ghost and materialized
norms, the kept-inputs term, tap-wise dilated convolutions) runs on the device in float32 and float64, and its
clipped sum, norm sum and clipped count are compared with the naive loop run on the CPU in float64 (each sample's
gradient alone, clipped, summed). The CPU float32 cases run in the normal suite (the float64 ones are
test_per_sample.py's and test_rules.py's own); the CUDA cases are marked ``gpu``.

Tolerances: float64 1e-9 relative (the CPU reference agrees with itself to 1e-10; a GPU reduces in another order);
float32 1e-4 relative. TF32 is switched off for these comparisons (``exact_fp32``): with it, PyTorch runs fp32
convolutions on the GPU at a 10-bit mantissa, and the comparison would measure TF32, not the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_dp.sanitization.per_sample import PerSampleClipper
from tests.helpers.per_sample_reference import clip_norm_between, engine_sum, naive_per_sample_grads, trainable
from tests.unit.sanitization import test_per_sample, test_rules

CASES: dict[str, Callable[[], Any]] = {
    **{f"engine/{name}": make for name, make in test_per_sample.CASES.items()},
    **{f"rules/{name}": make for name, make in test_rules.CASES.items()},
}
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}


def _loss(model: nn.Module, x: Tensor) -> Tensor:
    out = model(x)
    return (out.sin() + 0.5 * out.pow(2)).flatten(1).sum(1).mean()


def _data(case: Any) -> tuple[Tensor, ...]:
    return tuple(case.data) if hasattr(case, "data") else (case.x,)


@pytest.fixture
def exact_fp32() -> Iterator[None]:
    """TF32 off for fp32 matrix products and convolutions on CUDA, restored afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _params() -> list[Any]:
    out = []
    for device in DEVICES:
        for dtype in (torch.float32, torch.float64):
            if device.values[0] == "cpu" and dtype is torch.float64:
                continue  # test_per_sample.py and test_rules.py
            name = "fp32" if dtype is torch.float32 else "fp64"
            out.append(pytest.param(device.values[0], dtype, id=f"{device.id}-{name}", marks=device.marks))
    return out


@pytest.mark.parametrize(("device", "dtype"), _params())
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.usefixtures("exact_fp32")
def test_clipped_sum_on_the_device_equals_the_cpu_float64_loop(name: str, device: str, dtype: torch.dtype) -> None:
    case = CASES[name]()
    reference = case.model.double()
    data = _data(case)
    grads = naive_per_sample_grads(reference, lambda m, *d: _loss(m, *d), data)
    norms = grads.norm(dim=1)
    clip_norm = clip_norm_between(norms)
    expected = ((clip_norm / norms).clamp(max=1.0)[:, None] * grads).sum(0)

    model = case.model.to(device=device, dtype=dtype)  # the same weights, moved and cast
    moved = tuple(t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device) for t in data)
    clipper = PerSampleClipper(model, clip_norm)
    try:
        stats = clipper.accumulate(lambda: _loss(model, *moved), len(moved[0]))
        got = engine_sum(clipper, model)
    finally:
        clipper.remove()
    assert got.device.type == device and clipper.flat_sum.dtype == dtype
    rtol = RTOL[dtype]
    error = float((got.cpu().double() - expected).norm() / expected.norm())
    assert error <= rtol, f"clipped sum off by {error:.2e} (relative) on {device} in {dtype}"
    assert stats.norm_sum == pytest.approx(float(norms.sum()), rel=rtol)
    assert stats.clipped == int((norms > clip_norm).sum()) and stats.nonfinite == 0
    assert all(p.grad is None and p.requires_grad for p in trainable(model))
