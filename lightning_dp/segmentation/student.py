"""PATE's student data from a config: teachers' checkpoints in, privately labelled public images out.

`PATEStudentDataModule` wraps a `SegmentationDataModule` (whose public split holds the public images),
loads the K teachers' checkpoints, checks that they were trained on the K disjoint partitions of the
same training patients (from the datamodule hyper-parameters Lightning stores in every checkpoint),
predicts the public queries, fits the compressor on the masks of *other* public patients (the
"atlas"), releases the aggregated labels through `PATEAggregator` and serves (image, label) pairs for
training; validation and test come from the wrapped datamodule. So a LightningCLI run trains the
student::

    lightning-dp fit --config configs/segmentation_pate_teacher.yaml --data.init_args.teacher 0   # ... K-1
    lightning-dp fit --config configs/segmentation_pate_student.yaml
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.errors import PrivacyConfigError, check_in_interval
from lightning_dp.segmentation.compression import AutoencoderCompressor, Compressor
from lightning_dp.segmentation.pate import PATEAggregator, PATEReport, pate_noise_multiplier

__all__ = ["PATEStudentDataModule"]

#: Datamodule settings that must agree between the teachers and the student (same patients, same split).
_SAME = (
    "manifest",
    "root",
    "num_patients",
    "images_per_patient",
    "image_size",
    "seed",
    "split_seed",
    "val_fraction",
    "test_fraction",
    "public_fraction",
    "num_teachers",
    "teacher_seed",
)


class PATEStudentDataModule(pl.LightningDataModule):
    """Public images labelled by K teachers through PATE's private aggregation; val/test from ``data``.

    Args:
        data: the teachers' datamodule without ``teacher`` set (its public split holds the public images).
        teacher_checkpoints: the K teachers' Lightning checkpoints (``SegmentationModule``), trained with
            ``data.init_args.teacher = 0 … K−1`` and the same ``num_teachers``.
        compressor: a `PCACompressor` or `AutoencoderCompressor` (fitted here, on the atlas masks). An
            autoencoder's ``bottleneck_noise`` of ``-1`` is set to the aggregation's noise std.
        target_epsilon: the patient-level ε of the labels (the noise is calibrated to it).
        delta: δ of the guarantee.
        num_queries: N, how many public images are labelled (ε grows with N); ``None``: all query images.
        atlas_fraction: the fraction of public patients whose masks fit the compressor (their images
            are not queried).
        batch_size: batch size of the student's training loader.
        seed: seed of the aggregation noise; ``None`` (default) draws one from the OS.
        report_path: where the PATE privacy report is written (text); ``None``: not written.
    """

    def __init__(
        self,
        data: pl.LightningDataModule,
        teacher_checkpoints: Sequence[str],
        compressor: Compressor,
        target_epsilon: float = 2.0,
        delta: float = 1e-7,
        num_queries: int | None = None,
        atlas_fraction: float = 0.5,
        batch_size: int = 32,
        seed: int | None = None,
        report_path: str | None = "pate_privacy_report.txt",
    ) -> None:
        super().__init__()
        owner = "PATEStudentDataModule"
        check_in_interval(
            owner,
            "atlas_fraction",
            atlas_fraction,
            0.0,
            1.0,
            low_closed=False,
            high_closed=False,
            hint="e.g. 0.5 of the public patients fit the compressor, the rest are queried.",
        )
        if len(teacher_checkpoints) < 2:
            raise PrivacyConfigError(
                f"`{owner}(teacher_checkpoints=...)`: PATE needs K ≥ 2 teachers, found {len(teacher_checkpoints)}. "
                "HINT: train teachers 0..K-1 with configs/segmentation_pate_teacher.yaml."
            )
        self.data, self.checkpoints, self.compressor = data, [str(c) for c in teacher_checkpoints], compressor
        self.target_epsilon, self.delta, self.num_queries = target_epsilon, delta, num_queries
        self.atlas_fraction, self.batch_size, self.seed, self.report_path = (
            atlas_fraction,
            batch_size,
            seed,
            report_path,
        )
        self.report: PATEReport | None = None
        self._train: TensorDataset | None = None

    def _check_teachers(self) -> list[Any]:
        from lightning_dp.models import SegmentationModule

        k, reference = len(self.checkpoints), None
        seen: dict[int, str] = {}
        for path in self.checkpoints:
            if not os.path.isfile(path):
                raise PrivacyConfigError(f"`PATEStudentDataModule`: teacher checkpoint {path!r} does not exist.")
            hp = torch.load(path, map_location="cpu", weights_only=False).get("datamodule_hyper_parameters")
            if not hp or hp.get("teacher") is None or hp.get("num_teachers") is None:
                raise PrivacyConfigError(
                    f"`PATEStudentDataModule`: {path!r} does not say which teacher partition it was trained on (no "
                    "datamodule teacher/num_teachers in the checkpoint), so disjointness cannot be checked. HINT: "
                    "train teachers with a SegmentationDataModule(teacher=k, num_teachers=K) through a Trainer."
                )
            if hp["num_teachers"] != k:
                raise PrivacyConfigError(
                    f"`PATEStudentDataModule`: {path!r} was trained as one of num_teachers={hp['num_teachers']}, but "
                    f"{k} checkpoints are given. HINT: give exactly the K checkpoints of one teacher split."
                )
            if hp["teacher"] in seen:
                raise PrivacyConfigError(
                    f"`PATEStudentDataModule`: {seen[hp['teacher']]!r} and {path!r} were both trained on teacher "
                    f"partition {hp['teacher']}: one patient would change two teachers. HINT: one checkpoint per "
                    "partition 0..K-1."
                )
            seen[hp["teacher"]] = path
            same = {key: hp.get(key) for key in _SAME}
            if reference is not None and same != reference:
                differ = [f"{key}: {same[key]!r} vs {reference[key]!r}" for key in _SAME if same[key] != reference[key]]
                raise PrivacyConfigError(
                    f"`PATEStudentDataModule`: {path!r} was trained on another data split than the first teacher "
                    f"({', '.join(differ)} differ), so the partitions may overlap. HINT: train all teachers from one "
                    "config, changing only data.init_args.teacher."
                )
            reference = same
        assert reference is not None
        settings = _settings(self.data)
        mine = {key: settings.get(key) for key in _SAME if reference.get(key) is not None and key in settings}
        mine.pop("num_teachers", None)
        mine.pop("teacher_seed", None)
        if {key: reference[key] for key in mine} != mine:
            differ = [f"{key}: {mine[key]!r} vs {reference[key]!r}" for key in mine if mine[key] != reference[key]]
            raise PrivacyConfigError(
                f"`PATEStudentDataModule(data=...)`: the student's data differ from the teachers' ({', '.join(differ)})"
                ": the public images might be some teacher's training images. HINT: use the teachers' data settings "
                "without teacher/num_teachers."
            )
        return [SegmentationModule.load_from_checkpoint(p, map_location="cpu").eval() for p in self.checkpoints]

    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return
        data: Any = self.data
        if getattr(data, "num_teachers", None) is not None:
            raise PrivacyConfigError(
                "`PATEStudentDataModule(data=...)`: the wrapped datamodule is restricted to one teacher's partition. "
                "HINT: remove teacher/num_teachers from the student's data."
            )
        teachers = self._check_teachers()
        data.prepare_data()
        data.setup(stage)
        public = data.public_dataset
        if public is None:
            raise PrivacyConfigError(
                "`PATEStudentDataModule`: the data has no public split. HINT: set public_fraction (e.g. 0.3)."
            )
        ids = public.patient_ids
        cut = max(1, round(self.atlas_fraction * len(ids)))
        if cut >= len(ids):
            raise PrivacyConfigError(
                f"`PATEStudentDataModule(atlas_fraction={self.atlas_fraction})`: {len(ids)} public patients leave none "
                "to query. HINT: lower atlas_fraction or raise public_fraction."
            )
        atlas = public.subset_by_patients(ids[:cut])
        queries_ds = public.subset_by_patients(ids[cut:])
        atlas_masks = torch.stack([atlas[i][1] for i in range(len(atlas))])
        queries = torch.stack([queries_ds[i][0] for i in range(len(queries_ds))])
        if self.num_queries is not None:
            queries = queries[: self.num_queries]
        with torch.no_grad():
            maps = torch.stack(
                [torch.cat([t(queries[i : i + 64]).sigmoid() for i in range(0, len(queries), 64)]) for t in teachers]
            )
        if isinstance(self.compressor, AutoencoderCompressor) and self.compressor.bottleneck_noise is None:
            z = pate_noise_multiplier(self.target_epsilon, self.delta, len(queries))  # what aggregate() will use
            self.compressor.bottleneck_noise = z * self.compressor.sensitivity / len(teachers)
        self.compressor.fit(atlas_masks)
        aggregator = PATEAggregator(
            self.compressor, len(teachers), delta=self.delta, target_epsilon=self.target_epsilon, seed=self.seed
        )
        released = aggregator.aggregate(maps)
        self.report = released.report
        print(released.report)
        if self.report_path is not None:
            Path(self.report_path).write_text(str(released.report) + "\n")
        self._train = TensorDataset(queries, released.maps.float())

    def train_dataloader(self) -> DataLoader[Any]:
        assert self._train is not None
        return DataLoader(self._train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> Any:
        return self.data.val_dataloader()

    def test_dataloader(self) -> Any:
        return self.data.test_dataloader()


def _settings(data: Any) -> dict[str, Any]:
    """The split-defining settings of a segmentation datamodule, read from its attributes."""
    out = {key: getattr(data, key) for key in _SAME if hasattr(data, key)}
    out.update(getattr(data, "generator_kwargs", {}))
    return out
