"""The privacy report shows Zhang et al.'s tCDP closed form only for runs it describes (issue 19, item 4).

The formula models every step as one Poisson-subsampled Gaussian at the decaying multiplier. A run whose steps
also release a private acceptance energy, or select among noisy candidates, costs more: the report printed
0.020 "valid" for such a run whose true ε was ≥ 5.5.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_dp.acceptance import AnnealedAcceptance
from lightning_dp.accounting import (
    ComposedEvent,
    ExponentialMechanismEvent,
    GaussianEvent,
    PoissonSampledEvent,
    ZCDPEvent,
    tcdp_mismatch,
)
from lightning_dp.callbacks import P3SGD
from lightning_dp.schedules import ExponentialDecay
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule
from tests.helpers.samples import SampleClassifier, SampleDataModule, dpsgd, trainer


def _decay() -> ExponentialDecay:
    return ExponentialDecay(initial=4.0, decay=0.99, every=1)


def test_report_shows_no_tcdp_for_a_run_with_a_private_acceptance_energy(tmp_path: Path) -> None:
    energy = AnnealedAcceptance(q0=10.0, mu0=2, energy="private", energy_noise_multiplier=0.3)
    cb = dpsgd(noise_multiplier=_decay(), acceptance=energy)
    trainer(tmp_path, [cb]).fit(SampleClassifier(), SampleDataModule())
    tcdp = cb.report["tcdp_closed_form"]
    assert tcdp["epsilon"] is None and tcdp["valid"] is False
    assert "acceptance energy" in tcdp["not_shown"]
    text = next(tmp_path.rglob("privacy_report.txt")).read_text()
    assert "tCDP closed form (Zhang et al.): not shown" in text
    assert "— valid" not in text


def test_report_shows_no_tcdp_for_a_run_with_a_noise_selection(tmp_path: Path) -> None:
    cb = P3SGD(
        sample_rate=0.25,
        clip_norm=1.0,
        local_lr=0.1,
        seed=7,
        noise_scales=(3.0, 1.0),
        selection_epsilon=0.316,
        loss_bound=3.0,
        noise_schedule=_decay(),
    )
    trainer(tmp_path, [cb], max_steps=2).fit(TinyClassifier(), TinyPatientDataModule())
    tcdp = cb.report["tcdp_closed_form"]
    assert tcdp["epsilon"] is None and "selection (exponential mechanism)" in tcdp["not_shown"]


def test_report_still_shows_tcdp_for_a_plain_decaying_run(tmp_path: Path) -> None:
    cb = dpsgd(noise_multiplier=_decay())
    trainer(tmp_path, [cb]).fit(SampleClassifier(), SampleDataModule())
    assert isinstance(cb.report["tcdp_closed_form"]["epsilon"], float)


@pytest.mark.parametrize(
    ("event", "why"),
    [
        (PoissonSampledEvent(0.1, ComposedEvent((GaussianEvent(4.0), GaussianEvent(0.3)))), "acceptance energy"),
        (PoissonSampledEvent(0.1, ComposedEvent((GaussianEvent(4.0), ExponentialMechanismEvent(1.0, 2)))), "selection"),
        (ComposedEvent((PoissonSampledEvent(0.1, GaussianEvent(4.0)), ZCDPEvent(0.01))), "zCDP"),
        (PoissonSampledEvent(0.2, GaussianEvent(4.0)), "rate 0.2"),
        (PoissonSampledEvent(0.1, GaussianEvent(1.0)), "multiplier 1"),
    ],
)
def test_tcdp_mismatch_names_what_the_formula_does_not_count(event: object, why: str) -> None:
    plain = PoissonSampledEvent(0.1, GaussianEvent(4.0))
    assert tcdp_mismatch([(plain, 2)], 0.1, [4.0, 4.0]) is None
    reason = tcdp_mismatch([(plain, 1), (event, 1)], 0.1, [4.0, 4.0])  # type: ignore[list-item]
    assert reason is not None and reason.startswith("step 1") and why in reason
