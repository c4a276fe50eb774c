"""PatientDataModule / SyntheticPathologyDataModule: patient-level splits, loaders, augmentation."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_dp.data import (
    DataError,
    DataNotReadyError,
    PatientDataModule,
    RandomRot90,
    SyntheticPathologyDataModule,
    generate_synthetic_pathology,
    split_patients,
)
from lightning_dp.errors import PrivacyConfigError, PrivacyWarning


@pytest.fixture(scope="module")
def synthetic_manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 patients × 4 patches of 16×16."""
    root = tmp_path_factory.mktemp("synthetic")
    return generate_synthetic_pathology(root, num_patients=20, patches_per_patient=4, image_size=16, seed=1)


def _split_manifest(tmp_path: Path, splits: dict[str, str]) -> Path:
    """A manifest with a split column: ``splits`` maps 'patient/image' to its split."""
    lines = ["path,label,patient_id,split"]
    for i, (key, split) in enumerate(splits.items()):
        patient = key.split("/")[0]
        np.save(tmp_path / f"{i}.npy", np.full((8, 8, 3), i, dtype=np.uint8))
        lines.append(f"{i}.npy,{i % 2},{patient},{split}")
    (tmp_path / "m.csv").write_text("\n".join(lines) + "\n")
    return tmp_path / "m.csv"


def _patients_of(dm: PatientDataModule) -> dict[str, set[str]]:
    return {
        "train": set(dm.train_dataset.patient_ids),
        "val": set(dm.val_dataset.patient_ids),
        "test": set(dm.test_dataset.patient_ids),
    }


@pytest.mark.parametrize("method", ["per_patient", "stratified"])
def test_split_is_by_patient_disjoint_and_complete(synthetic_manifest: Path, method: str) -> None:
    dm = PatientDataModule(
        str(synthetic_manifest), val_fraction=0.2, test_fraction=0.3, augment=False, split_method=method
    )
    dm.setup()
    parts = _patients_of(dm)
    ids = [f"P{i:04d}" for i in range(20)]
    assert not parts["train"] & parts["val"] and not parts["train"] & parts["test"] and not parts["val"] & parts["test"]
    assert parts["train"] | parts["val"] | parts["test"] == set(ids)
    if method == "stratified":  # exact sizes: round(0.3·20) test, round(0.2·20) validation
        assert (len(parts["train"]), len(parts["val"]), len(parts["test"])) == (10, 4, 6)
    else:  # each patient by its own id: the sizes are binomial, the split is split_patients' of the ids alone
        expected = split_patients(ids, None, 0.2, 0.3, seed=0)
        assert {k: sorted(v) for k, v in parts.items()} == {k: expected[k] for k in ("train", "val", "test")}
    assert dm.train_patients == sorted(parts["train"])
    assert len(dm.train_dataset) + len(dm.val_dataset) + len(dm.test_dataset) == 80
    # Every image of a patient is in that patient's split.
    for dataset in (dm.train_dataset, dm.val_dataset, dm.test_dataset):
        assert all(len(indices) == 4 for indices in dataset.patient_to_indices.values())


def test_split_is_deterministic_in_split_seed(synthetic_manifest: Path) -> None:
    def split(seed: int) -> dict[str, set[str]]:
        dm = PatientDataModule(str(synthetic_manifest), split_seed=seed)
        dm.setup()
        return _patients_of(dm)

    assert split(0) == split(0)
    assert split(0)["test"] != split(1)["test"]


def test_split_patients_stratified_is_stratified_by_majority_label() -> None:
    ids = [f"p{i:02d}" for i in range(40)]
    labels = [0] * 30 + [1] * 10
    for seed in range(5):
        split = split_patients(ids, labels, val_fraction=0.0, test_fraction=0.2, seed=seed, split_method="stratified")
        positives = sum(int(p) >= 30 for p in (s[1:] for s in split["test"]))
        assert len(split["test"]) == 8 and positives in (1, 2, 3)  # about a quarter, like the whole
        assert split["val"] == []


def test_too_few_patients_for_the_splits() -> None:
    with pytest.raises(PrivacyConfigError, match=r"must leave at least one training patient, found 2 patient\(s\)"):
        split_patients(["a", "b"], [0, 1], val_fraction=0.1, test_fraction=0.1, seed=0, split_method="stratified")
    # Per patient: refused only when no patient at all lands in train, with the numbers and a hint.
    with pytest.raises(
        PrivacyConfigError,
        match=r"found 3 patient\(s\) and none for training \(1 val, 2 test; .*binomial, expected 0\.03\)\. HINT: use",
    ):
        split_patients(["a", "b", "c"], None, val_fraction=0.5, test_fraction=0.49, seed=0)
    with pytest.raises(PrivacyConfigError, match=r"needs each patient's majority label, found none"):
        split_patients(["a", "b"], None, val_fraction=0.1, test_fraction=0.1, seed=0, split_method="stratified")
    with pytest.raises(
        PrivacyConfigError, match=r"split_method must be one of per_patient, stratified, found 'random'"
    ):
        PatientDataModule("m.csv", split_method="random")  # type: ignore[arg-type]


def test_an_empty_requested_split_is_warned_about_not_refused() -> None:
    # Whether a 10 % split of 5 patients holds anyone depends on the other patients: a refusal would publish it.
    ids = [f"P{i:04d}" for i in range(5)]
    with pytest.warns(PrivacyWarning, match=r"the val split holds no patient \(expected 0\.5 of 5.*data holder only"):
        split = split_patients(ids, None, val_fraction=0.1, test_fraction=0.2, seed=0)
    assert split["val"] == [] and split["train"] and sorted(sum(split.values(), [])) == ids


def test_manifest_split_column_is_used(tmp_path: Path) -> None:
    manifest = _split_manifest(
        tmp_path, {"a/1": "train", "a/2": "train", "b/1": "val", "c/1": "test", "c/2": "test", "d/1": "train"}
    )
    dm = PatientDataModule(str(manifest), val_fraction=0.5, test_fraction=0.4)  # fractions are ignored
    dm.setup()
    assert _patients_of(dm) == {"train": {"a", "d"}, "val": {"b"}, "test": {"c"}}
    assert len(dm.train_dataset) == 3


def test_manifest_split_with_a_patient_in_two_splits_names_the_patients(tmp_path: Path) -> None:
    manifest = _split_manifest(
        tmp_path,
        {"p1/1": "train", "p2/1": "train", "p2/2": "test", "p3/1": "val", "p4/1": "val", "p4/2": "train"},
    )
    dm = PatientDataModule(str(manifest))
    with pytest.raises(
        DataError,
        match=r"every patient must be in exactly one split, found 2 patient\(s\) in several: "
        r"'p2' in test\+train, 'p4' in train\+val\. HINT",
    ):
        dm.setup()


def test_manifest_split_without_training_patients(tmp_path: Path) -> None:
    dm = PatientDataModule(str(_split_manifest(tmp_path, {"a/1": "val", "b/1": "test"})))
    with pytest.raises(DataError, match=r"the training split must hold at least one patient"):
        dm.setup()


def test_loaders_yield_images_labels_patients(synthetic_manifest: Path) -> None:
    dm = PatientDataModule(str(synthetic_manifest), batch_size=8, augment=True)
    dm.setup()
    assert dm.num_classes == 2
    for loader, dataset in (
        (dm.train_dataloader(), dm.train_dataset),
        (dm.val_dataloader(), dm.val_dataset),
        (dm.test_dataloader(), dm.test_dataset),
    ):
        images, labels, patients = next(iter(loader))
        assert images.dtype == torch.float32 and images.shape == (min(8, len(dataset)), 3, 16, 16)
        assert labels.dtype == torch.int64 and set(labels.tolist()) <= {0, 1}
        assert patients.dtype == torch.int64 and int(patients.min()) >= 0 and int(patients.max()) < dataset.num_patients
        assert len(loader) == -(-len(dataset) // 8)


def test_train_loader_shuffles_and_eval_loaders_do_not(synthetic_manifest: Path) -> None:
    dm = PatientDataModule(str(synthetic_manifest), batch_size=100, augment=False)
    dm.setup()
    torch.manual_seed(0)
    first = next(iter(dm.train_dataloader()))[2].tolist()
    assert first != sorted(first)
    assert next(iter(dm.test_dataloader()))[2].tolist() == sorted(next(iter(dm.test_dataloader()))[2].tolist())


def test_image_size_resizes_every_split(synthetic_manifest: Path) -> None:
    dm = PatientDataModule(str(synthetic_manifest), image_size=24, batch_size=4)
    dm.setup()
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader()):
        assert next(iter(loader))[0].shape == (4, 3, 24, 24)


def test_augment_only_on_train(synthetic_manifest: Path) -> None:
    dm = PatientDataModule(str(synthetic_manifest), augment=True)
    dm.setup()
    torch.manual_seed(0)
    train_views = [dm.train_dataset[0][0] for _ in range(8)]
    assert any(not torch.equal(train_views[0], view) for view in train_views[1:])
    for dataset in (dm.val_dataset, dm.test_dataset):
        assert dataset.transform is None
        assert torch.equal(dataset[0][0], dataset[0][0])
    plain = PatientDataModule(str(synthetic_manifest), augment=False)
    plain.setup()
    assert plain.train_dataset.transform is None
    # The augmented view is a flip/rotation of the image, colours lightly jittered.
    raw = plain.train_dataset[0][0]
    assert train_views[0].shape == raw.shape
    assert abs(float(train_views[0].mean()) - float(raw.mean())) < 0.1


def test_random_rot90_covers_all_rotations() -> None:
    torch.manual_seed(0)
    image = torch.arange(4.0).reshape(1, 2, 2)
    seen = {tuple(RandomRot90()(image).flatten().tolist()) for _ in range(40)}
    assert len(seen) == 4


def test_datasets_before_setup_are_an_error(synthetic_manifest: Path) -> None:
    dm = PatientDataModule(str(synthetic_manifest))
    with pytest.raises(DataNotReadyError, match=r"`PatientDataModule\.train_dataset`: setup\(\) must run first"):
        dm.train_dataset  # noqa: B018
    with pytest.raises(DataNotReadyError):
        dm.num_classes  # noqa: B018


def test_empty_validation_split(synthetic_manifest: Path) -> None:
    dm = PatientDataModule(str(synthetic_manifest), val_fraction=0.0)
    dm.setup()
    assert dm.val_dataloader() == []
    with pytest.raises(DataError, match=r"the val split must hold at least one patient.*HINT: set val_fraction > 0"):
        dm.val_dataset  # noqa: B018


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, r"`PatientDataModule\(batch_size=0\)`: batch_size must be an integer >= 1, found 0"),
        ({"val_fraction": 1.0}, r"val_fraction must be a number in \[0, 1\), found 1\.0"),
        ({"test_fraction": -0.1}, r"test_fraction must be a number in \[0, 1\), found -0\.1"),
        ({"val_fraction": 0.5, "test_fraction": 0.5}, r"val_fraction \+ test_fraction must be < 1, found 1\.0"),
        ({"num_workers": -1}, r"num_workers must be an integer >= 0"),
        ({"image_size": 0}, r"image_size must be an integer >= 1"),
    ],
)
def test_invalid_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(PrivacyConfigError, match=match):
        PatientDataModule("does-not-matter.csv", **kwargs)


def test_missing_manifest_fails_in_setup(tmp_path: Path) -> None:
    dm = PatientDataModule(str(tmp_path / "missing.csv"))
    with pytest.raises(DataError, match=r"must be an existing CSV file"):
        dm.setup()


def test_synthetic_datamodule_generates_lazily_and_loads_through_the_manifest(tmp_path: Path) -> None:
    root = tmp_path / "synth"
    dm = SyntheticPathologyDataModule(
        root=str(root),
        num_patients=10,
        patches_per_patient=3,
        image_size=16,
        seed=2,
        batch_size=5,
        augment=False,
        val_fraction=0.2,
    )
    dm.setup()  # no prepare_data(): generated here
    assert (root / "manifest.csv").is_file() and (root / "synthetic.json").is_file()
    assert dm.train_dataset.paths[0].suffix == ".png"
    assert dm.num_classes == 2
    assert sum(len(d) for d in (dm.train_dataset, dm.val_dataset, dm.test_dataset)) == 30
    assert next(iter(dm.train_dataloader()))[0].shape == (5, 3, 16, 16)
    assert dm.hparams["root"] == str(root) and dm.hparams["num_patients"] == 10 and "manifest" not in dm.hparams


def test_synthetic_datamodule_validates_before_any_io(tmp_path: Path) -> None:
    with pytest.raises(PrivacyConfigError, match=r"image_size must be an integer >= 16, found 4"):
        SyntheticPathologyDataModule(root=str(tmp_path / "x"), image_size=4)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("cls", [PatientDataModule, SyntheticPathologyDataModule])
def test_constructors_take_typed_explicit_keyword_arguments(cls: type) -> None:
    # LightningCLI builds its schema from these annotations: no **kwargs, every argument typed.
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert parameters and all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters)
    assert all(p.annotation is not inspect.Parameter.empty for p in parameters)


def test_jsonargparse_can_build_the_datamodule(tmp_path: Path) -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(SyntheticPathologyDataModule, "data")
    config = parser.parse_args(["--data.root", str(tmp_path), "--data.num_patients", "7", "--data.augment", "false"])
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in 4.49
    init = instantiate(config)
    assert isinstance(init.data, SyntheticPathologyDataModule)
    assert init.data.generator_kwargs["num_patients"] == 7 and init.data.augment is False


def test_train_eval_loader_is_the_training_patients_without_augmentation(tmp_path: Path) -> None:
    from lightning_dp.data import SyntheticPathologyDataModule

    dm = SyntheticPathologyDataModule(
        root=str(tmp_path / "syn"),
        num_patients=6,
        patches_per_patient=3,
        image_size=16,
        val_fraction=0.0,
        test_fraction=0.34,
        augment=True,
    )
    dm.setup()
    first = torch.cat([b[0] for b in dm.train_eval_dataloader()])
    second = torch.cat([b[0] for b in dm.train_eval_dataloader()])
    assert len(first) == len(dm.train_dataset)
    assert torch.equal(first, second), "the evaluation view of the training data must not be augmented"
    augmented = torch.stack([dm.train_dataset[i][0] for i in range(len(dm.train_dataset))])
    assert not torch.equal(augmented, first), "the training loader itself still augments"
