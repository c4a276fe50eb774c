"""P3SGD's vectorized round (one local step = a per-patient gradient) against the patient-by-patient loop.

Same seed, same data: the same patients are sampled and the same noise drawn, so the two runs differ only by the
float round-off of the clipped sum. Models cover every layer-rule family (Linear, Conv2d, ConvTranspose2d,
GroupNorm, an eval-mode BatchNorm's affine, Embedding); patients have 1 to 7 images.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_dp.callbacks import P3SGD
from lightning_dp.sampling.randomness import UnitStreams
from lightning_dp.training.patient_rounds import BatchedRound
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule

COUNTS = [1, 4, 7, 2, 5, 3, 6, 2, 1, 7, 4, 3]  # images of each patient


class _Patients(Dataset):  # type: ignore[type-arg]
    """Patients with different image counts; items (image 3x6x6, label, token for the embedding)."""

    def __init__(self, counts: list[int] = COUNTS, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        n = sum(counts)
        self.patient = torch.arange(len(counts)).repeat_interleave(torch.tensor(counts))
        self.x = torch.randn(n, 3, 6, 6, generator=g) + torch.randn(len(counts), 3, 1, 1, generator=g)[self.patient]
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.token = torch.randint(0, 5, (n,), generator=g)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        self.patient_to_indices = {p: list(range(s, s + c)) for p, (s, c) in enumerate(zip(starts, counts))}
        self.num_patients = len(counts)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.x[i], self.y[i], self.token[i]


class _Data(pl.LightningDataModule):
    def __init__(self, counts: list[int] = COUNTS) -> None:
        super().__init__()
        self.train_dataset = _Patients(counts)
        self.declared_num_patients = len(counts)  # N declared: the configured patients

    def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        return DataLoader(self.train_dataset, batch_size=8)


class RuleZoo(pl.LightningModule):
    """Conv2d → GroupNorm → eval-mode BatchNorm (affine trained) → ConvTranspose2d → Linear + Embedding → Linear."""

    def __init__(self, weighted: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.gn = nn.GroupNorm(2, 6)
        self.bn = nn.BatchNorm2d(6)
        with torch.no_grad():  # pre-trained statistics: a fixed, non-trivial affine map
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
        self.deconv = nn.ConvTranspose2d(6, 4, 2, stride=2)
        self.fc = nn.Linear(4 * 4 * 4, 8)
        self.emb = nn.Embedding(5, 8)
        self.head = nn.Linear(8, 3)
        self.weighted = weighted
        self.train()

    def train(self, mode: bool = True) -> RuleZoo:
        super().train(mode)
        self.bn.eval()  # frozen statistics, trained affine
        return self

    def forward(self, x: Tensor, token: Tensor) -> Tensor:
        h = self.bn(torch.relu(self.gn(self.conv(x))))
        h = nn.functional.adaptive_avg_pool2d(torch.relu(self.deconv(h)), 4).flatten(1)
        return self.head(torch.tanh(self.fc(h) + self.emb(token)))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, token = batch
        # A class-weighted mean couples the images of a batch (its normalizer is the batch's weight sum).
        weight = torch.tensor([1.0, 3.0, 0.5], dtype=x.dtype, device=x.device) if self.weighted else None
        return nn.functional.cross_entropy(self(x, token), y, weight=weight)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _p3sgd(**kwargs: Any) -> P3SGD:
    args: dict[str, Any] = {
        "sample_rate": 0.5,
        "clip_norm": 0.3,
        "local_lr": 0.5,
        "seed": 3,
        "noise_scales": (0.05,),
        "vectorize": "auto",
    }
    args.update(kwargs)
    return P3SGD(**args)


def _fit(tmp_path: Path, model: pl.LightningModule, cb: P3SGD, rounds: int, data: Any = None, extra: Any = ()) -> Any:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=rounds,
        callbacks=[cb, *extra],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, data or _Data())
    return trainer


def _state(model: nn.Module) -> Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in list(model.parameters()) + list(model.buffers())])


@pytest.mark.parametrize("selection", [False, True, "large patients"])
def test_vectorized_rounds_equal_the_loop(tmp_path: Path, selection: Any) -> None:
    """With "large patients" (local_batch_size=4 for patients of up to 7 images) the patients of more than 4 images take
    two local steps: the loop trains them within the batched round, and the path does not depend on them (review of
    issue 31: choosing it from the largest patient, and saying so, depended on the private data)."""
    extra: dict[str, Any] = {"noise_scales": (0.15, 0.05), "selection_epsilon": 1.0, "loss_bound": 3.0}
    kwargs = extra if selection is True else {"local_batch_size": 4} if selection else {}
    runs = {}
    for mode in ("auto", False):
        model, cb = RuleZoo(), _p3sgd(vectorize=mode, log_private_diagnostics=True, **kwargs)
        start = _state(model)
        _fit(tmp_path / str(mode), model, cb, rounds=4)
        runs[mode] = (cb, _state(model) - start)
    (vec, moved_vec), (loop, moved_loop) = runs["auto"], runs[False]
    assert vec.vectorized_rounds == 4 and vec.vectorize_fallback is None and vec.round_path == "batched"
    assert loop.vectorized_rounds == 0 and loop.vectorize_fallback == "vectorize=False" and loop.round_path == "loop"
    assert vec.ledger.entries == loop.ledger.entries and vec.ledger.steps == 4
    assert vec.selection_counts == loop.selection_counts
    assert float(moved_loop.norm()) > 0
    assert float((moved_vec - moved_loop).norm()) <= 1e-5 * float(moved_loop.norm())


def test_vectorized_rounds_follow_patient_ids_that_are_not_positions(tmp_path: Path) -> None:
    """Ids "P11".."P00" (the reverse of the images' order): both paths train the k-th id in sorted order."""

    def renamed() -> _Data:
        data = _Data()
        groups = data.train_dataset.patient_to_indices
        data.train_dataset.patient_to_indices = {f"P{len(groups) - 1 - p:02d}": idx for p, idx in groups.items()}
        return data

    moved = {}
    for mode in ("auto", False):
        model, cb = RuleZoo(), _p3sgd(vectorize=mode)
        start = _state(model)
        _fit(tmp_path / str(mode), model, cb, rounds=2, data=renamed())
        moved[mode] = _state(model) - start
    assert float((moved["auto"] - moved[False]).norm()) <= 1e-5 * float(moved[False].norm())


class _Probe(pl.Callback):
    """After P3SGD's start-up: each patient's clipped update by the loop and by the batched pass, alone and together."""

    def __init__(self, cb: P3SGD, patients: int = len(COUNTS)) -> None:
        self.cb = cb
        self.patients = patients
        self.loop: dict[int, Tensor] = {}
        self.alone: dict[int, tuple[Tensor, Tensor]] = {}
        self.together: Tensor | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        cb, state, batched = self.cb, self.cb._state, self.cb._round
        assert state is not None and isinstance(batched, BatchedRound), cb.vectorize_fallback
        parts = batched.parts
        theta, other = state.vector(), state.snapshot_other_buffers()
        patients = list(range(self.patients))
        with torch.enable_grad():
            for p in patients:
                out = torch.zeros_like(theta)
                generator = torch.Generator().manual_seed(0)
                parts.local.train(state.params, parts.step, parts.data.batch, parts.data.groups[p], generator)
                state.add_clipped_change(theta, out, cb.clip_norm)
                state.load(theta, other)
                self.loop[p] = out
                out = torch.zeros_like(theta)
                stats = batched.add_one_step([p], out, UnitStreams(0, "patient")).to_tensor()
                self.alone[p] = (out, stats)
            self.together = torch.zeros_like(theta)
            batched.add_one_step(patients, self.together, UnitStreams(0, "patient"))
        assert torch.equal(state.vector(), theta), "the batched pass must not change the model"


def test_each_patient_contributes_its_own_clipped_update(tmp_path: Path) -> None:
    cb = _p3sgd(clip_norm=0.3, vectorize_batch_size=10)  # several batched passes for all patients
    probe = _Probe(cb)
    _fit(tmp_path, RuleZoo(), cb, rounds=1, extra=[probe])
    clipped = 0
    for p, (out, stats) in probe.alone.items():
        loop = probe.loop[p]
        assert float((out - loop).norm()) <= 1e-5 * float(loop.norm()), p
        assert float(out.norm()) <= 0.3 * (1 + 1e-6)
        clipped += int(stats[1])
    assert 1 < clipped < len(COUNTS), "some patients clipped, others not"
    # Together (one pass over several patients' images): the sum of their own clipped updates, no cross-talk.
    alone_sum = torch.stack([out for out, _ in probe.alone.values()]).sum(0)
    assert probe.together is not None
    assert float((probe.together - alone_sum).norm()) <= 1e-5 * float(alone_sum.norm())


def test_a_patient_with_a_huge_update_contributes_exactly_the_bound(tmp_path: Path) -> None:
    data = TinyPatientDataModule()
    data.train_dataset.x[data.train_dataset.patient_to_indices[2]] *= 1e4  # the first Linear's gradient scales with x
    cb = _p3sgd(clip_norm=0.3, local_lr=0.1)
    probe = _Probe(cb, patients=6)
    _fit(tmp_path, TinyClassifier(batchnorm=False), cb, rounds=1, data=data, extra=[probe])
    huge, stats = probe.alone[2]
    assert float(probe.loop[2].norm()) == pytest.approx(0.3, rel=1e-6)
    assert float(huge.norm()) == pytest.approx(0.3, rel=1e-6) and int(stats[1]) == 1
    assert float(stats[2]) > 100 * 0.3, "the patient's own update (its norm before clipping) was huge"
    assert float((huge - probe.loop[2]).norm()) <= 1e-5 * 0.3


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"local_momentum": 0.9}, "local_momentum=0.9"),
        ({"local_epochs": 2}, "local_epochs=2"),
        ({"local_weight_decay": 1e-4}, "local_weight_decay=0.0001"),
        ({"weighted": True}, "couples the images of a batch"),
    ],
)
def test_stacked_local_sgd_runs_when_one_batched_pass_is_not_the_same(
    tmp_path: Path, kwargs: dict[str, Any], reason: str
) -> None:
    """Not one plain step, or a loss that couples a batch's images: each patient's own steps, stacked (said why)."""
    weighted = kwargs.pop("weighted", False)
    cb = _p3sgd(**kwargs)
    _fit(tmp_path, RuleZoo(weighted=weighted), cb, rounds=1)
    assert cb.vectorized_rounds == 1 and cb.rounds == 1 and cb.round_path == "stacked"
    assert cb.vectorize_fallback is not None and reason in cb.vectorize_fallback, cb.vectorize_fallback


def test_the_loop_runs_for_batchnorm_in_training_mode(tmp_path: Path) -> None:
    cb = _p3sgd()
    _fit(tmp_path, TinyClassifier(batchnorm=True), cb, rounds=1, data=TinyPatientDataModule())
    assert cb.vectorized_rounds == 0 and cb.rounds == 1 and cb.round_path == "loop"
    assert cb.vectorize_fallback is not None and "BatchNorm layers in training mode (net.1)" in cb.vectorize_fallback


def test_tiny_classifier_without_batchnorm_is_vectorized(tmp_path: Path) -> None:
    cb = _p3sgd()
    _fit(tmp_path, TinyClassifier(batchnorm=False), cb, rounds=2, data=TinyPatientDataModule())
    assert cb.vectorized_rounds == 2 and cb.vectorize_fallback is None


def test_vectorize_must_be_auto_or_false() -> None:
    from lightning_dp.errors import PrivacyConfigError

    with pytest.raises(PrivacyConfigError, match="vectorize must be 'auto' or False, found True"):
        _p3sgd(vectorize=True)


def test_the_selection_scores_candidates_in_chunks_of_the_rounds_images(tmp_path: Path) -> None:
    """vectorize="auto" on the loop (BatchNorm in training mode): each candidate's loss takes ceil(images/10) passes."""
    calls: list[int] = []

    class Counting(TinyClassifier):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            if not self.training:
                calls.append(len(batch[0]))
            return super().training_step(batch, batch_idx)

    scales = {"noise_scales": (0.15, 0.05), "selection_epsilon": 1.0, "loss_bound": 3.0}
    cb = _p3sgd(vectorize_batch_size=10, **scales)
    _fit(tmp_path, Counting(), cb, rounds=1, data=TinyPatientDataModule(per_patient=6))
    assert cb.round_path == "loop"
    assert calls and max(calls) == 10, calls
    per_candidate = sum(calls) // 2
    assert per_candidate % 6 == 0 and len(calls) == 2 * -(-per_candidate // 10), calls


class _NoisyFromRoundTwo(RuleZoo):
    """Adds Gaussian noise to its inputs once switched on (by a public schedule): the start-up check saw none."""

    noisy = False

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.noisy:
            batch = (batch[0] + 0.1 * torch.randn_like(batch[0]), *batch[1:])
        return super().training_step(batch, batch_idx)


class _SwitchOn(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        pl_module.noisy = trainer.global_step >= 1


def test_a_batched_pass_that_draws_random_numbers_is_redone_by_the_loop(tmp_path: Path) -> None:
    """Review of issue 31: the batched pass ran training_step on the global generator, so a step drawing random numbers
    after start-up drew them per position in the batch (one patient moved the sum by 2.5·C). Such a round is now
    re-done by the loop, each patient from its own stream: the same weights as the loop, nothing said."""
    moved = {}
    for mode in ("auto", False):
        model, cb = _NoisyFromRoundTwo(), _p3sgd(vectorize=mode)
        start = _state(model)
        _fit(tmp_path / str(mode), model, cb, rounds=3, extra=[_SwitchOn()])
        moved[mode] = _state(model) - start
        if mode:
            assert cb.round_path == "batched" and cb.vectorize_fallback is None
    assert float((moved["auto"] - moved[False]).norm()) <= 1e-5 * float(moved[False].norm())
