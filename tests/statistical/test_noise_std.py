"""The released noise has the std the accountant assumes: σ = z·C / (q·N) — on the base and on selected candidates."""

from __future__ import annotations

import pytest
import torch

from lightning_dp.accounting import PrivacyLedger
from lightning_dp.sanitization import GaussianRelease, NoiseSelection, SelectedRelease

pytestmark = pytest.mark.statistical

D = 200_000  # coordinates; the sample std of D Gaussians is within ±1 % with probability > 1 − 1e-9


def test_single_scale_noise_std() -> None:
    release = GaussianRelease(PrivacyLedger("patient", 1e-5), clip_norm=5.0, sample_rate=0.1, schedule=1.3, seed=1)
    out = release.release(0, torch.zeros(D), normalizer=20.0)
    expected = 1.3 * 5.0 / 20.0
    assert out.noise_std == pytest.approx(expected)
    assert float(out.update.std()) == pytest.approx(expected, rel=0.01), "noise std off by more than 1 %"
    assert abs(float(out.update.mean())) < 5 * expected / D**0.5, "noise must be centred"


@pytest.mark.parametrize("pick", [0, 1])
def test_selected_candidate_has_its_scale_std(pick: int) -> None:
    scales = (1.0, 3.0)
    release = SelectedRelease(
        PrivacyLedger("patient", 1e-5),
        clip_norm=5.0,
        sample_rate=0.1,
        noise_scales=scales,
        selection=NoiseSelection(50.0, 1.0),
        seed=2,
    )
    unit = 5.0 / 20.0
    # The loss is 0 for the wanted candidate and the bound for the other, so with ε′ = 50 the pick
    # is the wanted one with probability 1 − e^-25.
    target_std = scales[pick] * unit

    def loss_of(update: torch.Tensor) -> float:
        return 0.0 if abs(float(update.std()) - target_std) < 0.1 * target_std else 1.0

    out = release.release(0, torch.zeros(D), normalizer=20.0, loss_of=loss_of)
    assert out.noise_multiplier == scales[pick]
    assert float(out.update.std()) == pytest.approx(target_std, rel=0.01)


def test_parallel_chunked_noise_is_standard_normal_and_reproducible() -> None:
    # 4M draws (above the parallel threshold): the std is within ±0.5 % (> 14 standard errors of 0.035 %),
    # the mean within 5 standard errors, neighbouring chunks uncorrelated (|r| < 5/sqrt(n) per pair), and
    # a KS test against N(0, 1) on a 200k subsample does not reject at 1e-4.
    from scipy.stats import kstest

    from lightning_dp.sanitization.release import NOISE_CHUNKS, standard_normal

    n = 4_000_000
    draws = standard_normal(n, torch.Generator().manual_seed(3)).double()
    assert torch.equal(draws.float(), standard_normal(n, torch.Generator().manual_seed(3))), "must be reproducible"
    assert float(draws.std()) == pytest.approx(1.0, rel=0.005)
    assert abs(float(draws.mean())) < 5 / n**0.5
    chunks = draws[: (n // NOISE_CHUNKS) * NOISE_CHUNKS].view(NOISE_CHUNKS, -1)
    for a, b in zip(chunks[:-1], chunks[1:]):
        r = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
        assert abs(r) < 5 / a.numel() ** 0.5, "chunks must be independent streams"
    assert kstest(draws[::20].numpy(), "norm").pvalue > 1e-4
