"""Mixed precision (``"16-mixed"`` with its GradScaler, ``"bf16-mixed"``) under DPSGD and P3SGD, on the CPU and on CUDA.

What a user of AMP relies on, measured on the released update of one step (SGD, so the update is the release):

* the clip acts on the true gradients in fp32: every sample (or patient) a canary far above C adds exactly C
  (a clip on loss-scaled gradients would add C / 2**16, a noise divided by the scale would vanish);
* the noise is what the ledger charges: two runs that differ only in z differ by the noise, whose measured std
  (over thousands of coordinates) is z·C, with z read from the ledger;
* an fp16 overflow (a loss scale too large; planted: the engine's own detection is unit-tested) is redone at a
  smaller scale: the step is released once and charged once, nothing of the failed attempt is added;
* the GradScaler's state after the step is the same whether the data overflowed or not (it is set to 1: the
  library scales the loss itself, from a public constant, anew each step), and the checkpointed privacy state
  holds no loss scale.

The CPU cases run in the normal suite (Lightning turns ``"16-mixed"`` on the CPU into bf16, so there the fp16
plugin and a CPU GradScaler are given explicitly); the CUDA cases are marked ``gpu`` and use ``precision=...`` as a
user would. Tolerances: the clip identities to 1e-3 relative (fp16 rounds activations to ~1e-3), the noise std to
6 % (the std of ~2,200 Gaussian coordinates is estimated to ±1.5 %, so 6 % is 4 standard errors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor

from lightning_dp.audit.noise import ledger_multipliers
from lightning_dp.callbacks import DPSGD, P3SGD
from lightning_dp.sanitization import per_sample
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule
from tests.helpers.samples import SampleClassifier, SampleDataModule, flat_weights

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
PRECISIONS = ["16-mixed", "bf16-mixed"]


def _trainer(root: Path, device: str, precision: str, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    args: dict[str, Any] = {
        "accelerator": "gpu" if device == "cuda" else "cpu",
        "devices": 1,
        "max_steps": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "default_root_dir": root,
    }
    if device == "cpu" and precision == "16-mixed":
        from pytorch_lightning.plugins.precision import MixedPrecision

        args["plugins"] = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]
    else:
        args["precision"] = precision
    args.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **args)


def _fit(trainer: pl.Trainer, model: pl.LightningModule, data: pl.LightningDataModule) -> None:
    try:
        trainer.fit(model, data)
    except RuntimeError as err:  # pragma: no cover - depends on the torch build
        if "Half" in str(err) or "not implemented" in str(err):
            pytest.skip(f"fp16 autocast is not supported on this build: {err}")
        raise


# ---------------------------------------------------------------------- DPSGD
def _dpsgd_step(root: Path, device: str, precision: str, z: float, identical: bool) -> tuple[Tensor, DPSGD, pl.Trainer]:
    """One DPSGD step with SGD lr = 1 (the update is minus the release): (update on the CPU, callback, trainer)."""
    torch.manual_seed(0)
    model = SampleClassifier(dim=32, hidden=64, lr=1.0)
    before = flat_weights(model)
    cb = DPSGD(clip_norm=0.05, noise_multiplier=z, batch_size=16, seed=7, max_physical_batch_size=8)
    trainer = _trainer(root, device, precision, [cb])
    # Inputs ×10: every per-sample gradient is far above C = 0.05, so every sample is a canary clipped to C.
    _fit(trainer, model, SampleDataModule(num_samples=64, dim=32, identical=identical, input_scale=10.0))
    assert all(p.dtype == torch.float32 for p in model.parameters()), "AMP keeps the weights in fp32"
    return flat_weights(model).cpu() - before.cpu(), cb, trainer


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_dpsgd_adds_each_canary_at_exactly_the_clip_norm(tmp_path: Path, device: str, precision: str) -> None:
    update, cb, _ = _dpsgd_step(tmp_path, device, precision, z=1e-6, identical=True)
    assert cb.sampler is not None and cb.ledger is not None and cb.ledger.steps == 1
    batch = len(cb.sampler.indices(0))
    # Equal per-sample gradients, each clipped to exactly C: the release is B·C / (q·N) in norm.
    bound = cb.clip_norm * batch / cb.sampler.expected_batch_size
    assert batch > 0 and float(update.norm()) == pytest.approx(bound, rel=1e-3)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_dpsgd_noise_std_is_what_the_ledger_charges(tmp_path: Path, device: str, precision: str) -> None:
    noisy, cb, _ = _dpsgd_step(tmp_path / "z1", device, precision, z=1.0, identical=False)
    quiet, _, _ = _dpsgd_step(tmp_path / "z0", device, precision, z=1e-6, identical=False)
    assert cb.sampler is not None and cb.ledger is not None
    z = float(ledger_multipliers(cb.ledger)[0])
    assert z == 1.0 and cb.ledger.steps == 1
    noise = (noisy - quiet) * cb.sampler.expected_batch_size  # lr = 1: the noise of the sum, per coordinate
    assert noise.numel() > 2000
    assert float(noise.std()) == pytest.approx(z * cb.clip_norm, rel=0.06)
    assert abs(float(noise.mean())) < 4 * z * cb.clip_norm / noise.numel() ** 0.5


@pytest.mark.parametrize("device", DEVICES)
def test_an_fp16_overflow_is_redone_released_once_and_charged_once(
    tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first attempt of every chunk overflows (as the engine reports an inf per-sample norm at a loss scale too
    large: test_per_sample.py's test_nonfinite_sample_raises_and_adds_nothing_when_asked) and is redone at half the
    scale; the step still adds each canary once, at C."""
    scales: list[float] = []
    accumulate = per_sample.PerSampleClipper.accumulate

    def overflowing(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "loss_scale" in kwargs:  # a step's chunk (the start-up checks pass none)
            scales.append(kwargs["loss_scale"])
            if kwargs["loss_scale"] == 2.0**16:
                raise per_sample.NonFiniteGradientsError("1 of 8 per-sample gradients")
        return accumulate(self, *args, **kwargs)

    monkeypatch.setattr(per_sample.PerSampleClipper, "accumulate", overflowing)
    update, cb, trainer = _dpsgd_step(tmp_path / "overflow", device, "16-mixed", z=1e-6, identical=True)
    assert scales[:2] == [2.0**16, 2.0**15], "the overflowing chunk is redone at half the loss scale"
    assert cb.sampler is not None and cb.ledger is not None
    assert cb.ledger.steps == 1 == trainer.global_step, "one step, charged once"
    batch = len(cb.sampler.indices(0))
    bound = cb.clip_norm * batch / cb.sampler.expected_batch_size
    assert float(update.norm()) == pytest.approx(bound, rel=1e-3), "released once, nothing of the failed attempt"

    monkeypatch.setattr(per_sample.PerSampleClipper, "accumulate", accumulate)
    _, _, quiet = _dpsgd_step(tmp_path / "quiet", device, "16-mixed", z=1e-6, identical=True)
    scaler, other = (getattr(t.precision_plugin, "scaler", None) for t in (trainer, quiet))
    assert scaler is not None and other is not None
    assert scaler.state_dict() == other.state_dict(), "the GradScaler's state must not depend on the data"
    assert scaler.get_scale() == 1.0
    assert not [k for k in cb.state_dict() if "scale" in k], "no loss scale in the checkpointed privacy state"


# ---------------------------------------------------------------------- P3SGD
def _p3sgd_round(root: Path, device: str, precision: str, z: float) -> tuple[Tensor, P3SGD, pl.Trainer]:
    """One P3SGD round (server_lr = 1): (the released update on the CPU, callback, trainer)."""
    torch.manual_seed(0)
    model = TinyClassifier(batchnorm=False, hidden=256)
    before = flat_weights(model)
    cb = P3SGD(sample_rate=0.5, clip_norm=0.01, noise_scales=(z,), local_lr=1.0, seed=7, log_private_diagnostics=True)
    trainer = _trainer(root, device, precision, [cb])
    _fit(trainer, model, TinyPatientDataModule())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return flat_weights(model).cpu() - before.cpu(), cb, trainer


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_p3sgd_clips_each_patient_to_the_clip_norm(tmp_path: Path, device: str, precision: str) -> None:
    # local_lr = 1 and C = 0.01: every patient's local change is far above C, so every patient is clipped to C and
    # the round moves the weights by at most (patients)·C/(q·N), and by more than half of it (the changes agree).
    update, cb, trainer = _p3sgd_round(tmp_path, device, precision, z=1e-6)
    patients = float(trainer.logged_metrics["private_diagnostics/patients_in_round"])
    assert float(trainer.logged_metrics["private_diagnostics/clipped_fraction"]) == 1.0
    bound = patients * 0.01 / (0.5 * 20)
    assert patients > 0 and 0.5 * bound < float(update.norm()) <= bound * (1 + 1e-3)
    assert cb.ledger is not None and cb.ledger.steps == 1 and cb.nonfinite_updates == 0


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_p3sgd_noise_std_is_what_the_ledger_charges(tmp_path: Path, device: str, precision: str) -> None:
    noisy, cb, _ = _p3sgd_round(tmp_path / "z1", device, precision, z=1.0)
    quiet, _, _ = _p3sgd_round(tmp_path / "z0", device, precision, z=1e-6)
    assert cb.ledger is not None and cb.ledger.steps == 1
    z = float(ledger_multipliers(cb.ledger)[0])
    assert z == 1.0
    noise = (noisy - quiet) * (0.5 * 20)  # server_lr = 1: the noise of the sum, per coordinate
    assert noise.numel() > 2000
    assert float(noise.std()) == pytest.approx(z * 0.01, rel=0.06)
