"""Issue 23, what a new user trips over: own patient ids, evaluating with the training config, the report."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_dp.callbacks import DPSGD, P3SGD, PrivacyBudget
from lightning_dp.checkpoints import publishable_checkpoint
from lightning_dp.errors import PrivacyStateError, PrivacyWarning
from lightning_dp.training.patient_rounds import RoundParts
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule, TinyPatientDataset
from tests.helpers.samples import IndexedSamples, SampleClassifier, SampleDataModule, dpsgd, trainer


def _trainer(tmp_path: Path, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    args: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 4,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": CSVLogger(tmp_path),
        "default_root_dir": tmp_path,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    args.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **args)


class _StringIdPatients(TinyPatientDataset):
    """A user's own dataset: patients keyed by their hospital ids, not by 0..N-1."""

    def __init__(self, num_patients: int = 12) -> None:
        super().__init__(num_patients=num_patients, per_patient=4)
        self.patient_to_indices = {f"MRN-{p:03d}": idx for p, idx in self.patient_to_indices.items()}


def test_p3sgd_accepts_patient_ids_that_are_not_0_to_n_minus_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dm = TinyPatientDataModule()
    dm.train_dataset = _StringIdPatients()
    seen: list[Any] = []
    cb = P3SGD(sample_rate=0.5, clip_norm=1.0, local_lr=0.1, seed=3)
    original = RoundParts.train_patient

    def spy(self: RoundParts, patient: int, streams: Any) -> None:
        seen.append(self.data.keys[patient])
        original(self, patient, streams)

    monkeypatch.setattr(RoundParts, "train_patient", spy)
    trainer = _trainer(tmp_path, [cb])
    trainer.fit(TinyClassifier(), dm)
    assert cb.rounds == 4 and cb.ledger is not None and cb.ledger.steps == 4
    assert seen, "with q = 0.5 and 12 patients some patient must have been sampled in 4 rounds"
    assert all(str(key).startswith("MRN-") for key in seen), seen
    assert cb.sampler is not None and cb.sampler.num_patients == 12


# ---------------------------------------------------------------------- evaluating with the training config
class _EvalClassifier(SampleClassifier):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test/loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(-1)


class _EvalData(SampleDataModule):
    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(IndexedSamples(16, seed=1), batch_size=8)

    test_dataloader = predict_dataloader = val_dataloader


def _training_callbacks() -> list[pl.Callback]:
    """What a training config holds: the DP callback and its budget, built afresh (as the CLI builds them)."""
    return [dpsgd(), PrivacyBudget(target_epsilon=50.0)]


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", save_last=True)
    fit = trainer(root, [*_training_callbacks(), checkpoint], enable_checkpointing=True, max_steps=2)
    fit.fit(_EvalClassifier(), _EvalData(num_samples=60))
    return root / "ckpt" / "last.ckpt"


@pytest.mark.parametrize("published", [False, True], ids=["training_checkpoint", "publishable_checkpoint"])
def test_validate_test_predict_run_with_the_training_callbacks(
    tmp_path: Path, trained_checkpoint: Path, published: bool
) -> None:
    ckpt = trained_checkpoint
    if published:
        ckpt = tmp_path / "public.ckpt"
        assert publishable_checkpoint(trained_checkpoint, ckpt)[0] == "DPSGD"
    expected = torch.load(ckpt, weights_only=True)["state_dict"]
    for stage in ("validate", "test", "predict"):
        model = _EvalClassifier()
        callbacks = _training_callbacks()
        evaluator = trainer(tmp_path / stage, callbacks, limit_val_batches=None)
        out = getattr(evaluator, stage)(model, _EvalData(num_samples=60), ckpt_path=str(ckpt))
        assert out, f"{stage} returned nothing"
        assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items()), "the checkpoint's weights"
        dp = callbacks[0]
        assert isinstance(dp, DPSGD) and dp.ledger is None, f"{stage} must not restore or start any privacy state"
        assert "training_step" not in vars(model), f"{stage} must not take the module's step over"


def test_resuming_fit_from_a_published_checkpoint_is_still_refused(tmp_path: Path, trained_checkpoint: Path) -> None:
    public = tmp_path / "public.ckpt"
    publishable_checkpoint(trained_checkpoint, public)
    resumed = trainer(tmp_path, _training_callbacks(), max_steps=4)
    with pytest.raises(PrivacyStateError, match="no DPSGD privacy state"):
        resumed.fit(_EvalClassifier(), _EvalData(num_samples=60), ckpt_path=str(public))


# ---------------------------------------------------------------------- the privacy report
def test_report_names_the_guarantee_and_the_run_it_describes(tmp_path: Path) -> None:
    cb = dpsgd()
    fit = trainer(tmp_path, [cb], max_steps=2)
    fit.fit(SampleClassifier(), SampleDataModule(num_samples=60))
    report = json.loads((Path(str(fit.log_dir)) / "privacy_report.json").read_text())
    text = (Path(str(fit.log_dir)) / "privacy_report.txt").read_text()
    assert report["headline"]["accountant"] == "rdp" == cb.accountant.name
    assert report["headline"]["epsilon"] == pytest.approx(float(fit.logged_metrics["privacy/epsilon"]))
    assert f"epsilon: {report['epsilon']['rdp']:.4f}  <- the guarantee (rdp accountant" in text
    assert "other accountants, for comparison: prv" in text and "smallest is a valid guarantee too" in text
    assert report["num_units"] == 60 and "dataset size: N = 60 samples" in text
    assert "clip norm: 1" in text and f"sample rate (per step): {10 / 60:.4g}" in text
    assert report["planned_steps"] == 2 and "steps (rounds): 2 of 2 planned" in text
    assert "stopped_early" not in report


def test_a_calibrated_run_cut_short_by_limit_train_batches_says_so(tmp_path: Path) -> None:
    cb = dpsgd(noise_multiplier=None, target_epsilon=4.0)
    fit = trainer(tmp_path, [cb], max_steps=-1, max_epochs=1, limit_train_batches=2)
    with pytest.warns(PrivacyWarning, match="calibrated for target_epsilon=4.0 over 6 steps, and the run stopped"):
        fit.fit(SampleClassifier(), SampleDataModule(num_samples=60))
    report = json.loads((Path(str(fit.log_dir)) / "privacy_report.json").read_text())
    assert cb.ledger is not None and cb.ledger.steps == 2 and report["planned_steps"] == 6
    assert "after 2" in report["stopped_early"]
    assert "NOTE: the noise was calibrated" in (Path(str(fit.log_dir)) / "privacy_report.txt").read_text()


def test_fast_dev_run_with_target_epsilon_warns_that_it_spends_the_whole_target(tmp_path: Path) -> None:
    cb = dpsgd(noise_multiplier=None, target_epsilon=4.0)
    fit = trainer(tmp_path, [cb], fast_dev_run=True)
    with pytest.warns(PrivacyWarning, match=r"spend the WHOLE target ε = 4.0"):
        fit.fit(SampleClassifier(), SampleDataModule(num_samples=60))


# ---------------------------------------------------------------------- logging every step
@pytest.mark.parametrize("engine", ["DPSGD", "P3SGD"])
def test_privacy_metrics_are_logged_at_every_step_whatever_log_every_n_steps(tmp_path: Path, engine: str) -> None:
    steps = 5
    cb: pl.Callback
    if engine == "DPSGD":
        cb, model, data = dpsgd(), SampleClassifier(), SampleDataModule(num_samples=60)
    else:
        cb = P3SGD(sample_rate=0.25, clip_norm=1.0, local_lr=0.1, seed=7)
        model, data = TinyClassifier(), TinyPatientDataModule()
    fit = trainer(tmp_path, [cb], max_steps=steps, log_every_n_steps=50)  # Lightning's default interval
    fit.fit(model, data)
    with open(Path(str(fit.log_dir)) / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("privacy/epsilon")]
    assert [int(row["step"]) for row in rows] == list(range(steps)), "one privacy/epsilon point per step"
    assert fit.log_every_n_steps == 50, "the user's interval comes back after fit"
