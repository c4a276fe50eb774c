"""Publishing a model trained with lightning-dp: a checkpoint copy without the secret privacy state.

A training checkpoint of a DP callback holds what exact resumption needs: the noise generator's
state and the sampler's seed. With them anyone holding two checkpoints can subtract the noise from
a step's update and see which samples (or patients) each step used: the guarantee is gone. A PATE
student's training checkpoint holds a digest over the teachers' checkpoint files (to find its release on
resume): whoever can rebuild the teachers of two neighbouring data sets tells them apart with it. Keep
training checkpoints as private as the data, and publish the model from `publishable_checkpoint`
(or from ``model.state_dict()``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["publishable_checkpoint", "without_privacy_state"]

_SECRET_STATE_OWNERS = ("P3SGD", "DPSGD")
#: Datamodules whose checkpoint state (top-level, under the class's name) is the data holder's: PATE's student keeps
#: the digest of the release it trained on, computed over the teachers' checkpoint files (private) as well as the
#: released labels, so it is not post-processing of the release.
_PRIVATE_DATAMODULE_STATES = ("PATEStudentDataModule",)


def without_privacy_state(checkpoint: dict[str, Any]) -> list[str]:
    """Removes the privacy state from a loaded Lightning checkpoint (in place); returns the keys removed.

    The DP callbacks' state holds the noise generator's state, the sampler's seed and the sampler's count of units; a
    PATE student's datamodule state holds a digest over the teachers' checkpoints: none of it may leave with a
    published model. `publishable_checkpoint` and ``lightning-dp tune``'s ``best/model.ckpt`` use this.
    """
    callbacks = checkpoint.get("callbacks", {})
    removed = [key for key in callbacks if str(key).split("[")[0] in _SECRET_STATE_OWNERS]
    for key in removed:
        del callbacks[key]
    for key in _PRIVATE_DATAMODULE_STATES:
        if key in checkpoint:
            del checkpoint[key]
            removed.append(key)
    return removed


def publishable_checkpoint(source: str | Path, destination: str | Path) -> list[str]:
    """Writes a copy of a Lightning checkpoint without the privacy state; returns the keys removed.

    The weights, optimizer state (post-processing of noisy updates) and hyper-parameters are kept. The
    copy cannot resume private training: resuming from it raises the missing-privacy-state error. It can be
    evaluated with the config the model was trained with (``lightning-dp test --config ... --ckpt_path``): outside
    fit the DP callbacks need no privacy state.

    Example:
        >>> import os, tempfile, torch
        >>> folder = tempfile.mkdtemp()
        >>> torch.save({"state_dict": {}, "callbacks": {"DPSGD": {"sampler_seed": 1}, "Other": {}}},
        ...            os.path.join(folder, "last.ckpt"))
        >>> publishable_checkpoint(os.path.join(folder, "last.ckpt"), os.path.join(folder, "public.ckpt"))
        ['DPSGD']
        >>> sorted(torch.load(os.path.join(folder, "public.ckpt"), weights_only=True)["callbacks"])
        ['Other']
    """
    import torch  # here: the package root must import without torch (the accounting layer is pure math)

    checkpoint = torch.load(source, map_location="cpu", weights_only=True)
    removed = without_privacy_state(checkpoint)
    torch.save(checkpoint, destination)
    return removed
