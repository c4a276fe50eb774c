"""The federated P3SGD server: sums the sites' clipped sums, adds the noise once, charges one patient-level ledger."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dp.accounting import PrivacyLedger, RDPAccountant
from lightning_dp.errors import PrivacyStateError, check_count, check_finite_positive, check_sample_rate
from lightning_dp.sanitization import GaussianRelease, ModelState
from lightning_dp.schedules import NoiseSchedule
from lightning_dp.training.privacy import default_delta
from lightning_dp.training.step import ModelStateTarget, PrivateStep, StepResult

__all__ = ["FederatedServer", "RoundOutcome"]


@dataclass
class RoundOutcome:
    """What a round did: the release (noise, charge), and the sites whose replies were refused, with why."""

    result: StepResult
    refused: dict[str, str] = field(default_factory=dict)


def reply_problem(reply: Any, size: int) -> str | None:
    """Why a site's reply cannot be summed (None if it can): not a float32 vector of ``size`` finite values."""
    if reply is None:
        return "no reply"
    if not isinstance(reply, Tensor):
        return f"a {type(reply).__name__}, not a tensor"
    if reply.dtype != torch.float32:
        return f"dtype {reply.dtype}, not torch.float32"
    if reply.dim() != 1 or reply.numel() != size:
        return f"shape {tuple(reply.shape)}, not ({size},)"
    if not bool(torch.isfinite(reply).all()):
        return "non-finite values"
    return None


class FederatedServer:
    """Holds θ, the release and the one patient-level ledger of a federated P3SGD run.

    Args:
        module: the model (the server's copy; its released tensors are θ).
        num_patients: N, the total number of training patients over all sites (declared public, as in P3SGD).
        sample_rate: q, each patient's probability of joining a round (every site uses it).
        clip_norm: C, the bound on one patient's update (every site clips to it).
        noise: z, the noise multiplier (a number or a `NoiseSchedule`).
        delta: δ of the ledger; default min(1e-5, 1/(10N)).
        server_lr: θ_{t+1} = θ_t + server_lr·Δ̃.
        seed: the noise generator's seed; ``None`` (default) draws one from the OS CSPRNG.

    Example:
        >>> from torch import nn
        >>> server = FederatedServer(nn.Linear(2, 2), num_patients=100, sample_rate=0.1, clip_norm=1.0, noise=1.0,
        ...                          seed=0)
        >>> outcome = server.round({"a": torch.zeros(6), "b": torch.ones(3)})
        >>> server.ledger.steps, outcome.refused, round(outcome.result.released.noise_std, 3)
        (1, {'b': 'shape (3,), not (6,)'}, 0.1)
    """

    def __init__(
        self,
        module: nn.Module,
        num_patients: int,
        sample_rate: float,
        clip_norm: float,
        noise: float | NoiseSchedule,
        delta: float | None = None,
        server_lr: float = 1.0,
        seed: int | None = None,
    ) -> None:
        owner = "FederatedServer"
        self.num_patients = check_count(owner, "num_patients", num_patients, "the patients of all sites.", minimum=1)
        self.sample_rate = check_sample_rate(owner, sample_rate)
        self.clip_norm = check_finite_positive(owner, "clip_norm", clip_norm, "e.g. 1.0.")
        self.server_lr = check_finite_positive(owner, "server_lr", server_lr, "1.0 applies the update as is.")
        self.state = ModelState(module)
        self.ledger = PrivacyLedger("patient", default_delta(self.num_patients) if delta is None else float(delta))
        self.release = GaussianRelease(
            self.ledger, clip_norm=self.clip_norm, sample_rate=self.sample_rate, schedule=noise, seed=seed
        )
        self.private_step = PrivateStep(self.release)
        self.steps = 0

    @property
    def normalizer(self) -> float:
        """q·N, the public expected number of patients per round (never the private count)."""
        return self.sample_rate * self.num_patients

    def theta(self) -> Tensor:
        """θ_t to send to the sites."""
        self.state.refresh()
        return self.state.vector()

    def round(self, replies: Mapping[str, Tensor | None]) -> RoundOutcome:
        """One round: sums the valid replies, releases once (noise and charge in one call), applies θ_{t+1}.

        A refused reply (``reply_problem``) contributes nothing, as a site that did not reply; the round is charged as
        usual (a patient's influence can only shrink).
        """
        state = self.state
        state.refresh()
        theta, other = state.vector(), state.snapshot_other_buffers()
        total = torch.zeros_like(theta)
        refused: dict[str, str] = {}
        for name, reply in replies.items():
            problem = reply_problem(reply, theta.numel())
            if problem is not None:
                refused[name] = problem
                continue
            assert reply is not None
            total += reply.to(theta.device)
        target = ModelStateTarget(state, theta, other, self.server_lr)
        result = self.private_step(self.steps, total, self.normalizer, target)
        self.steps += 1
        return RoundOutcome(result, refused)

    def epsilon(self) -> float:
        """ε of the run so far at the ledger's δ (RDP accountant), patient level."""
        return RDPAccountant().epsilon(self.ledger)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """θ, the ledger, the noise generator and the round counter (keep it private: it holds the noise seed)."""
        return {
            "steps": self.steps,
            "theta": self.theta().clone(),
            "ledger": self.ledger.state_dict(),
            "release": self.release.state_dict(),
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Continues a run exactly where `state_dict` left it; a state whose counter and ledger disagree is refused."""
        missing = {"steps", "theta", "ledger", "release"} - set(saved)
        if missing:
            raise PrivacyStateError(
                f"`FederatedServer`: the saved state lacks {sorted(missing)}: resuming would start a fresh ledger. "
                "HINT: load a state written by FederatedServer.state_dict()."
            )
        ledger = PrivacyLedger("patient", self.ledger.delta)
        ledger.load_state_dict(saved["ledger"])
        if ledger.steps != saved["steps"]:
            raise PrivacyStateError(
                f"`FederatedServer`: the saved round counter ({saved['steps']}) disagrees with its ledger "
                f"({ledger.steps} rounds). HINT: load an unmodified state."
            )
        self.release.load_state_dict(saved["release"])
        self.ledger.load_state_dict(saved["ledger"])
        self.state.refresh()
        self.state.load(saved["theta"])
        self.steps = int(saved["steps"])
