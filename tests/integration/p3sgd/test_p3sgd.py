"""P3SGD inside a real Trainer: accounting per round, budget stop, exact resume, BatchNorm, logging, bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger

from lightning_dp.accounting import RDPAccountant
from lightning_dp.callbacks import P3SGD, PrivacyBudget
from lightning_dp.errors import PrivacyConfigError, PrivacyStateError
from lightning_dp.training.patient_rounds import BatchedRound
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule


def _p3sgd(**kwargs: Any) -> P3SGD:
    args: dict[str, Any] = {"sample_rate": 0.25, "clip_norm": 1.0, "local_lr": 0.1, "seed": 7}
    args.update(kwargs)
    return P3SGD(**args)


def _trainer(tmp_path: Path, callbacks: list, **kwargs: Any) -> pl.Trainer:
    args: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 6,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": CSVLogger(tmp_path),
        "default_root_dir": tmp_path,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    args.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **args)


def _weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in list(model.parameters()) + list(model.buffers())])


def test_each_round_is_one_step_and_one_ledger_entry(tmp_path: Path) -> None:
    cb = _p3sgd()
    model = TinyClassifier()
    before = _weights(model)
    trainer = _trainer(tmp_path, [cb])
    trainer.fit(model, TinyPatientDataModule())
    assert trainer.global_step == cb.rounds == cb.ledger.steps == 6
    assert not torch.equal(before, _weights(model)), "training must change the weights"
    assert cb.ledger.unit == "patient"
    assert cb.ledger.delta == 1e-5, "default δ is min(1e-5, 1/(10N)) for N = 20 training patients"
    report = (tmp_path / "lightning_logs" / "version_0" / "privacy_report.json").read_text()
    assert '"unit": "patient"' in report
    assert "nonfinite" not in report, "a count over private patients must not be reported unless opted in"


def test_training_metrics_of_the_module_are_not_logged(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, [_p3sgd()])
    trainer.fit(TinyClassifier(), TinyPatientDataModule())
    logged = set(trainer.logged_metrics)
    assert "train/loss" not in logged, "a loss computed on private images left the round unsanitized"
    assert {"privacy/epsilon", "privacy/noise_std", "privacy/noise_multiplier"} <= logged
    assert not any(k.startswith("private_diagnostics/") for k in logged), "private diagnostics are opt-in"


def test_logged_epsilon_is_the_ledger_epsilon(tmp_path: Path) -> None:
    cb = _p3sgd(noise_scales=(3.0, 1.0), selection_epsilon=0.316, loss_bound=3.0)
    trainer = _trainer(tmp_path, [cb])
    trainer.fit(TinyClassifier(), TinyPatientDataModule())
    assert float(trainer.logged_metrics["privacy/epsilon"]) == pytest.approx(RDPAccountant().epsilon(cb.ledger))
    assert sum(cb.selection_counts) == 6


def test_budget_stops_before_the_round_that_would_exceed(tmp_path: Path) -> None:
    budget = PrivacyBudget(target_epsilon=3.0, delta=1e-3)
    cb = _p3sgd(sample_rate=0.5, noise_scales=(2.0,))
    trainer = _trainer(tmp_path, [cb, budget], max_steps=1000)
    trainer.fit(TinyClassifier(), TinyPatientDataModule())
    eps = RDPAccountant().epsilon(cb.ledger)
    assert cb.ledger.delta == 1e-3
    assert 1 < cb.rounds < 1000 and eps <= 3.0
    trial = cb.ledger.copy()
    trial.record(cb.private_step.event(cb.ledger.steps))
    assert RDPAccountant().epsilon(trial) > 3.0, "training stopped although one more round fitted the budget"
    assert budget.stop_reason is not None and "above the target 3" in budget.stop_reason


def _fit_with_checkpoint(tmp_path: Path, max_steps: int, ckpt_path: str | None = None) -> tuple[P3SGD, pl.Trainer, Any]:
    torch.manual_seed(0)
    # adapt_threads=False: the thread count follows the machine's load and changes float round-off; bit-for-bit
    # equality of two runs holds only on fixed threads (P3SGD's docs), and this test compares weights exactly.
    cb = _p3sgd(noise_scales=(3.0, 1.0), selection_epsilon=0.316, loss_bound=3.0, adapt_threads=False)
    model = TinyClassifier()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    trainer = _trainer(tmp_path, [cb, ckpt], max_steps=max_steps, enable_checkpointing=True)
    trainer.fit(model, TinyPatientDataModule(), ckpt_path=ckpt_path)
    return cb, trainer, model


# The second fit resumes into the first's checkpoint folder on purpose.
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning")
def test_resume_continues_ledger_and_weights_exactly(tmp_path: Path) -> None:
    full_cb, _, full_model = _fit_with_checkpoint(tmp_path / "full", max_steps=8)
    _fit_with_checkpoint(tmp_path / "split", max_steps=4)
    last = tmp_path / "split" / "ckpt" / "last.ckpt"
    state = torch.load(last, weights_only=True)
    assert state["callbacks"]["P3SGD"]["rounds"] == 4
    resumed_cb, _, resumed_model = _fit_with_checkpoint(tmp_path / "split", max_steps=8, ckpt_path=str(last))
    assert resumed_cb.rounds == 8 and resumed_cb.ledger.steps == full_cb.ledger.steps
    assert RDPAccountant().epsilon(resumed_cb.ledger) == RDPAccountant().epsilon(full_cb.ledger)
    assert resumed_cb.selection_counts == full_cb.selection_counts
    assert torch.equal(_weights(resumed_model), _weights(full_model)), "resumed run must end with identical weights"


# Lightning's reminder that a resumed run needs the checkpoint's callbacks: this test resumes without them on purpose.
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create:UserWarning")
def test_resume_without_privacy_state_is_an_error(tmp_path: Path) -> None:
    model = TinyClassifier()
    plain = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    plain.fit(model, TinyPatientDataModule())
    path = tmp_path / "plain.ckpt"
    plain.save_checkpoint(path)
    trainer = _trainer(tmp_path, [_p3sgd()], max_steps=4)
    with pytest.raises(PrivacyStateError, match="no P3SGD privacy state"):
        trainer.fit(TinyClassifier(), TinyPatientDataModule(), ckpt_path=str(path))


def test_batchnorm_statistics_are_clipped_with_the_update(tmp_path: Path) -> None:
    # With a near-zero clip and noise, nothing may change: not the weights, not the running statistics,
    # even though local training on each patient moves both a lot.
    model = TinyClassifier(batchnorm=True)
    before = _weights(model)
    cb = _p3sgd(clip_norm=1e-9, noise_scales=(1e-3,), local_lr=1.0)
    _trainer(tmp_path, [cb], max_steps=3).fit(model, TinyPatientDataModule())
    bn = model.net[1]
    assert torch.allclose(bn.running_mean, torch.zeros_like(bn.running_mean), atol=1e-6)
    assert torch.allclose(bn.running_var, torch.ones_like(bn.running_var), atol=1e-6)
    assert torch.allclose(before, _weights(model), atol=1e-6)


def test_bf16_mixed_precision_keeps_fp32_weights(tmp_path: Path) -> None:
    model = TinyClassifier()
    cb = _p3sgd()
    _trainer(tmp_path, [cb], precision="bf16-mixed", max_steps=3).fit(model, TinyPatientDataModule())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert cb.ledger.steps == 3 and torch.isfinite(_weights(model)).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sample_rate": 0.0}, "sample_rate"),
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"clip_norm": -1.0}, "clip_norm"),
        ({"noise_scales": ()}, "noise_scales"),
        ({"noise_scales": (1.0, 0.0)}, "noise_scales"),
        ({"noise_scales": (3.0, 1.0)}, "loss_bound"),
        ({"accounting": "fast"}, "accounting"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(PrivacyConfigError, match=match):
        _p3sgd(**kwargs)


class _NoLossModule(TinyClassifier):
    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        self(batch[0])


def test_training_step_without_loss_fails_before_training(tmp_path: Path) -> None:
    model = _NoLossModule()
    before = _weights(model)
    cb = _p3sgd()
    with pytest.raises(PrivacyConfigError, match="not a scalar loss"):
        _trainer(tmp_path, [cb]).fit(model, TinyPatientDataModule())
    assert cb.ledger.steps == 0 and torch.equal(before, _weights(model))


def test_datamodule_without_patients_is_rejected(tmp_path: Path) -> None:
    class NoPatients(TinyPatientDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.train_dataset = torch.utils.data.TensorDataset(torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))

    with pytest.raises(PrivacyConfigError, match="no patients"):
        _trainer(tmp_path, [_p3sgd()]).fit(TinyClassifier(), NoPatients())


def test_a_frozen_eval_mode_backbone_is_neither_trained_nor_noised(tmp_path: Path) -> None:
    # Only the head trains; the backbone's BatchNorm is in eval mode, so its statistics are not released:
    # they must come out bit-identical (no noise added to them), while the head moves.
    from lightning_dp.models import ImageClassifier

    model = ImageClassifier(arch="resnet18", freeze_backbone=True)  # BatchNorm in the backbone
    backbone = [t.detach().clone() for n, t in model.net.state_dict().items() if not n.startswith("fc.")]
    head = model.net.fc.weight.detach().clone()
    data = TinyPatientDataModule()
    data.train_dataset.x = torch.rand(len(data.train_dataset), 3, 16, 16)  # images for the CNN (4 poolings)
    _trainer(tmp_path, [_p3sgd(noise_scales=(3.0,))], max_steps=3).fit(model, data)
    after = [t for n, t in model.net.state_dict().items() if not n.startswith("fc.")]
    assert all(torch.equal(a, b) for a, b in zip(backbone, after)), "a frozen backbone changed"
    assert not torch.equal(head, model.net.fc.weight), "the head must train"


def test_batchnorm_statistics_of_an_eval_mode_module_are_not_released() -> None:
    from lightning_dp.sanitization import ModelState

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    assert ModelState(net).numel == 20 + 8 + 8  # Linear, BN affine, BN running mean + var
    net[1].eval()
    assert ModelState(net).numel == 20 + 8


def test_fp16_with_a_grad_scaler_does_not_inflate_the_clipped_update(tmp_path: Path) -> None:
    # Lightning turns precision="16-mixed" on CPU into bf16, so the fp16 plugin with its GradScaler is given
    # explicitly. With negligible noise one round moves the released tensors by Σ clipped / (q·N): at most
    # (patients in the round)·C/(q·N). A loss scale leaking into the local updates would inflate the norms
    # that clipping sees (over-clipping) or the update itself (beyond the bound).
    from pytorch_lightning.plugins.precision import MixedPrecision

    model = TinyClassifier()
    before = _weights(model)
    cb = _p3sgd(sample_rate=0.5, clip_norm=0.01, noise_scales=(1e-6,), local_lr=1.0, log_private_diagnostics=True)
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    trainer = _trainer(tmp_path, [cb], max_steps=1, plugins=[plugin])
    trainer.fit(model, TinyPatientDataModule())
    patients = float(trainer.logged_metrics["private_diagnostics/patients_in_round"])
    bound = patients * 0.01 / (0.5 * 20)
    change = float((_weights(model) - before).norm())
    assert patients > 0 and 0.5 * bound < change <= bound * (1 + 1e-3), (change, bound)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("vectorize", [False, "auto"])
def test_no_patients_raw_change_or_unnoised_sum_is_kept_after_a_round(tmp_path: Path, vectorize: Any) -> None:
    """θ_t, the clipped sum and a patient's change live in kept workspaces (no page faults per round); the
    private ones, and the batched path's gradient sum, are zeroed when the round ends: no un-noised value
    outlives it in memory."""
    cb = _p3sgd(vectorize=vectorize, local_batch_size=64)
    seen: list[tuple[bool, ...]] = []
    states: list[Any] = []

    class Probe(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            state = cb._state
            assert state is not None
            states.append(state)
            kept = [state.workspace("change"), state.workspace("clipped_sum")]
            if isinstance(cb._round, BatchedRound):
                kept.append(cb._round.clipper.flat_sum)
            seen.append(tuple(bool(t.any()) for t in kept))

    trainer = _trainer(tmp_path, [cb, Probe()], max_steps=3)
    trainer.fit(TinyClassifier(batchnorm=False), TinyPatientDataModule())  # BatchNorm would keep the loop
    assert cb.round_path == ("loop" if vectorize is False else "batched")
    assert seen == [(False,) * (2 if vectorize is False else 3)] * 3
    assert cb.rounds == 3 and cb.nonfinite_updates == 0
    assert not states[-1]._workspaces, "the end of the fit frees the kept vectors"
    assert cb._state is None, "and drops the fit's state"
