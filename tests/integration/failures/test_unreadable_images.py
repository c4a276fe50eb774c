"""Start-up checks over a training set with an unreadable image (issue 41, "Smaller", item 2).

Found by an independent privacy review: a site's start-up checks (`training.checks.diverse_indices` and what runs on
what it picks: the independence check, the choice of the batched or stacked round) read up to 256 training items in a
public order, and one item whose read raised made the whole start fail. Across hospitals that stopped the consortium
from starting: run or no run told one bit about one patient's image. An unreadable item is skipped now, like a failing
patient in a site's round; too few readable items send the checks to the safe path (the loop; DPSGD refuses with a
fixed message), and what comes out of them is a fixed text, never the read's error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_dp.callbacks import P3SGD
from lightning_dp.errors import PrivacyConfigError
from lightning_dp.federated import Site
from lightning_dp.sanitization import ModelState
from lightning_dp.training.batches import loss_of
from lightning_dp.training.checks import PUBLIC_SEED, independence
from lightning_dp.training.patient_rounds import LocalSGD, PatientData, RoundParts, choose_round
from tests.helpers.patients import TinyClassifier, TinyPatientDataset
from tests.helpers.samples import dpsgd, trainer

PATIENTS, PER_PATIENT = 50, 6  # 300 images: the checks scan the first 256 of a public order
SECRET = "/data/MRN-0042/slide-7.png"  # what a read's error would quote: it must never come out of the checks


def _in_public_order() -> int:
    """An index drawn at random (fixed seed) among the first 256 of the checks' public order, not 0."""
    order = np.random.default_rng(PUBLIC_SEED).permutation(PATIENTS * PER_PATIENT)[:256]
    return int(np.random.default_rng(41).choice([i for i in order if i != 0]))


BAD = {"index 0": {0}, "in the public order": {_in_public_order()}, "both": {0, _in_public_order()}}


class _Unreadable(TinyPatientDataset):
    """`TinyPatientDataset` whose items ``bad`` raise on every read (a corrupt file); counts the attempts."""

    def __init__(self, bad: set[int]) -> None:
        super().__init__(PATIENTS, PER_PATIENT)
        self.bad = set(bad)
        self.attempts = 0

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        if int(i) in self.bad:
            self.attempts += 1
            raise OSError(f"cannot read {SECRET}")
        return super().__getitem__(i)


class _Data(pl.LightningDataModule):
    def __init__(self, bad: set[int]) -> None:
        super().__init__()
        self.train_dataset = _Unreadable(bad)
        self.declared_num_patients, self.declared_num_samples = PATIENTS, PATIENTS * PER_PATIENT  # N, public

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_dataset, batch_size=8)


class _RepairedAfterStart(pl.Callback):
    """Makes the bad items readable once the DP callback's start-up checks ran (listed after it).

    What the rounds or the loader do with an image that stays unreadable is not what these tests are about; the
    start-up checks met it as a permanently unreadable file.
    """

    def __init__(self, dataset: _Unreadable) -> None:
        self.dataset = dataset
        self.read_at_start = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.read_at_start = self.dataset.attempts
        self.dataset.bad = set()


def _model() -> TinyClassifier:
    torch.manual_seed(0)
    return TinyClassifier(batchnorm=False)


@pytest.mark.parametrize(("local_epochs", "path"), [(1, "batched"), (2, "stacked")])
@pytest.mark.parametrize("where", sorted(BAD))
def test_a_site_with_an_unreadable_image_starts_vectorized_and_answers(
    where: str, local_epochs: int, path: str
) -> None:
    data = _Data(BAD[where])
    site = Site.from_lightning(
        "hospital-a",
        _model(),
        data,
        sample_rate=1.0,
        clip_norm=1.0,
        local=LocalSGD(lr=0.1, epochs=local_epochs),
        seed=0,
        vectorize="auto",
    )
    assert data.train_dataset.attempts > 0, "the premise: the start-up checks tried to read the unreadable image"
    assert site.round.path == path, "an unreadable image is skipped: the checks still run on the others"
    reply = site.reply(site.parts.state.vector(), round_number=0)  # every patient, the unreadable one included
    assert bool(torch.isfinite(reply).all()) and float(reply.norm()) > 0


@pytest.mark.parametrize(("local_epochs", "path"), [(1, "batched"), (2, "stacked")])
@pytest.mark.parametrize("where", ["index 0", "in the public order"])
def test_p3sgd_with_an_unreadable_image_starts_vectorized_and_trains(
    tmp_path: Path, where: str, local_epochs: int, path: str
) -> None:
    data = _Data(BAD[where])
    repaired = _RepairedAfterStart(data.train_dataset)
    cb = P3SGD(sample_rate=0.2, clip_norm=1.0, local_lr=0.1, local_epochs=local_epochs, seed=3, vectorize="auto")
    trainer(tmp_path, [cb, repaired], max_steps=2).fit(_model(), data)
    assert repaired.read_at_start > 0, "the premise: the start-up checks tried to read the unreadable image"
    assert cb.round_path == path
    assert cb.steps == 2


@pytest.mark.parametrize("where", ["index 0", "in the public order"])
def test_dpsgd_with_an_unreadable_image_starts_and_trains(tmp_path: Path, where: str) -> None:
    data = _Data(BAD[where])
    repaired = _RepairedAfterStart(data.train_dataset)
    cb = dpsgd()
    trainer(tmp_path, [cb, repaired], max_steps=2).fit(_model(), data)
    assert repaired.read_at_start > 0, "the premise: the start-up check tried to read the unreadable image"
    assert cb.steps == 2


# ---------------------------------------------------------------------- too few readable items: the safe path
def _parts(bad: set[int], local_epochs: int = 1) -> RoundParts:
    model = _model()
    dataset = _Unreadable(bad)
    groups = [list(v) for v in dataset.patient_to_indices.values()]
    data = PatientData(dataset, groups, list(dataset.patient_to_indices))
    return RoundParts(model, ModelState(model), model.training_step, data, LocalSGD(epochs=local_epochs), 1.0)


@pytest.mark.parametrize("local_epochs", [1, 2])
@pytest.mark.parametrize("readable", [0, 1])
def test_with_too_few_readable_images_the_round_is_the_loop_for_a_fixed_reason(
    readable: int, local_epochs: int
) -> None:
    bad = set(range(readable, PATIENTS * PER_PATIENT))
    choice = choose_round(_parts(bad, local_epochs), "auto", 256)
    assert choice.path == "loop"
    assert choice.reason is not None and "read" in choice.reason and SECRET not in choice.reason


@pytest.mark.parametrize("readable", [0, 1])
def test_with_too_few_readable_images_the_independence_check_does_not_pass(readable: int) -> None:
    parts = _parts(set(range(readable, PATIENTS * PER_PATIENT)))
    data = parts.data
    found = independence(parts.module, [], parts.step, loss_of, "mean", data.dataset, data.collate, data.to_device)
    assert found.failure == "unchecked" and found.check is None


def test_dpsgd_refuses_with_a_fixed_message_when_it_cannot_check(tmp_path: Path) -> None:
    data = _Data(set(range(1, PATIENTS * PER_PATIENT)))
    with pytest.raises(PrivacyConfigError, match="could not run") as raised:
        trainer(tmp_path, [dpsgd()], max_steps=1).fit(_model(), data)
    assert SECRET not in str(raised.value) and raised.value.__cause__ is None and raised.value.__context__ is None
