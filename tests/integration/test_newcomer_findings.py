"""Issue 23, what a new user trips over: own patient ids, evaluating with the training config, the report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.loggers import CSVLogger

from lightning_dp.callbacks import P3SGD
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule, TinyPatientDataset


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


def test_p3sgd_accepts_patient_ids_that_are_not_0_to_n_minus_1(tmp_path: Path) -> None:
    dm = TinyPatientDataModule()
    dm.train_dataset = _StringIdPatients()
    seen: list[Any] = []
    cb = P3SGD(sample_rate=0.5, clip_norm=1.0, local_lr=0.1, seed=3)
    original = cb._local_update

    def spy(patient: Any, *args: Any) -> None:
        seen.append(patient)
        original(patient, *args)

    cb._local_update = spy  # type: ignore[method-assign]
    trainer = _trainer(tmp_path, [cb])
    trainer.fit(TinyClassifier(), dm)
    assert cb.rounds == 4 and cb.ledger is not None and cb.ledger.steps == 4
    assert seen, "with q = 0.5 and 12 patients some patient must have been sampled in 4 rounds"
    assert cb.sampler is not None and cb.sampler.num_patients == 12
