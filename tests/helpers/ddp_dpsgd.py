"""Runs DPSGD on tiny indexed data with N CPU processes (Lightning DDP, gloo) and saves what it saw.

Usage: python tests/helpers/ddp_dpsgd.py DEVICES OUT_DIR
Runs the two phases of `PHASES` one after the other in the same process group and writes
OUT_DIR/result.pt (rank 0): for each phase the final parameters, the per-step parameter changes,
ε, the step count, and each step's sample indices as every rank received them.
After every step every rank checks that all ranks hold identical weights (exits non-zero if not).

`run_phase` is also imported by the tests to make the one-process reference run in-process.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_dp.acceptance import AnnealedAcceptance  # noqa: E402
from lightning_dp.accounting import RDPAccountant  # noqa: E402
from lightning_dp.callbacks import DPSGD  # noqa: E402
from lightning_dp.sampling.samples import LogicalBatch  # noqa: E402
from lightning_dp.schedules import ExponentialDecay  # noqa: E402

SEED = 23

#: "learn": a real learning signal (some samples clipped, several physical chunks per rank) to compare
#: two processes with one. "noise": zero learning signal (loss × 0) on a 45,058-parameter model, so each
#: step's change is the noise alone; an expected batch of 2 leaves some ranks with an empty share.
PHASES: dict[str, dict[str, Any]] = {
    "learn": {
        "num_samples": 40,
        "sample_rate": 0.3,
        "hidden": 32,
        "dropout": 0.3,  # every sample's masks and jitter from its own stream: the same on any rank
        "jitter": 0.1,
        "loss_weight": 1.0,
        "lr": 0.5,
        "clip_norm": 0.5,
        "noise_multiplier": 0.8,
        "max_physical_batch_size": 4,
        "steps": 6,
    },
    "noise": {
        "num_samples": 16,
        "sample_rate": 0.125,
        "hidden": 4096,
        "loss_weight": 0.0,
        "lr": 1.0,
        "clip_norm": 1.0,
        "noise_multiplier": 1.0,
        "max_physical_batch_size": 4,
        "steps": 4,
    },
    # Noise decay and annealed acceptance with a private energy on the step's own sample: the energy is summed
    # over ranks before its noise, and the decision is the same on every rank (shared generator).
    "anneal": {
        "num_samples": 40,
        "sample_rate": 0.3,
        "hidden": 32,
        "loss_weight": 1.0,
        "lr": 0.5,
        "clip_norm": 0.5,
        "noise_multiplier": ExponentialDecay(initial=1.0, decay=0.8, every=2),
        "acceptance": True,
        "max_physical_batch_size": 4,
        "steps": 8,
    },
}


class IndexedDataset(Dataset[tuple[Tensor, Tensor, Tensor]]):
    """``n`` 8-feature samples ``(x, y, index)``; the index lets the test see which samples a rank got."""

    def __init__(self, n: int, dim: int = 8, seed: int = 0, jitter: float = 0.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = (self.x.sum(1) > 0).long()
        self.jitter = jitter  # random jitter drawn from the global generator, as a torchvision transform draws it

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        x = self.x[i] + self.jitter * torch.randn_like(self.x[i]) if self.jitter else self.x[i]
        return x, self.y[i], torch.tensor(i)


class IndexedDataModule(pl.LightningDataModule):
    def __init__(self, n: int, jitter: float = 0.0) -> None:
        super().__init__()
        self.train_dataset = IndexedDataset(n, jitter=jitter)
        self.declared_num_samples = n  # the configured size: N declared

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor, Tensor]]:
        return DataLoader(self.train_dataset, batch_size=8, shuffle=True)


class MLP(pl.LightningModule):
    """Linear–ReLU–Linear, mean cross-entropy scaled by ``loss_weight``, plain SGD (momentum 0)."""

    def __init__(self, hidden: int, loss_weight: float, lr: float, dim: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 2))
        self.loss_weight = loss_weight
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch[0], batch[1]
        return nn.functional.cross_entropy(self.net(x), y) * self.loss_weight

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.0)


def _params(module: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


class RecordAndCompare(pl.Callback):
    """Records each step's parameter change and per-rank sample indices; fails if ranks' weights differ."""

    def __init__(self, max_chunk: int) -> None:
        self.max_chunk = max_chunk
        self.deltas: list[Tensor] = []
        self.indices: list[list[Tensor]] = []  # [step][rank]
        self.steps: list[int] = []
        self._before: Tensor | None = None

    @staticmethod
    def _distributed() -> bool:
        return dist.is_available() and dist.is_initialized()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if not isinstance(batch, LogicalBatch):
            raise SystemExit(f"the training batch is a {type(batch).__name__}, not DPSGD's LogicalBatch")
        local = torch.cat([chunk[2] for chunk in batch.chunks]) if batch.chunks else torch.zeros(0, dtype=torch.long)
        if len(local) != batch.size or any(len(chunk[2]) > self.max_chunk for chunk in batch.chunks):
            raise SystemExit(f"step {batch.step}: LogicalBatch.size {batch.size} or its chunks are inconsistent")
        shares = [local]
        if self._distributed():
            gathered: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(gathered, local)
            shares = gathered
        self.indices.append(shares)
        self.steps.append(batch.step)
        self._before = _params(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        weights = _params(pl_module)
        if self._distributed():
            gathered = [torch.zeros_like(weights) for _ in range(trainer.world_size)]
            dist.all_gather(gathered, weights)
            if not all(torch.equal(gathered[0], w) for w in gathered):
                worst = max(float((w - gathered[0]).abs().max()) for w in gathered)
                raise SystemExit(f"weights differ across ranks after step {trainer.global_step} (max |Δ| {worst:.3g})")
        assert self._before is not None
        self.deltas.append(weights - self._before)


def run_phase(phase: str, devices: int, root: Path) -> dict[str, Any]:
    """Trains one phase; returns what it recorded (the same on every rank)."""
    cfg = PHASES[phase]
    torch.manual_seed(0)
    model = MLP(cfg["hidden"], cfg["loss_weight"], cfg["lr"], dropout=cfg.get("dropout", 0.0))
    cb = DPSGD(
        clip_norm=cfg["clip_norm"],
        noise_multiplier=cfg["noise_multiplier"],
        sample_rate=cfg["sample_rate"],
        max_physical_batch_size=cfg["max_physical_batch_size"],
        delta=1e-5,
        seed=SEED,
        acceptance=AnnealedAcceptance(q0=10.0, mu0=2, energy_noise_multiplier=1.0) if cfg.get("acceptance") else None,
    )
    recorder = RecordAndCompare(cfg["max_physical_batch_size"])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=cfg["steps"],
        default_root_dir=root / phase,
        callbacks=[cb, recorder],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, IndexedDataModule(cfg["num_samples"], jitter=cfg.get("jitter", 0.0)))
    assert cb.ledger is not None and cb.sampler is not None
    return {
        "params": _params(model),
        "deltas": torch.stack(recorder.deltas),
        "indices": recorder.indices,
        "batch_steps": recorder.steps,
        "epsilon": RDPAccountant().epsilon(cb.ledger),
        "steps": cb.steps,
        "ledger_steps": cb.ledger.steps,
        "global_step": trainer.global_step,
        "world_size": trainer.world_size,
        "sampler_seed": cb.sampler.seed,
        "expected_batch_size": cb.sampler.expected_batch_size,
        "is_global_zero": trainer.is_global_zero,
        "accepted": cb.acceptance.state_dict().get("accepted", cb.steps),
    }


def main() -> None:
    devices, out = int(sys.argv[1]), Path(sys.argv[2])
    results = {phase: run_phase(phase, devices, out) for phase in PHASES}
    if results["learn"]["is_global_zero"]:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(results, out / "result.pt")


if __name__ == "__main__":
    main()
