"""What the consortium trains, and how a site finds its patients: the file to edit.

* `build_model`: the model every site and the server build (the same architecture; θ comes from the server).
* `build_datamodule`: the site's patient DataModule, from the SuperNode's ``--node-config``:
  ``manifest="/data/patients.csv"`` for real data (the library's patient manifest: one row per image with its
  patient id; see the docs' data page), or ``style="hospital_b" patients=20 seed=1`` for synthetic patients in that
  site style (a drill before real data).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from flwr.app import Context

from lightning_dp.data import PatientDataModule, SyntheticPathologyDataModule
from lightning_dp.models import ImageClassifier


def build_model(run_config: Any) -> ImageClassifier:
    """A small CNN with GroupNorm (no batch statistics to leak); every party builds the same one."""
    torch.manual_seed(0)
    model = ImageClassifier(arch="small_cnn", num_classes=2, norm="group")
    init = str(run_config.get("init", ""))
    if init:
        model.load_state_dict(torch.load(init, weights_only=True))
    return model


def build_datamodule(context: Context) -> Any:
    """The site's training patients (every one of them is a training patient: keep test patients elsewhere)."""
    node = context.node_config
    if "manifest" in node:
        return PatientDataModule(manifest=str(node["manifest"]), val_fraction=0.0, test_fraction=0.0, augment=False)
    name = str(node["site"])
    root = Path(str(node.get("data-dir", f"federated/data/{name}")))
    return SyntheticPathologyDataModule(
        root=str(root),
        num_patients=int(node.get("patients", 20)),  # type: ignore[arg-type]
        patches_per_patient=int(node.get("patches", 8)),  # type: ignore[arg-type]
        image_size=int(context.run_config.get("image-size", 32)),  # type: ignore[arg-type]
        seed=int(node.get("seed", 0)),  # type: ignore[arg-type]
        site=str(node.get("style", "reference")),
        val_fraction=0.0,
        test_fraction=0.0,
        augment=False,
    )
