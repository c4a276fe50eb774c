"""Weight averaging beside the DP callbacks: Lightning's `WeightAveraging`/`EMAWeightAveraging` and ours.

Averaging DP-released parameters is post-processing and costs no privacy, but only if the average is
fed the released θ_{t+1} (after the noised step), never a patient's local, un-noised model. A probe
wraps the DP callback's private step and records the model's tensors right after each release; the
average a run ends with must be exactly the EMA (or mean) of that sequence. The DP step runs inside
``training_step``, and both averaging callbacks update in ``on_train_batch_end``, after it, whatever
the order of the callbacks. Where Lightning's falls short (it rounds frozen tensors; listed before
DPSGD it copies the model before the BatchNorm conversion), `ReleasedWeightAveraging` is exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EMAWeightAveraging, ModelCheckpoint, WeightAveraging
from torch import Tensor

from lightning_dp.accounting import RDPAccountant
from lightning_dp.callbacks import DPSGD, P3SGD, ReleasedWeightAveraging
from lightning_dp.callbacks.base import DPCallback
from lightning_dp.errors import PrivacyConfigError
from lightning_dp.models import ImageClassifier, fix_model
from lightning_dp.sampling.randomness import UnitStreams
from lightning_dp.training.patient_rounds import RoundParts
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule
from tests.helpers.samples import SampleDataModule, flat_weights, trainer

Engine = Literal["p3sgd", "dpsgd"]
Averaging = Literal["lightning", "released"]
DECAY = 0.6
STEPS = 5


class ReleaseProbe(pl.Callback):
    """Records the model right after each release (inside the private step) and at ``on_train_batch_end``."""

    def __init__(self, dp: DPCallback) -> None:
        self.dp = dp
        self.released: list[Tensor] = []
        self.batch_end: list[Tensor] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        inner, probe = self.dp.private_step, self

        class Recorded:
            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                result = inner(*args, **kwargs)  # type: ignore[misc]
                probe.released.append(flat_weights(pl_module))  # θ_{t+1}: the release was just applied
                return result

        self.dp.private_step = Recorded()  # type: ignore[assignment]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.batch_end.append(flat_weights(pl_module))


def _dp(engine: Engine) -> DPCallback:
    # Fixed threads: the resume tests compare runs bit for bit, and on a loaded machine adapt_threads changes the
    # thread count, and so the round-off, between the full and the resumed run (both failed there before).
    if engine == "p3sgd":
        return P3SGD(sample_rate=0.3, clip_norm=1.0, local_lr=0.1, seed=7, adapt_threads=False)
    return DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=10, seed=7, adapt_threads=False)


def _data(engine: Engine) -> pl.LightningDataModule:
    return TinyPatientDataModule() if engine == "p3sgd" else SampleDataModule()


def _fit(
    tmp_path: Path, engine: Engine, extra: list[pl.Callback], ckpt: Path | None = None
) -> tuple[TinyClassifier, DPCallback, ReleaseProbe]:
    torch.manual_seed(0)
    model = TinyClassifier()  # BatchNorm: released (noised) by P3SGD, converted to GroupNorm by DPSGD
    dp = _dp(engine)
    probe = ReleaseProbe(dp)
    run = trainer(
        tmp_path,
        [dp, probe, *extra],
        max_steps=STEPS,
        enable_checkpointing=ckpt is not None or any(isinstance(cb, ModelCheckpoint) for cb in extra),
    )
    run.fit(model, _data(engine), ckpt_path=ckpt)
    return model, dp, probe


def _flat_state(state: dict[str, Tensor], engine: Engine) -> Tensor:
    """A checkpoint's state_dict loaded (strictly) into a fresh model, flattened like `flat_weights`."""
    model = TinyClassifier()
    if engine == "dpsgd":
        fix_model(model, warn=False)
    model.load_state_dict(state)
    return flat_weights(model)


def _ema_callback(kind: Averaging) -> pl.Callback:
    return EMAWeightAveraging(decay=DECAY) if kind == "lightning" else ReleasedWeightAveraging(decay=DECAY)


def _ema(sequence: list[Tensor], decay: float) -> Tensor:
    average = sequence[0]
    for released in sequence[1:]:
        average = decay * average + (1 - decay) * released
    return average


@pytest.mark.parametrize("kind", ["lightning", "released"])
@pytest.mark.parametrize("engine", ["p3sgd", "dpsgd"])
def test_ema_is_the_ema_of_the_released_parameters_and_costs_no_privacy(
    tmp_path: Path, engine: Engine, kind: Averaging
) -> None:
    model, dp, probe = _fit(tmp_path / "ema", engine, [_ema_callback(kind)])
    assert len(probe.released) == STEPS and dp.ledger is not None and dp.ledger.steps == STEPS
    assert all(torch.equal(a, b) for a, b in zip(probe.released, probe.batch_end)), (
        "between the release and on_train_batch_end (where the average is updated) the model must not change"
    )
    expected = _ema(probe.released, DECAY)
    assert torch.allclose(flat_weights(model), expected, rtol=0, atol=1e-6), "the model ends with the average"
    assert not torch.allclose(expected, probe.released[-1], atol=1e-4), "the average differs from the last iterate"

    plain_model, plain_dp, plain_probe = _fit(tmp_path / "plain", engine, [])
    assert all(torch.equal(a, b) for a, b in zip(probe.released, plain_probe.released)), (
        "averaging must not change the training: same samples, same noise, same released iterates"
    )
    assert torch.equal(flat_weights(plain_model), probe.released[-1])
    assert plain_dp.ledger is not None and dp.ledger.state_dict() == plain_dp.ledger.state_dict()
    assert RDPAccountant().epsilon(dp.ledger) == RDPAccountant().epsilon(plain_dp.ledger)


@pytest.mark.parametrize("engine", ["p3sgd", "dpsgd"])
def test_weight_averaging_is_the_mean_of_the_released_parameters(tmp_path: Path, engine: Engine) -> None:
    model, _, probe = _fit(tmp_path, engine, [WeightAveraging()])
    expected = torch.stack(probe.released).mean(0)
    assert torch.allclose(flat_weights(model), expected, rtol=0, atol=1e-6)


def test_p3sgd_average_never_sees_a_patients_local_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The local models exist only inside the round; what the average is fed (the model at on_train_batch_end)
    # is the released θ_{t+1}, which is none of them.
    local: list[Tensor] = []
    original = RoundParts.train_patient

    def recording(self: RoundParts, patient: int, streams: UnitStreams) -> None:
        original(self, patient, streams)
        local.append(flat_weights(self.module))

    monkeypatch.setattr(RoundParts, "train_patient", recording)
    _, _, probe = _fit(tmp_path, "p3sgd", [ReleasedWeightAveraging(decay=DECAY)])
    assert local, "some patient must have been sampled"
    assert not any(torch.equal(a, b) for a in probe.batch_end for b in local)


@pytest.mark.parametrize("kind", ["lightning", "released"])
@pytest.mark.parametrize("engine", ["p3sgd", "dpsgd"])
def test_a_checkpoint_saves_and_restores_the_average_and_the_released_model(
    tmp_path: Path, engine: Engine, kind: Averaging
) -> None:
    def checkpoints(root: Path) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1, filename="{step}")

    full, full_dp, probe = _fit(tmp_path / "full", engine, [_ema_callback(kind), checkpoints(tmp_path / "ck")])
    path = tmp_path / "ck" / "step=2.ckpt"
    saved = torch.load(path, weights_only=True)
    # strict loads: the average has the structure of the trained model
    assert torch.equal(_flat_state(saved["current_model_state"], engine), probe.released[1]), (
        "the checkpoint keeps the released model of step 2 (to resume training from)"
    )
    average = _flat_state(saved["state_dict"], engine)
    assert torch.allclose(average, _ema(probe.released[:2], DECAY), rtol=0, atol=1e-6), "and the average in state_dict"

    resumed, resumed_dp, resumed_probe = _fit(tmp_path / "resumed", engine, [_ema_callback(kind)], path)
    assert all(torch.equal(a, b) for a, b in zip(resumed_probe.released, probe.released[2:]))
    assert torch.allclose(flat_weights(resumed), flat_weights(full), rtol=0, atol=1e-6), (
        "a resumed run ends with the same average as an uninterrupted one"
    )
    assert resumed_dp.ledger is not None and full_dp.ledger is not None
    assert resumed_dp.ledger.state_dict() == full_dp.ledger.state_dict()


def test_lightning_averaging_listed_before_dpsgd_on_a_batchnorm_model_is_refused(tmp_path: Path) -> None:
    # It copied the model in its setup, before DPSGD's setup converted BatchNorm: its average kept BatchNorm's
    # structure and statistics, and the checkpoints' state_dict did not load into the trained model.
    dp = DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=10, seed=7)
    with pytest.raises(PrivacyConfigError, match=r"EMAWeightAveraging is listed before DPSGD.*HINT: list DPSGD before"):
        trainer(tmp_path, [EMAWeightAveraging(), dp]).fit(TinyClassifier(), SampleDataModule())


def test_released_averaging_listed_before_dpsgd_copies_the_converted_model(tmp_path: Path) -> None:
    dp = DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=10, seed=7)
    averaging = ReleasedWeightAveraging(decay=DECAY)
    model = TinyClassifier()
    trainer(tmp_path, [averaging, dp]).fit(model, SampleDataModule())
    assert dp.converted_layers and averaging.updates == 3
    assert averaging.average is not None and set(averaging.average) == set(model.state_dict())


def test_released_averaging_refuses_a_trainer_without_dp_or_with_lightnings_averaging(tmp_path: Path) -> None:
    with pytest.raises(PrivacyConfigError, match=r"has no DP callback.*HINT: add the DP callback, or use Lightning"):
        trainer(tmp_path, [ReleasedWeightAveraging()]).fit(TinyClassifier(), SampleDataModule())
    dp = DPSGD(clip_norm=1.0, noise_multiplier=1.0, batch_size=10, seed=7)
    with pytest.raises(PrivacyConfigError, match=r"also has EMAWeightAveraging.*HINT: keep one"):
        trainer(tmp_path, [dp, EMAWeightAveraging(), ReleasedWeightAveraging()]).fit(
            TinyClassifier(), SampleDataModule()
        )


@pytest.mark.parametrize("decay", [-0.1, 1.0, float("nan")])
def test_a_decay_outside_0_1_is_refused(decay: float) -> None:
    with pytest.raises(PrivacyConfigError, match=r"ReleasedWeightAveraging\(decay="):
        ReleasedWeightAveraging(decay=decay)


def test_start_step_skips_the_first_released_steps(tmp_path: Path) -> None:
    model, _, probe = _fit(tmp_path, "p3sgd", [ReleasedWeightAveraging(decay=DECAY, start_step=2)])
    assert torch.allclose(flat_weights(model), _ema(probe.released[2:], DECAY), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["lightning", "released"])
def test_a_peft_average_keeps_frozen_weights_and_batchnorm_statistics(tmp_path: Path, kind: Averaging) -> None:
    # trainable=[norm, head]: the convolutions are frozen and BatchNorm is in eval mode, so its (here non-trivial,
    # as if pre-trained) statistics never change. Their average must not change either.
    data = TinyPatientDataModule(num_patients=8, per_patient=3)
    data.train_dataset.x = torch.rand(len(data.train_dataset), 3, 16, 16)
    model = ImageClassifier(arch="resnet18", norm="batch", trainable=["norm", "head"])
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d) and m.running_mean is not None and m.running_var is not None:
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dp = P3SGD(sample_rate=0.5, clip_norm=1.0, local_lr=0.1, seed=7)
    trainer(tmp_path, [dp, _ema_callback(kind)], max_steps=3).fit(model, data)
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    trained = {f"net.{name}" for name, p in model.net.named_parameters() if p.requires_grad}
    if kind == "released":
        assert changed == trained, "frozen weights and BatchNorm statistics come out bit-identical"
    else:  # Lightning's decay·a + (1 − decay)·a rounds: documents why ReleasedWeightAveraging exists
        assert trained <= changed
        drift = changed - trained
        assert any(k.endswith("running_var") for k in drift) and any(k.endswith("conv1.weight") for k in drift)
        assert max(float((before[k] - after[k]).abs().max()) for k in drift) < 1e-5, "rounding only"


def test_validation_during_training_runs_on_the_average_and_training_continues_from_the_released_model(
    tmp_path: Path,
) -> None:
    class SeenByValidation(pl.Callback):
        def __init__(self) -> None:
            self.weights: list[Tensor] = []
            self.steps: list[int] = []

        def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.weights.append(flat_weights(pl_module))
            self.steps.append(trainer.global_step)

    def run(root: Path, validate: bool) -> tuple[ReleaseProbe, SeenByValidation]:
        torch.manual_seed(0)
        dp, seen = _dp("p3sgd"), SeenByValidation()
        probe = ReleaseProbe(dp)
        limits: dict[str, Any] = {"limit_val_batches": 1, "val_check_interval": 2} if validate else {}
        callbacks = [dp, probe, ReleasedWeightAveraging(decay=DECAY), seen]
        trainer(root, callbacks, max_steps=STEPS, **limits).fit(TinyClassifier(), TinyPatientDataModule())
        return probe, seen

    probe, seen = run(tmp_path / "validated", validate=True)
    assert seen.steps == [2, 5]  # val_check_interval=2 in epochs of 3 rounds
    for k, weights in zip(seen.steps, seen.weights):
        assert torch.allclose(weights, _ema(probe.released[:k], DECAY), rtol=0, atol=1e-6)
    plain, _ = run(tmp_path / "plain", validate=False)
    assert all(torch.equal(a, b) for a, b in zip(probe.released, plain.released))


@pytest.mark.parametrize("engine", ["p3sgd", "dpsgd"])
def test_resuming_an_averaged_checkpoint_without_the_averaging_callback_warns(tmp_path: Path, engine: Engine) -> None:
    """Review finding: the checkpoint's state_dict is the average; without the callback, training would silently
    resume from it instead of from the last released model."""
    ck = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    _fit(tmp_path / "full", engine, [ReleasedWeightAveraging(decay=DECAY), ck])
    with pytest.warns(UserWarning, match=r"written with weight averaging.*HINT: add the same averaging callback"):
        _fit(tmp_path / "resumed", engine, [], tmp_path / "ck" / "step=2.ckpt")


def test_validation_and_checkpoints_keep_a_half_precision_models_average_in_float32() -> None:
    """Review finding: swapping the average in for validation wrote the bf16 model back into the float32
    average (rounding it), and the checkpoint kept only the bf16 copy."""
    import types

    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    averaging = ReleasedWeightAveraging(decay=0.9)
    ledger = types.SimpleNamespace(steps=0)
    averaging._dp = types.SimpleNamespace(ledger=ledger)  # type: ignore[assignment]
    fit = types.SimpleNamespace(state=types.SimpleNamespace(fn="fit"))
    averaging.on_train_start(fit, model)  # type: ignore[arg-type]
    torch.manual_seed(0)
    for _ in range(5):
        with torch.no_grad():
            model.weight.add_(torch.randn_like(model.weight) * 0.01)
        ledger.steps += 1
        averaging.on_train_batch_end(fit, model)  # type: ignore[arg-type]
    assert averaging.average is not None
    before = {k: v.clone() for k, v in averaging.average.items()}
    released = model.weight.detach().clone()
    averaging.on_validation_epoch_start(fit, model)  # type: ignore[arg-type]
    assert torch.equal(model.weight, before["weight"].to(torch.bfloat16))  # validation sees the average
    averaging.on_validation_epoch_end(fit, model)  # type: ignore[arg-type]
    assert torch.equal(model.weight, released)  # training continues from the released model
    assert all(torch.equal(before[k], averaging.average[k]) for k in before)  # the float32 average is untouched
    assert before["weight"].dtype == torch.float32
    state = averaging.state_dict()
    assert torch.equal(state["float32_average"]["weight"], before["weight"])
