"""What the consortium trains, and how a site finds its patients: the file to edit.

* `build_model`: the model every site and the server build (the same architecture; θ comes from the server), for the
  consortium's declared input (``image-channels`` × ``image-size`` × ``image-size`` in the run config).
* `dummy_batch`: zeros of that declared input, built from the run config alone (public): each site runs its model's
  ``training_step`` on it at start and refuses to start if it fails (docs/federated.md, "What a site's operator
  watches").
* `build_datamodule`: the site's patient DataModule, from the SuperNode's ``--node-config``:
  ``manifest="/data/patients.csv"`` for real data (the library's patient manifest: one row per image with its
  patient id; see the docs' data page; images are resized to ``image-size``), or ``style="hospital_b" patients=20
  seed=2`` for synthetic patients in that site style (a drill before real data).
* `read_id_key`: the consortium's patient-id key, from a file named in the site's own node config (``id-key-file``),
  never from the run config.

The model and data code (``lightning_dp.models``, ``lightning_dp.data``: PyTorch Lightning, torchvision) is imported
inside the functions that need it: Flower starts a fresh process for every message a site answers, and three of the
four messages of a secure-aggregation round (SecAgg+'s key exchange and unmasking) never build the site, so each of
them loads this module and skips seconds of imports. Keep your own heavy imports there too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import Context

if TYPE_CHECKING:
    from lightning_dp.models import ImageClassifier


def build_model(run_config: Any) -> ImageClassifier:
    """A small CNN with GroupNorm (no batch statistics to leak); every party builds the same one."""
    from lightning_dp.models import ImageClassifier

    torch.manual_seed(0)
    channels = int(run_config.get("image-channels", 3))
    model = ImageClassifier(arch="small_cnn", num_classes=2, norm="group", in_channels=channels)
    init = str(run_config.get("init", ""))
    if init:
        model.load_state_dict(torch.load(init, weights_only=True))
    return model


def dummy_batch(context: Context) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two images of zeros in the declared input format, as the datamodule batches them: (images, labels, patients).

    Built from the run config alone (public), never from a site's data.
    """
    config = context.run_config
    channels, size = int(config.get("image-channels", 3)), int(config.get("image-size", 32))  # type: ignore[arg-type]
    return torch.zeros(2, channels, size, size), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)


def build_datamodule(context: Context) -> Any:
    """The site's training patients (every one of them is a training patient: keep test patients elsewhere)."""
    from lightning_dp.data import PatientDataModule

    node = context.node_config
    size = int(context.run_config.get("image-size", 32))  # type: ignore[arg-type]
    manifest = str(node["manifest"]) if "manifest" in node else str(_synthetic_manifest(node, size))
    return PatientDataModule(manifest=manifest, val_fraction=0.0, test_fraction=0.0, augment=False, image_size=size)


def _synthetic_manifest(node: Any, size: int) -> Path:
    """Synthetic patients in a site style, with ids that name the seed they were drawn from.

    The generator names its patients P0000, P0001, … whatever the seed, and patient i of a seed is the same patient
    (in another stain with another style) at every site that uses that seed: the ids here are ``s<seed>-P0000``, so
    two sites drawn from one seed share their ids and the start-up check refuses them, as it would refuse one
    hospital's records copied to another.
    """
    from lightning_dp.data import generate_synthetic_pathology

    name = str(node["site"])
    root = Path(str(node.get("data-dir", f"federated/data/{name}")))
    seed = int(node.get("seed", 0))
    generated = generate_synthetic_pathology(
        root,
        num_patients=int(node.get("patients", 20)),
        patches_per_patient=int(node.get("patches", 8)),
        image_size=size,
        seed=seed,
        site=str(node.get("style", "reference")),
    )
    lines = generated.read_text().splitlines()
    rows = [lines[0]] + [f"{line.rsplit(',', 1)[0]},s{seed}-{line.rsplit(',', 1)[1]}" for line in lines[1:]]
    manifest = root / "site_manifest.csv"
    scratch = root / f".site_manifest.{os.getpid()}.csv"  # Flower may start two of this site's processes at once
    scratch.write_text("\n".join(rows) + "\n")
    os.replace(scratch, manifest)
    return manifest


def read_id_key(context: Context) -> bytes | None:
    """The consortium's patient-id key, from the file the site's node config names (``id-key-file``), or None.

    Every hospital holds a copy of the same secret file, handed over outside the run (never to the coordinator who
    runs the server); with it the sites send salted HMAC digests of their patient ids, which the server compares
    without being able to test a guessed id. None (no ``id-key-file``): the site sends no digests, and a consortium
    that checks ids (``check-patient-ids = true``) refuses to start, naming the site.
    """
    path = context.node_config.get("id-key-file")
    if path is None:
        return None
    key = Path(str(path)).read_bytes().strip()
    if len(key) < 16:
        raise ValueError(f"the id key file {path} holds {len(key)} bytes; the consortium's key needs 16 or more")
    return key
