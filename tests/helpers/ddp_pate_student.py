"""Trains a PATE student for one step with N CPU processes (Lightning DDP, gloo) and saves what each rank trained on.

Usage: python tests/helpers/ddp_pate_student.py DEVICES TMP_DIR
TMP_DIR holds the teachers' checkpoints ``teacher_{k}.ckpt`` (written by the test). The student uses
``seed=None`` (fresh OS noise, the config's setting) and the default release file next to the teachers.
Rank 0 writes TMP_DIR/result.pt: every rank's released labels and release digest, and the world size.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_dp.data import SyntheticSilhouettesDataModule  # noqa: E402
from lightning_dp.models import SegmentationModule  # noqa: E402
from lightning_dp.pate import PATEStudentDataModule, PCACompressor  # noqa: E402

DATA = {"num_patients": 16, "images_per_patient": 4, "image_size": 16, "public_fraction": 0.3, "augment": False}


class Gather(pl.Callback):
    """At the start of training, gathers every rank's labels and release digest."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dm = trainer.datamodule
        assert isinstance(dm, PATEStudentDataModule) and dm._train is not None
        mine = (dm._train.tensors[1].clone(), dm._release_digest)
        gathered: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(gathered, mine)
        self.seen = gathered


def main() -> None:
    devices, tmp = int(sys.argv[1]), Path(sys.argv[2])
    teachers = [str(tmp / f"teacher_{k}.ckpt") for k in range(2)]
    data = SyntheticSilhouettesDataModule(root=str(tmp / "data"), **DATA)
    dm = PATEStudentDataModule(data, teachers, PCACompressor(code_dim=4), num_queries=6, batch_size=2, report_path=None)
    torch.manual_seed(0)
    model = SegmentationModule(arch="monai_unet", monai_channels=(4, 8), monai_res_units=0)
    gather = Gather()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp",
        max_steps=1,
        callbacks=[gather],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=tmp / "student",
    )
    trainer.fit(model, dm)
    if trainer.is_global_zero:
        torch.save(
            {
                "labels": [s[0] for s in gather.seen],
                "digests": [s[1] for s in gather.seen],
                "world": trainer.world_size,
            },
            tmp / "result.pt",
        )


if __name__ == "__main__":
    main()
