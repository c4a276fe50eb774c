"""Publishing a model trained with lightning-dp: a checkpoint copy without the secret privacy state.

A training checkpoint of a DP callback holds what exact resumption needs: the noise generator's
state and the sampler's seed. With them anyone holding two checkpoints can subtract the noise from
a step's update and see which samples (or patients) each step used: the guarantee is gone. A PATE
student's training checkpoint holds a digest over the teachers' checkpoint files (to find its release on
resume): whoever can rebuild the teachers of two neighbouring data sets tells them apart with it. Keep
training checkpoints as private as the data, and publish the model from `publishable_checkpoint`
(or from ``model.state_dict()``).

The published copy keeps what a model needs and nothing else (`PUBLISHED_KEYS`: the weights, the hyper-parameters,
Lightning's version and the public epoch and step counters). Everything else a training checkpoint holds is computed
from private data without noise or tells a private count: callbacks' state (``ModelCheckpoint``'s and
``EarlyStopping``'s best validation score on private validation patients), the loops' progress (the number of
validation batches: a function of how many validation patients there are), a scheduler's state (``ReduceLROnPlateau``
follows a validation metric), datamodules' state. A list of what to remove would miss the next callback that keeps
such a number; the list of what to keep cannot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["PUBLISHED_KEYS", "publishable_checkpoint", "without_privacy_state"]

_SECRET_STATE_OWNERS = ("P3SGD", "DPSGD")


#: The top-level keys of a Lightning checkpoint a published copy keeps: the weights, the model's and datamodule's
#: hyper-parameters (the config: public), Lightning's version and the epoch and step counters (public: the declared
#: run length), and ``callbacks`` emptied. Every other key is dropped (callbacks' state, loops, optimizer and scheduler
#: state, datamodules' state).
PUBLISHED_KEYS = (
    "state_dict",
    "callbacks",
    "hyper_parameters",
    "hparams_name",
    "hparams_type",
    "datamodule_hyper_parameters",
    "datamodule_hparams_name",
    "datamodule_hparams_type",
    "pytorch-lightning_version",
    "epoch",
    "global_step",
)


def without_privacy_state(checkpoint: dict[str, Any]) -> list[str]:
    """Reduces a loaded Lightning checkpoint to what may be published (in place); returns what was removed.

    Keeps `PUBLISHED_KEYS` only, with ``callbacks`` emptied. The DP callbacks' state holds the noise generator's
    state, the sampler's seed and count of units; a PATE student's datamodule state holds a digest over the teachers'
    checkpoints; other callbacks, the loops and the schedulers hold validation scores and counts of private data:
    none of it may leave with a published model. The list removed names the DP callbacks' states first (what made the
    checkpoint a training checkpoint), then the other callbacks' states, then every top-level key dropped (a PATE
    student's ``PATEStudentDataModule`` among them). `publishable_checkpoint` and ``lightning-dp tune``'s
    ``best/model.ckpt`` use this.
    """
    callbacks = checkpoint.get("callbacks")
    callbacks = callbacks if isinstance(callbacks, dict) else {}
    secret = [key for key in callbacks if str(key).split("[")[0] in _SECRET_STATE_OWNERS]
    removed = secret + [key for key in callbacks if key not in secret]
    removed += [key for key in checkpoint if key not in PUBLISHED_KEYS]
    for key in list(checkpoint):
        if key not in PUBLISHED_KEYS:
            del checkpoint[key]
    # An empty callbacks entry carries nothing and lets a resume attempt reach the DP callbacks' own refusal ("no
    # privacy state") instead of Lightning's KeyError on the missing optimizer state.
    checkpoint["callbacks"] = {}
    return removed


def publishable_checkpoint(source: str | Path, destination: str | Path) -> list[str]:
    """Writes a copy of a Lightning checkpoint reduced to what may be published; returns the keys removed.

    The weights, the hyper-parameters, Lightning's version and the epoch and step counters are kept (`PUBLISHED_KEYS`);
    the rest is dropped (`without_privacy_state`: the DP callbacks' state, other callbacks' validation scores, the
    loops' counts, optimizer and scheduler state). The copy cannot resume private training: resuming from it raises
    the missing-privacy-state error. It can be
    evaluated with the config the model was trained with (``lightning-dp test --config ... --ckpt_path``): outside
    fit the DP callbacks need no privacy state.

    Example:
        >>> import os, tempfile, torch
        >>> folder = tempfile.mkdtemp()
        >>> torch.save({"state_dict": {}, "callbacks": {"DPSGD": {"sampler_seed": 1}, "Other": {}}},
        ...            os.path.join(folder, "last.ckpt"))
        >>> publishable_checkpoint(os.path.join(folder, "last.ckpt"), os.path.join(folder, "public.ckpt"))
        ['DPSGD', 'Other']
        >>> torch.load(os.path.join(folder, "public.ckpt"), weights_only=True)
        {'state_dict': {}, 'callbacks': {}}
    """
    import torch  # here: the package root must import without torch (the accounting layer is pure math)

    checkpoint = torch.load(source, map_location="cpu", weights_only=True)
    removed = without_privacy_state(checkpoint)
    torch.save(checkpoint, destination)
    return removed
