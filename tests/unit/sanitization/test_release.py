"""Releases: noise and ledger charge happen together, per step; events per accounting mode; clipping."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lightning_dp.accounting import (
    ComposedEvent,
    ExponentialMechanismEvent,
    GaussianEvent,
    PoissonSampledEvent,
    PrivacyLedger,
    ZCDPEvent,
)
from lightning_dp.errors import PrivacyConfigError, PrivacyStateError
from lightning_dp.sanitization import (
    EnergyNoise,
    GaussianRelease,
    NoiseSelection,
    PaperSelectedRelease,
    Release,
    SelectedRelease,
    clip_update,
)
from lightning_dp.schedules import ExponentialDecay, LambdaNoise


def _release(scales: tuple[float, ...], accounting: str = "rigorous", seed: int = 0, schedule: object = 1.0) -> Release:
    ledger = PrivacyLedger("patient", 1e-5)
    common = {"clip_norm": 5.0, "sample_rate": 0.1, "seed": seed}
    selection = NoiseSelection(epsilon=0.316, loss_bound=3.0)
    if accounting == "paper":
        return PaperSelectedRelease(ledger, noise_scales=scales, selection=selection, schedule=schedule, **common)
    if len(scales) > 1:
        return SelectedRelease(ledger, noise_scales=scales, selection=selection, schedule=schedule, **common)
    return GaussianRelease(ledger, schedule=schedule if schedule != 1.0 else scales[0], **common)  # type: ignore[arg-type]


def test_every_release_is_recorded_once() -> None:
    release = _release((1.0,))
    for step in range(5):
        release.release(step, torch.zeros(3), normalizer=10.0)
    assert release.ledger.steps == 5
    assert release.ledger.entries[0][0] == PoissonSampledEvent(0.1, GaussianEvent(1.0))


def test_what_a_step_charges_is_its_event() -> None:
    release = _release((1.0,), schedule=ExponentialDecay(initial=2.0, decay=0.25))
    for step in range(4):
        before = release.event(step)
        out = release.release(step, torch.zeros(3), normalizer=10.0)
        assert out.event == before == release.ledger.entries[-1][0]
        assert out.noise_multiplier == 2.0 * 0.5**step, "the schedule's multiplier at the step"
    assert release.ledger.steps == 4 and len(release.ledger.entries) == 4, "a heterogeneous ledger"


def test_rigorous_selection_is_charged_as_one_joint_mechanism_of_the_shared_sample() -> None:
    release = _release((3.0, 1.0))
    out = release.release(0, torch.zeros(3), normalizer=10.0, loss_of=lambda u: 0.0)
    # One sample, one event: the selection scores candidates on the round's sampled patients.
    expected = PoissonSampledEvent(0.1, ComposedEvent((GaussianEvent(1.0), ExponentialMechanismEvent(0.316, 2))))
    assert out.event == expected and release.ledger.entries == ((expected, 1),)


def test_every_candidate_scale_follows_the_schedule() -> None:
    release = _release((3.0, 1.0), schedule=ExponentialDecay(initial=1.0, decay=0.25))
    assert isinstance(release, SelectedRelease)
    assert release.multipliers(2) == (0.25, 0.75)
    assert release.event(2).components() == (0.25, (0.158,))  # type: ignore[union-attr]


def test_paper_mode_charges_selected_scale_and_zcdp_term() -> None:
    release = _release((3.0, 1.0), accounting="paper")
    # Candidate 0 (z=1) always has a huge loss, so z=3 is (almost surely) selected.
    out = release.release(0, torch.zeros(3), normalizer=10.0, loss_of=lambda u: 0.0 if u.abs().mean() > 0.8 else 3.0)
    assert out.event.events[0] == PoissonSampledEvent(0.1, GaussianEvent(out.noise_multiplier))  # type: ignore[union-attr]
    assert out.event.events[1] == ZCDPEvent(0.1 * 0.316**2 / 2)  # type: ignore[union-attr]


def test_selection_failure_still_charges_in_paper_mode() -> None:
    release = _release((3.0, 1.0), accounting="paper")

    def boom(update: torch.Tensor) -> float:
        raise RuntimeError("loss failed")

    with pytest.raises(RuntimeError, match="loss failed"):
        release.release(0, torch.zeros(3), normalizer=10.0, loss_of=boom)
    assert release.ledger.steps == 1, "noise was drawn, so the round must be charged even when selection fails"


def test_a_private_energy_is_charged_with_its_step_on_the_same_sample() -> None:
    release = _release((1.0,))
    energy = EnergyNoise(clip=0.5, noise_multiplier=2.0)
    out = release.release(0, torch.zeros(3), normalizer=10.0, energy=energy)
    joint = PoissonSampledEvent(0.1, ComposedEvent((GaussianEvent(1.0), GaussianEvent(2.0))))
    assert out.event == release.event(0, energy) == joint and release.ledger.steps == 1
    assert joint.components()[0] == pytest.approx((1 / 1.0**2 + 1 / 2.0**2) ** -0.5)
    assert out.noisy_energy is not None
    value = out.noisy_energy(3.0)
    assert math.isfinite(value)
    with pytest.raises(PrivacyStateError, match="already released once"):
        out.noisy_energy(3.0)


def test_a_schedule_that_stops_noising_is_an_error_before_anything_is_charged() -> None:
    release = _release((1.0,), schedule=LambdaNoise(lambda t: 1.0 if t < 3 else float("nan")))
    release.release(2, torch.zeros(3), normalizer=10.0)
    with pytest.raises(PrivacyConfigError, match="noise multiplier at step 3 must be a finite number > 0, found nan"):
        release.release(3, torch.zeros(3), normalizer=10.0)
    assert release.ledger.steps == 1


def test_exponential_mechanism_probabilities() -> None:
    sel = NoiseSelection(epsilon=2.0, loss_bound=3.0)
    p = sel.probabilities(torch.tensor([0.0, 3.0, 10.0, float("nan")]))
    # u = (0, -3, -3, -3): p0 / p1 = exp(ε·3 / (2·3)) = e.
    assert p[0] / p[1] == pytest.approx(math.e)
    assert p[1] == pytest.approx(p[2]) and p[2] == pytest.approx(p[3])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"noise_scales": ()}, "noise_scales"),
        ({"noise_scales": (1.0, -2.0)}, "noise_scales"),
        ({"clip_norm": 0.0}, "clip_norm"),
    ],
)
def test_bad_configuration(kwargs: dict, match: str) -> None:
    args = {
        "noise_scales": (1.0, 3.0),
        "clip_norm": 1.0,
        "sample_rate": 0.1,
        "selection": NoiseSelection(epsilon=0.316, loss_bound=3.0),
    }
    args.update(kwargs)
    with pytest.raises(PrivacyConfigError, match=match):
        SelectedRelease(PrivacyLedger("patient", 1e-5), **args)


_FLOATS = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(_FLOATS, min_size=1, max_size=20), clip=st.floats(min_value=1e-3, max_value=1e3))
@example(values=[0.0, 1.8446744073709552e19], clip=1.0)  # its squared norm overflows float32
def test_clip_never_exceeds_bound_and_is_finite(values: list[float], clip: float) -> None:
    result = clip_update(torch.tensor(values, dtype=torch.float32), clip)
    assert torch.isfinite(result.update).all()
    assert float(torch.linalg.vector_norm(result.update.double())) <= clip * (1 + 1e-5)
    norm = float(torch.linalg.vector_norm(torch.tensor(values, dtype=torch.float64)))
    if all(math.isfinite(v) for v in values) and clip / max(norm, 1e-300) >= torch.finfo(torch.float32).tiny:
        assert result.finite, "a finite update with a huge norm must be clipped, not dropped"
    else:
        assert not result.finite and float(result.update.abs().sum()) == 0.0
