"""Runs P3SGD on the tiny patient data with N CPU processes (Lightning DDP, gloo) and saves what it saw.

Usage: python tests/helpers/ddp_p3sgd.py DEVICES OUT_DIR LOCAL_LR ROUNDS [sync|anneal|stacked]
Writes OUT_DIR/result.pt (rank 0): final parameters, per-round parameter changes, ε, rounds. With ``sync``
the Trainer has sync_batchnorm=True, and the script writes OUT_DIR/refused.txt with P3SGD's error. With
``stacked`` the model has no BatchNorm and each patient takes two local epochs with momentum under
``vectorize="auto"`` (stacked local SGD).
Every rank checks after every round that all ranks hold identical weights (exits non-zero if not).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_dp.acceptance import AnnealedAcceptance  # noqa: E402
from lightning_dp.accounting import RDPAccountant  # noqa: E402
from lightning_dp.callbacks import P3SGD  # noqa: E402
from lightning_dp.errors import PrivacyConfigError  # noqa: E402
from lightning_dp.schedules import ExponentialDecay  # noqa: E402
from tests.helpers.patients import TinyClassifier, TinyPatientDataModule, TinyPatientDataset  # noqa: E402


def _params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


class RecordAndCompare(pl.Callback):
    def __init__(self) -> None:
        self.deltas: list[torch.Tensor] = []
        self.previous: torch.Tensor | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.previous = _params(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        weights = torch.cat([_params(pl_module)] + [b.detach().reshape(-1).float() for b in pl_module.buffers()])
        if dist.is_available() and dist.is_initialized():
            gathered = [torch.zeros_like(weights) for _ in range(trainer.world_size)]
            dist.all_gather(gathered, weights)
            if not all(torch.equal(gathered[0], w) for w in gathered):
                raise SystemExit(f"weights differ across ranks after round {trainer.global_step}")
        assert self.previous is not None
        self.deltas.append(_params(pl_module) - self.previous)


class JitteredPatients(TinyPatientDataset):
    """Random jitter drawn from the global generator in ``__getitem__``, as a torchvision transform draws it."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y, patient = super().__getitem__(i)
        return x + 0.1 * torch.randn_like(x), y, patient


def main() -> None:
    devices, out, local_lr, rounds = int(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    sync = sys.argv[5:] == ["sync"]
    anneal = sys.argv[5:] == ["anneal"]
    stacked = sys.argv[5:] == ["stacked"]
    torch.manual_seed(0)
    cb = P3SGD(
        sample_rate=0.5,
        clip_norm=1.0,
        noise_scales=(3.0, 1.0),
        selection_epsilon=0.316,
        loss_bound=3.0,
        local_lr=local_lr,
        seed=11,
        noise_schedule=ExponentialDecay(initial=1.0, decay=0.8, every=2) if anneal else None,
        acceptance=AnnealedAcceptance(q0=10.0, mu0=2, energy_noise_multiplier=1.0) if anneal else None,
        **({"vectorize": "auto", "local_epochs": 2, "local_momentum": 0.5} if stacked else {}),
    )
    recorder = RecordAndCompare()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=rounds,
        default_root_dir=out,
        callbacks=[cb, recorder],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        sync_batchnorm=sync,
    )
    model = TinyClassifier(hidden=4096, batchnorm=not stacked)
    data = TinyPatientDataModule(num_patients=20)
    data.train_dataset = JitteredPatients(num_patients=20)  # each patient's jitter from its own stream, on any rank
    try:
        trainer.fit(model, data)
    except PrivacyConfigError as err:
        if not sync:
            raise
        if trainer.is_global_zero:
            out.mkdir(parents=True, exist_ok=True)
            (out / "refused.txt").write_text(f"{err}\nrounds={cb.rounds}")
        return
    if trainer.is_global_zero:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "params": _params(model),
                "deltas": torch.stack(recorder.deltas),
                "epsilon": RDPAccountant().epsilon(cb.ledger),
                "rounds": cb.rounds,
                "selection_counts": cb.selection_counts,
                "expected_count": cb.sampler.expected_count,
                "accepted": cb.acceptance.state_dict().get("accepted", cb.rounds),
                "round_path": cb.round_path,
            },
            out / "result.pt",
        )


if __name__ == "__main__":
    main()
