"""`ReleasedWeightAveraging`: an exponential moving average of the weights a DP callback releases.

An average of DP-released parameters is post-processing: it costs no privacy, provided it is fed the
released θ_{t+1} of every step — after the noised step, never a patient's local (un-noised) model,
never anything computed from private data in between. The callback reads the model once per step
released and charged by the DP callback (its ledger grew), at ``on_train_batch_end``: the DP step runs
inside ``training_step``, so by then the model holds θ_{t+1}.

Compared with Lightning's `EMAWeightAveraging` (which also sees the released weights and is also
post-processing), it differs where it matters for private fine-tuning:

* It is exact on what does not train: the EMA is a ``lerp``, and lerp(a, a, w) = a, so frozen
  parameters and fixed BatchNorm statistics come out bit-identical. Lightning's
  ``decay·a + (1 − decay)·a`` rounds: a frozen weight or an eval-mode running statistic drifts
  (up to 5.8e-6 after 50 updates at decay 0.999, in float32).
* It copies the model when training starts, after every callback's ``setup``: DPSGD's BatchNorm to
  GroupNorm conversion cannot leave it with the old structure, whatever the order of the callbacks.
* Integer buffers (``num_batches_tracked``) are copied from the model, not averaged.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_dp.callbacks.base import DPCallback
from lightning_dp.errors import PrivacyConfigError, PrivacyStateError, PrivacyWarning, check_count, check_in_interval
from lightning_dp.training.weight_averaging import AveragesReleasedWeights, is_lightning_weight_averaging

__all__ = ["ReleasedWeightAveraging"]


class ReleasedWeightAveraging(AveragesReleasedWeights, pl.Callback):
    """EMA of the weights released by the Trainer's DP callback (`DPSGD` or `P3SGD`); post-processing, no ε.

    After released step t (0-based, counted by the DP callback's ledger) with t ≥ ``start_step``:
    θ̄ ← θ_{t+1} for the first averaged step, then θ̄ ← decay·θ̄ + (1 − decay)·θ_{t+1}, over every
    floating-point parameter and buffer of the module (a tensor that does not change keeps its exact
    value). As Lightning's weight averaging does: validation during training runs on the average, the
    model holds the average when training ends, and a checkpoint's ``state_dict`` is the average
    (``load_from_checkpoint`` gives the averaged model) while ``current_model_state`` keeps the last
    released model, from which a resumed run continues; the average and its counters are in the
    callback's state.

    Args:
        decay: the EMA decay, in [0, 1).
        start_step: the first released step (0-based) that enters the average; earlier ones are skipped.
        name: distinguishes several averaging callbacks' checkpoint state.

    Raises:
        PrivacyConfigError: at setup, if the Trainer has no DP callback (nothing is released: use Lightning's
            `EMAWeightAveraging`) or also has Lightning's `WeightAveraging` (both would rewrite checkpoints).

    Example:
        >>> ReleasedWeightAveraging(decay=0.99, start_step=10)
        ReleasedWeightAveraging(decay=0.99, start_step=10)
    """

    format_version = 1

    def __init__(self, decay: float = 0.999, start_step: int = 0, name: str | None = None) -> None:
        owner = "ReleasedWeightAveraging"
        self.decay = check_in_interval(
            owner, "decay", decay, 0.0, 1.0, low_closed=True, high_closed=False, hint="e.g. 0.999."
        )
        self.start_step = check_count(owner, "start_step", start_step, "0 averages from the first step.", minimum=0)
        self.name = name
        #: Number of released steps averaged so far.
        self.updates = 0
        self._released_steps = 0  # the DP callback's ledger steps when the average was last considered
        self._average: dict[str, Tensor] | None = None
        self._loaded_average: dict[str, Tensor] | None = None
        self._held: dict[str, Tensor] | None = None  # the model's tensors while it holds the average (validation)
        self._upcast: set[str] = set()  # half-precision tensors, averaged in float32
        self._dp: DPCallback | None = None

    def __repr__(self) -> str:
        return f"ReleasedWeightAveraging(decay={self.decay}, start_step={self.start_step})"

    @property
    @override
    def state_key(self) -> str:
        return f"ReleasedWeightAveraging[{self.name}]" if self.name else "ReleasedWeightAveraging"

    @property
    def average(self) -> dict[str, Tensor] | None:
        """The averaged floating-point tensors by ``state_dict`` name (None before training starts)."""
        return self._average

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        private = [cb for cb in callbacks if isinstance(cb, DPCallback)]
        if not private:
            raise PrivacyConfigError(
                "`ReleasedWeightAveraging`: the Trainer has no DP callback (DPSGD or P3SGD), so no step releases "
                "weights to average. HINT: add the DP callback, or use Lightning's EMAWeightAveraging for "
                "non-private training."
            )
        lightning = [type(cb).__name__ for cb in callbacks if is_lightning_weight_averaging(cb)]
        if lightning:
            raise PrivacyConfigError(
                f"`ReleasedWeightAveraging`: the Trainer also has {lightning[0]}; both would average the model and "
                "rewrite the checkpoints' state_dict. HINT: keep one of them."
            )
        self._dp = private[0]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        current = _float_tensors(pl_module)
        self._upcast = {k for k, t in current.items() if t.dtype in (torch.float16, torch.bfloat16)}
        if (
            self._average is None
        ):  # nothing averaged yet: the average starts as the model (replaced by the first update)
            self._average = {k: _average_copy(t) for k, t in current.items()}
            self._released_steps = self._ledger_steps()
            return
        mismatch = sorted(set(current) ^ set(self._average)) or [
            k for k, t in current.items() if t.shape != self._average[k].shape
        ]
        if mismatch:
            raise PrivacyStateError(
                f"`{self.state_key}`: the checkpoint's average does not match the model ({mismatch[:3]}). HINT: resume "
                "with the same model (and the same BatchNorm conversion)."
            )
        self._average = {k: t.to(current[k].device) for k, t in self._average.items()}

    def _ledger_steps(self) -> int:
        assert self._dp is not None
        ledger = self._dp.ledger
        return 0 if ledger is None else ledger.steps

    # ------------------------------------------------------------------ the average
    @override
    @torch.no_grad()
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        steps = self._ledger_steps()
        if steps <= self._released_steps or self._average is None:
            return  # nothing released (a budget stop): nothing to average
        self._released_steps = steps
        if steps - 1 < self.start_step:
            return
        current = _float_tensors(pl_module)
        for key, average in self._average.items():
            value = current[key].detach().to(average.dtype)
            if self.updates == 0:
                average.copy_(value)
            else:
                average.lerp_(value, 1.0 - self.decay)  # exact where value == average
        self.updates += 1

    @torch.no_grad()
    def _swap_in(self, pl_module: pl.LightningModule) -> None:
        """Puts the average in the model, keeping the model's own tensors aside (the average is never rounded)."""
        assert self._average is not None
        tensors = _float_tensors(pl_module)
        self._held = {key: tensor.detach().clone() for key, tensor in tensors.items()}
        for key, tensor in tensors.items():
            tensor.data.copy_(self._average[key])

    @torch.no_grad()
    def _swap_out(self, pl_module: pl.LightningModule) -> None:
        if self._held is None:
            return
        for key, tensor in _float_tensors(pl_module).items():
            tensor.data.copy_(self._held[key])
        self._held = None

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.updates and self._average is not None and trainer.state.fn == "fit":
            self._swap_in(pl_module)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._swap_out(pl_module)

    @override
    @torch.no_grad()
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._average is None:
            return
        if not self.updates:
            rank_zero_warn(
                f"{self.state_key}: no released step reached start_step={self.start_step}; the model keeps its last "
                "released weights instead of an average.",
                category=PrivacyWarning,
            )
            return
        for key, tensor in _float_tensors(pl_module).items():
            tensor.data.copy_(self._average[key])

    # ------------------------------------------------------------------ checkpoints
    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._average is None or not self.updates:
            return
        current = checkpoint["state_dict"]
        checkpoint["current_model_state"] = current
        checkpoint["state_dict"] = {
            k: (self._average[k].detach().to(v.dtype).clone() if k in self._average else v) for k, v in current.items()
        }

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning has just loaded "state_dict" (the average) into the model: keep it as the average, and resume
        # training from the last released model.
        self._loaded_average = None
        if "current_model_state" in checkpoint:
            self._loaded_average = {
                k: _average_copy(t) for k, t in checkpoint["state_dict"].items() if t.is_floating_point()
            }
            pl_module.load_state_dict(checkpoint["current_model_state"], strict=pl_module.strict_loading)
        if not checkpoint.get("callbacks", {}).get(self.state_key):
            rank_zero_warn(
                f"{self.state_key}: the checkpoint has no averaging state; the average restarts from the model.",
                category=PrivacyWarning,
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        """The counters (the average itself is the checkpoint's ``state_dict``)."""
        if self._average is None:
            return {}
        return {
            "format_version": self.format_version,
            "decay": self.decay,
            "start_step": self.start_step,
            "updates": self.updates,
            "released_steps": self._released_steps,
            # The state_dict holds the average in the model's dtype; a half-precision model's average is kept in
            # float32 here, so that a resumed run continues the same average.
            "float32_average": {k: self._average[k].detach().cpu().clone() for k in sorted(self._upcast)},
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("format_version") != self.format_version:
            raise PrivacyStateError(
                f"`{self.state_key}`: checkpoint state has format_version {state_dict.get('format_version')!r}, "
                f"expected {self.format_version}. HINT: resume with the lightning-dp version that wrote it."
            )
        updates, released = state_dict.get("updates"), state_dict.get("released_steps")
        if not isinstance(updates, int) or not isinstance(released, int) or not 0 <= updates <= released:
            raise PrivacyStateError(f"`{self.state_key}`: corrupt averaging state in the checkpoint.")
        average = self._loaded_average
        if updates and average is None:
            raise PrivacyStateError(
                f"`{self.state_key}`: the checkpoint records {updates} averaged steps but holds no average (no "
                "'current_model_state' beside its state_dict). HINT: resume from a checkpoint written with this "
                "callback, unmodified."
            )
        self.updates, self._released_steps = updates, released
        if average is not None:
            for k, t in state_dict.get("float32_average", {}).items():
                if k in average:
                    average[k] = t.to(average[k].device)
        self._average = average if updates else None
        self._loaded_average = None


def _float_tensors(module: torch.nn.Module) -> dict[str, Tensor]:
    """The floating-point parameters and persistent buffers (the tensors themselves) by ``state_dict`` name."""
    return {k: t for k, t in module.state_dict(keep_vars=True).items() if t.is_floating_point()}


def _average_copy(tensor: Tensor) -> Tensor:
    """A detached copy to average in: float32 for half-precision tensors (an EMA in bf16 loses the small updates)."""
    copy = tensor.detach().clone()
    return copy.float() if copy.dtype in (torch.float16, torch.bfloat16) else copy
