"""N is declared before the data are counted (issue 41, "the normalizer follows the data's count").

The fourth independent review: single-site P3SGD and DPSGD divided by q·N with N the training set's own count, and
DPSGD's q = batch_size/N, the default δ and the report followed it too, so one added unit changed the scale of every
released update and the δ, outside the noise. Now N comes from ``P3SGD(num_patients=…)`` / ``DPSGD(num_samples=…)``
or the datamodule's ``declared_num_patients`` / ``declared_num_samples``; without one, fit refuses. These tests fail on
the code before the fix (its normalizer, δ and report moved with the data; it trained without any declaration).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
from pytorch_lightning.loggers import CSVLogger

from lightning_dp.callbacks import DPSGD, P3SGD
from lightning_dp.errors import PrivacyConfigError, PrivacyWarning
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule
from tests.helpers.samples import SampleClassifier, SampleDataModule


class _Counted(TinyPatientDataModule):
    """Patients as the tiny datamodule holds them, with nothing declared (a datamodule that only reads data)."""

    def __init__(self, num_patients: int) -> None:
        super().__init__(num_patients=num_patients)
        del self.declared_num_patients, self.declared_num_samples


def _fit(root: Path, callback: pl.Callback, data: pl.LightningDataModule, model: pl.LightningModule) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    logger = CSVLogger(str(root))
    trainer = pl.Trainer(
        default_root_dir=str(root),
        max_steps=2,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(model, data)
    metrics = (Path(logger.log_dir) / "metrics.csv").read_text()
    return {"report": callback.report, "metrics_header": metrics.splitlines()[0], "delta": callback.ledger.delta}


def _p3sgd(**kwargs: Any) -> P3SGD:
    return P3SGD(sample_rate=0.5, clip_norm=1.0, noise_scales=(1.0,), seed=3, **kwargs)


def test_p3sgd_neighbouring_data_sets_under_one_declaration_release_at_one_scale_and_report_alike(
    tmp_path: Path,
) -> None:
    runs = {}
    for patients in (20, 21):  # D and D plus one patient, under the same declared N = 20
        with pytest.warns(PrivacyWarning, match="does not hold the declared N") if patients == 21 else nullcontext():
            runs[patients] = _fit(
                tmp_path / str(patients), _p3sgd(num_patients=20), _Counted(patients), TinyClassifier(batchnorm=False)
            )
    d, d_plus = runs[20], runs[21]
    assert d["report"]["num_units"] == d_plus["report"]["num_units"] == 20
    assert d["delta"] == d_plus["delta"] == pytest.approx(min(1e-5, 1 / 200))
    for key in ("epsilon", "noise_std_first", "noise_multiplier"):
        if key in d["report"]:
            assert d["report"][key] == d_plus["report"][key]


def test_dpsgd_q_is_batch_size_over_the_declared_n_and_the_logged_batch_is_public(tmp_path: Path) -> None:
    reports = []
    for samples in (60, 61):
        data = SampleDataModule(num_samples=samples)
        del data.declared_num_samples
        callback = DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=12, num_samples=60, seed=3)
        with pytest.warns(PrivacyWarning, match="does not hold the declared N") if samples == 61 else nullcontext():
            reports.append(_fit(tmp_path / str(samples), callback, data, SampleClassifier())["report"])
    assert [r["sample_rate"] for r in reports] == [0.2, 0.2]  # 12 / 60 in both worlds, never 12 / 61
    assert [r["num_samples"] for r in reports] == [60, 60]
    assert reports[0]["epsilon"] == reports[1]["epsilon"]


def test_the_synthetic_datamodules_declare_n_from_their_configuration_and_fit_uses_it(tmp_path: Path) -> None:
    # TinyPatientDataModule declares its configured count; the callback's own argument wins over it.
    assert (
        _fit(tmp_path / "dm", _p3sgd(), TinyPatientDataModule(), TinyClassifier(batchnorm=False))["report"]["num_units"]
        == 20
    )
    with pytest.warns(PrivacyWarning, match="declared N = 25"):
        report = _fit(tmp_path / "arg", _p3sgd(num_patients=25), TinyPatientDataModule(), TinyClassifier())["report"]
    assert report["num_units"] == 25


@pytest.mark.parametrize(
    "callback", [lambda: _p3sgd(), lambda: DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=8)]
)
def test_without_a_declaration_fit_refuses_before_any_step(tmp_path: Path, callback: Any) -> None:
    cb = callback()
    with pytest.raises(PrivacyConfigError, match=r"must be declared public before the data are counted.*HINT"):
        _fit(tmp_path, cb, _Counted(20), TinyClassifier(batchnorm=False))
    assert cb.ledger is None or cb.ledger.steps == 0
