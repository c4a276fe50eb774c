"""A non-private ResNet-18 overfits the synthetic pathology data (what patient-level DP should limit).

The generator gives every patient a recognisable style and mostly one class, and labels some patches
by the patient's majority class; a network that memorises patients scores higher on its training
patients than on new ones. This test checks that the data set really has that property, through
the real loading path (PNG files, manifest, patient-level split).

Measured (torch 2.14, 6 epochs, 840 training / 360 test patches of 32×32 from 42 / 18 patients, two threads):
train 0.988, test 0.811, gap 17.7 points, test majority class 0.536; 77 CPU-seconds. (With 30 patches per
patient: gap 20.2 points at 1.5× the cost; with 15, test accuracy fell to 0.68–0.72 depending on the thread
count, too close to the bound below.)
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torchvision

from lightning_dp.data import PatientImageDataset, SyntheticPathologyDataModule

MIN_GAP = 0.03  # train accuracy − test accuracy, in accuracy units (3 points)
MIN_TEST_ACCURACY = 0.65  # chance is 0.5 (balanced labels); the majority class of the test split is checked too
EPOCHS = 6


def _accuracy(model: torch.nn.Module, dataset: PatientImageDataset) -> float:
    model.eval()
    loader = torch.utils.data.DataLoader(dataset, batch_size=256)
    correct = 0
    with torch.no_grad():
        for images, labels, _ in loader:
            correct += int((model(images).argmax(dim=1) == labels).sum())
    model.train()
    return correct / len(dataset)


@pytest.mark.slow
def test_resnet18_overfits_when_split_by_patient(tmp_path: Path, record_property: pytest.RecordProperty) -> None:
    start, cpu_start = time.perf_counter(), time.process_time()
    torch.manual_seed(0)
    dm = SyntheticPathologyDataModule(
        root=str(tmp_path / "synthetic"),
        num_patients=60,
        patches_per_patient=20,
        image_size=32,
        seed=0,
        batch_size=32,
        val_fraction=0.0,
        test_fraction=0.3,
        augment=False,  # augmentation would slow the memorisation this test is about
        split_method="stratified",  # synthetic public data; the numbers above were measured with this split
    )
    dm.prepare_data()
    dm.setup()
    assert len(dm.train_patients) == 42 and dm.test_dataset.num_patients == 18

    model = torchvision.models.resnet18(num_classes=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = dm.train_dataloader()
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=1e-3, total_steps=EPOCHS * len(loader), pct_start=0.15
    )
    for _ in range(EPOCHS):
        for images, labels, _ in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
            schedule.step()

    train_accuracy = _accuracy(model, dm.train_dataset)
    test_accuracy = _accuracy(model, dm.test_dataset)
    test_labels = dm.test_dataset.labels.float()
    majority_rate = max(float(test_labels.mean()), 1.0 - float(test_labels.mean()))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    for name, value in (("train_accuracy", train_accuracy), ("test_accuracy", test_accuracy), ("seconds", seconds)):
        record_property(name, round(value, 4))
    print(
        f"resnet18 on synthetic pathology: train {train_accuracy:.3f}, test {test_accuracy:.3f}, "
        f"gap {100 * (train_accuracy - test_accuracy):.1f} points, test majority class {majority_rate:.3f}, "
        f"{seconds:.0f} s wall, {cpu_seconds:.0f} s CPU"
    )
    assert train_accuracy - test_accuracy >= MIN_GAP
    assert test_accuracy >= MIN_TEST_ACCURACY
    assert test_accuracy >= majority_rate + 0.1  # it learned the glomeruli, not just the class balance
