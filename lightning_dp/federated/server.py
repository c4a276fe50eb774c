"""The federated P3SGD server: sums the sites' clipped sums, adds the noise once, charges one patient-level ledger."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_dp.acceptance import AlwaysAccept
from lightning_dp.accounting import GaussianEvent, PoissonSampledEvent, PrivacyEvent, PrivacyLedger, RDPAccountant
from lightning_dp.errors import (
    PrivacyBudgetExceededError,
    PrivacyConfigError,
    PrivacyStateError,
    check_count,
    check_finite_positive,
    check_sample_rate,
)
from lightning_dp.sampling.patients import secure_seed
from lightning_dp.sanitization import GaussianRelease, ModelState, Release
from lightning_dp.schedules import ConstantNoise, NoiseSchedule
from lightning_dp.training.privacy import calibrate_schedule, default_delta
from lightning_dp.training.step import ModelStateTarget, PrivateStep, StepResult

__all__ = ["FederatedServer", "RoundOutcome", "SharedNoiseRelease", "calibrated_multiplier", "share_std"]


@dataclass
class RoundOutcome:
    """What a round did: the release (noise, charge), and the sites whose replies were refused, with why.

    ``result`` is None when nothing was released: with the noise at the sites, a round in which no share arrived
    (θ is unchanged, nothing is charged, and the round is run again).
    """

    result: StepResult | None
    refused: dict[str, str] = field(default_factory=dict)


class SharedNoiseRelease(Release):
    """The noise of a round added at the sites: each of the m sites added N(0, z²C²/m) to its sum; m' arrived.

    The sum of the m' shares that arrived is N(0, (m'/m)·z²C²): the round is charged the multiplier z·√(m'/m) that is
    present, never z. ``present`` counts the shares that arrived in units of the planned share (Σ σ_s² / (z²C²/m), m'
    when every site added the planned share). Before the replies are in (``present`` is None), `event` is the worst
    case, ``min_shares`` shares (fewer are never released): the budget check stays a hard stop whatever arrives.
    """

    def __init__(self, *args: Any, shares: int, min_shares: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shares = shares
        self.min_shares = min_shares
        self.present: float | None = None

    def noise_multiplier(self, step: int) -> float:
        present = self.min_shares if self.present is None else self.present
        return self.schedule.checked(step) * math.sqrt(present / self.shares)

    def _gaussian(self, like: Tensor, std: float) -> Tensor:
        return torch.zeros_like(like)  # the shares are in the sum already


def calibrated_multiplier(
    num_patients: int,
    sample_rate: float,
    rounds: int,
    target_epsilon: float,
    delta: float | None = None,
    sites: int | None = None,
    min_shares: int | None = None,
) -> float:
    """z such that ``rounds`` rounds at q end at ``target_epsilon`` (patient level, RDP, δ default min(1e-5, 1/(10N))).

    What `FederatedServer(target_epsilon=…, rounds=…)` calibrates to; sites that add the noise shares compute it from
    the same public settings (they do not take z from the server). With ``sites`` (noise at the sites), the rounds
    are planned with ``min_shares`` shares present (default: all), the worst the budget allows.

    Example:
        >>> round(calibrated_multiplier(num_patients=1000, sample_rate=0.05, rounds=100, target_epsilon=1.0), 2)
        2.32
    """
    server = FederatedServer(
        nn.Identity(),
        num_patients,
        sample_rate,
        1.0,
        target_epsilon=target_epsilon,
        rounds=rounds,
        delta=delta,
        noise_at="server" if sites is None else "sites",
        sites=sites,
        min_shares=min_shares,
    )
    return server.release.schedule.checked(0)


def share_std(noise_multiplier: float, clip_norm: float, sites: int) -> float:
    """The std of one site's noise share, z·C/√m: m shares sum to the central mechanism's N(0, z²C²)."""
    return noise_multiplier * clip_norm / math.sqrt(sites)


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
        num_patients: N, the consortium's number of training patients, **declared before the data are counted**
            (e.g. the sum of the numbers the hospitals committed to in the consortium's protocol). The update is
            divided by q·N and a reply may weigh at most N·C, whatever the sites actually hold: a normalizer that
            followed the sites' counts would scale every released θ_t by a number one patient (or one hospital)
            changes, a channel outside the noised sum. The sites' counts are never asked for; a site compares its
            own count with its declaration locally (`Site`'s ``declared_patients``).
        sample_rate: q, each patient's probability of joining a round (every site uses it).
        clip_norm: C, the bound on one patient's update (every site clips to it).
        noise: z, the noise multiplier (a number or a `NoiseSchedule`); with ``target_epsilon`` the base that the
            calibration scales (default 1.0).
        delta: δ of the ledger; default min(1e-5, 1/(10N)).
        server_lr: θ_{t+1} = θ_t + server_lr·Δ̃.
        seed: the noise generator's seed; ``None`` (default) draws one from the OS CSPRNG.
        target_epsilon: calibrate the noise so that ``rounds`` rounds end at this patient-level ε (RDP accountant).
        rounds: the planned number of rounds (needed with ``target_epsilon``).
        max_epsilon: a hard budget: `round` refuses the round whose charge would take ε above it
            (`allows_next_round` says so beforehand). Default: ``target_epsilon``, if given.
        noise_at: ``"server"`` (default: a trusted server adds N(0, z²C²) once) or ``"sites"``: each of the ``sites``
            sites adds its share N(0, z²C²/m) (`share_std`; `Site`'s ``noise_std``) and the server adds none; a round
            is charged z·√(m'/m) for the m' shares that arrived. Against the server this holds only if the sum is
            formed by secure aggregation; without it the server sees each site's sum with its share alone, and
            `report` gives that ε too (``epsilon_without_secure_aggregation``).
        sites: m, the number of sites (needed with ``noise_at="sites"``).
        noise_scales: accepted for P3SGD's spelling; more than one scale (the selection among noise scales) is
            refused with the reason, the selection's score would need the sites' patients.
        min_shares: with ``noise_at="sites"``, the fewest valid shares a round is released with (default m: all).
            A round with fewer is neither released nor charged, and is run again; the budget check assumes this
            many. It is the reconstruction threshold the secure aggregation must have: the server then never sees a
            sum with fewer shares.
        site_clip: hospital-level DP beside patient-level: each accepted site sum is clipped to this norm before the
            sum, and `hospital_epsilon` reports ε with a whole site as the unit (every site every round: no
            amplification). ``None`` (default): no site clip, no hospital-level ε (it would be unbounded).

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
        noise: float | NoiseSchedule = 1.0,
        delta: float | None = None,
        server_lr: float = 1.0,
        seed: int | None = None,
        target_epsilon: float | None = None,
        rounds: int | None = None,
        max_epsilon: float | None = None,
        site_clip: float | None = None,
        noise_at: Literal["server", "sites"] = "server",
        sites: int | None = None,
        min_shares: int | None = None,
        noise_scales: Sequence[float] | None = None,
    ) -> None:
        owner = "FederatedServer"
        if noise_scales is not None and len(noise_scales) > 1:
            raise PrivacyConfigError(
                f"`{owner}`: noise_scales={list(noise_scales)}: P3SGD's selection among noise scales scores the "
                "candidates on the round's sampled patients, which live at the sites; across sites that score would "
                "have to be a clipped per-patient sum each site adds inside the same joint charge, and this server "
                "has no such exchange. HINT: one scale (noise=…, or target_epsilon=…)."
            )
        self.num_patients = check_count(owner, "num_patients", num_patients, "the patients of all sites.", minimum=1)
        self.sample_rate = check_sample_rate(owner, sample_rate)
        self.clip_norm = check_finite_positive(owner, "clip_norm", clip_norm, "e.g. 1.0.")
        self.server_lr = check_finite_positive(owner, "server_lr", server_lr, "1.0 applies the update as is.")
        self.site_clip = (
            None if site_clip is None else check_finite_positive(owner, "site_clip", site_clip, "e.g. 10·C.")
        )
        self.rounds = None if rounds is None else check_count(owner, "rounds", rounds, "e.g. 50.", minimum=1)
        self.target_epsilon = (
            None
            if target_epsilon is None
            else check_finite_positive(owner, "target_epsilon", target_epsilon, "e.g. 4.")
        )
        if max_epsilon is None:
            max_epsilon = self.target_epsilon
        self.max_epsilon = None if max_epsilon is None else check_finite_positive(owner, "max_epsilon", max_epsilon, "")
        if noise_at not in ("server", "sites"):
            raise PrivacyConfigError(f"`{owner}`: noise_at must be 'server' or 'sites', found {noise_at!r}.")
        self.noise_at = noise_at
        self.min_shares = 0
        self.sites = (
            None if sites is None else check_count(owner, "sites", sites, "the hospitals in the run.", minimum=1)
        )
        if noise_at == "sites":
            if self.sites is None:
                raise PrivacyConfigError(
                    f"`{owner}`: noise_at='sites' needs the number of sites m (each adds a share z·C/√m). "
                    "HINT: pass sites=…"
                )
            self.min_shares = self.sites if min_shares is None else int(min_shares)
            if not 1 <= self.min_shares <= self.sites:
                raise PrivacyConfigError(
                    f"`{owner}`: min_shares must be in [1, sites={self.sites}], found {min_shares!r}. HINT: the "
                    "secure aggregation's reconstruction threshold, e.g. 2 of 3."
                )
            if self.site_clip is not None:
                raise PrivacyConfigError(
                    f"`{owner}`: site_clip clips a site's sum at the server, after its noise share was added; "
                    "hospital-level ε would not hold. HINT: use noise_at='server' for hospital-level ε."
                )
        self.state = ModelState(module)
        self.ledger = PrivacyLedger("patient", default_delta(self.num_patients) if delta is None else float(delta))
        schedule = ConstantNoise(float(noise)) if not isinstance(noise, NoiseSchedule) else noise
        if self.target_epsilon is not None and schedule.is_constant:
            schedule = ConstantNoise(1.0)  # the base is the calibration's start: `calibrated_multiplier` gives this z
        if self.target_epsilon is not None:
            if self.rounds is None:
                raise PrivacyConfigError(
                    f"`{owner}`: target_epsilon={self.target_epsilon:g} needs the planned number of rounds to "
                    "calibrate the noise. HINT: pass rounds=…, the number of rounds the consortium will run."
                )
            schedule = calibrate_schedule(
                schedule,
                self.rounds,
                self.ledger.delta,
                self.target_epsilon,
                "patient",
                AlwaysAccept(),
                "rdp",
                self._new_release,
            )
        self.release = self._new_release(self.ledger, seed=seed, schedule=schedule)
        if isinstance(self.release, SharedNoiseRelease):
            self.release.present = None  # before a round's replies: the worst case, min_shares shares
        self.private_step = PrivateStep(self.release)
        self.steps = 0
        # Noise at the sites: for every request whose replies the server received (released or not), the smallest
        # noise share a received reply declared (0 for none): what a server without secure aggregation learned.
        self.seen_shares: list[float] = []
        self._provisional = False  # the last entry of seen_shares is a request's, before its replies
        self.requests = 0  # requests sent to the sites (a round re-run is a new request, with fresh coins)
        self.stop_reason: str | None = None

    def _new_release(self, ledger: PrivacyLedger, seed: int | None, schedule: NoiseSchedule) -> Release:
        settings = {"clip_norm": self.clip_norm, "sample_rate": self.sample_rate, "schedule": schedule, "seed": seed}
        if self.noise_at == "sites":
            assert self.sites is not None
            release = SharedNoiseRelease(ledger, shares=self.sites, min_shares=self.min_shares, **settings)
            release.present = float(self.min_shares)  # calibrate for the worst run the budget allows
            return release
        return GaussianRelease(ledger, **settings)  # type: ignore[arg-type]

    def share_std(self, round_number: int) -> float:
        """With ``noise_at="sites"``: the std of each site's share in that round, z_t·C/√m (public)."""
        assert self.sites is not None
        return share_std(self.release.schedule.checked(round_number), self.clip_norm, self.sites)

    @property
    def normalizer(self) -> float:
        """q·N with N declared: the public expected number of patients per round (never the private count)."""
        return self.sample_rate * self.num_patients

    @property
    def reply_bound(self) -> float:
        """N·C, the most one site's reply may weigh (public): every site projects its clipped sum onto this ball."""
        return self.num_patients * self.clip_norm

    def theta(self) -> Tensor:
        """θ_t to send to the sites."""
        self.state.refresh()
        return self.state.vector()

    def allows_next_round(self) -> bool:
        """False (with ``stop_reason`` set) if the next round's charge would take ε above ``max_epsilon``."""
        if self.max_epsilon is None:
            return True
        trial = self.ledger.copy()
        trial.record(self.private_step.event(self.steps))
        eps_next = RDPAccountant().epsilon(trial)
        if eps_next <= self.max_epsilon:
            return True
        self.stop_reason = (
            f"FederatedServer: stopped before round {self.steps + 1}: it would raise ε [rdp, unit=patient, "
            f"δ={self.ledger.delta:.3g}] from {self.epsilon():.4f} to {eps_next:.4f}, above the budget "
            f"{self.max_epsilon:g}."
        )
        return False

    def new_request(self) -> int:
        """The serial number of the next request to the sites (it keys their coins: a re-run round samples afresh).

        With the noise at the sites, the request is entered in ``seen_shares`` at the planned share before any site
        answers it, so a checkpoint written as it goes out already counts it (a server that crashes after the replies
        arrive does not forget them); its replies replace the entry with the smallest share they declared.
        """
        self.requests += 1
        if self.noise_at == "sites":
            self.seen_shares.append(self.share_std(self.steps))
            self._provisional = True
        return self.requests - 1

    def _settle_seen(self, declared: Sequence[float] | None) -> None:
        """The request's entry in ``seen_shares``: the smallest declared share (0 for none), or none if none arrived."""
        if self._provisional:
            self.seen_shares.pop()
            self._provisional = False
        if declared:
            self.seen_shares.append(min(d if math.isfinite(d) and d > 0 else 0.0 for d in declared))

    def round(
        self,
        replies: Mapping[str, Tensor | None],
        shares: Mapping[str, float] | None = None,
        bounds: Mapping[str, float] | None = None,
    ) -> RoundOutcome:
        """One round: sums the valid replies, releases once (noise and charge in one call), applies θ_{t+1}.

        A refused reply (``reply_problem``) contributes nothing, as a site that did not reply; the round is charged as
        usual (a patient's influence can only shrink). With ``site_clip``, each accepted sum is clipped to it first.

        With ``noise_at="sites"``, ``shares`` gives the std of the noise share each site says it added (`Site`'s
        ``noise_std``): a reply without one, or with less than the planned share z_t·C/√m, is refused; the round is
        charged the noise of the shares that arrived.

        ``bounds`` (noise at the server): the most a site's sum may weigh, public (`run_rounds` gives every site
        `reply_bound`, N·C, which an honest site's projected sum never exceeds): a heavier reply is refused (a site
        that does not clip to C would void the patient-level bound). The refusal names the bound, not the reply's norm.

        Raises:
            PrivacyBudgetExceededError: the round would take ε above ``max_epsilon`` (nothing is released or charged).
        """
        if not self.allows_next_round():
            raise PrivacyBudgetExceededError(f"{self.stop_reason} HINT: ask allows_next_round() before a round.")
        state = self.state
        state.refresh()
        theta, other = state.vector(), state.snapshot_other_buffers()
        total = torch.zeros_like(theta)
        refused: dict[str, str] = {}
        present = 0.0
        for name, reply in replies.items():
            problem = reply_problem(reply, theta.numel())
            if problem is None and self.noise_at == "server" and bounds is not None and name in bounds:
                assert reply is not None
                if not float(reply.norm()) <= bounds[name] * (1 + 1e-4):
                    problem = f"its sum weighs more than the bound {bounds[name]:.6g}: the site does not clip to C"
            if problem is None and self.noise_at == "sites":
                problem, units = self._share_problem(None if shares is None else shares.get(name))
                present += 0.0 if problem is not None else units
            if problem is not None:
                refused[name] = problem
                continue
            assert reply is not None
            reply = reply.to(theta.device)
            if self.site_clip is not None:
                reply = reply * torch.clamp(self.site_clip / (reply.norm() + 1e-12), max=1.0)
            total += reply
        if self.noise_at == "sites":  # the server saw these sums, released or not, refused or not
            received = [name for name, reply in replies.items() if reply is not None]
            self._settle_seen([float((shares or {}).get(name, 0.0)) for name in received])
        return self._release(total, present, refused, theta, other)

    def secure_round(self, total: Tensor, shares: Sequence[float]) -> RoundOutcome:
        """One round from a sum formed by secure aggregation (`lightning_dp.federated.secure`).

        The server never saw a site's reply, only ``total``; ``shares`` are the noise stds the summed sites declared
        (``noise_at="sites"``). The sum has been revealed, so it is released and charged at the noise present,
        Σ σ_s², whatever that is: even below ``min_shares`` planned shares (the secure aggregation's threshold
        should prevent it) or with a share below the plan (the sites refuse to take part with one).

        Raises:
            PrivacyBudgetExceededError: the round would take ε above ``max_epsilon`` (asked before the protocol).
            PrivacyConfigError: the server's noise is not at the sites, or the sum is malformed.
            PrivacyStateError: a summed site declared no noise: the revealed sum is un-noised, no ε bounds it.
        """
        if self.noise_at != "sites":
            raise PrivacyConfigError(
                "`FederatedServer.secure_round`: secure aggregation carries the sites' noise shares. HINT: use "
                "noise_at='sites' (with noise at the server, the server must see the sum: use round())."
            )
        if not self.allows_next_round():
            raise PrivacyBudgetExceededError(f"{self.stop_reason} HINT: ask allows_next_round() before a round.")
        self.state.refresh()
        theta, other = self.state.vector(), self.state.snapshot_other_buffers()
        problem = reply_problem(total, theta.numel())
        if problem is not None:
            raise PrivacyConfigError(f"`FederatedServer.secure_round`: the aggregated sum is {problem}.")
        self._settle_seen(None)  # the server saw no site's sum, only this one
        declared = [float(share) for share in shares]
        if not declared or min(declared) <= 0 or not all(math.isfinite(d) for d in declared):
            raise PrivacyStateError(
                f"`FederatedServer.secure_round`: a summed site declared no noise share ({declared}): the revealed "
                "sum is not noised and no ε bounds it. HINT: every site needs noise_std = share_std(z, C, m)."
            )
        planned = self.share_std(self.steps)
        present = sum((d / planned) ** 2 for d in declared)
        return self._release(total.to(theta.device), present, {}, theta, other, revealed=True)

    def _release(
        self,
        total: Tensor,
        present: float,
        refused: dict[str, str],
        theta: Tensor,
        other: list[Tensor],
        revealed: bool = False,
    ) -> RoundOutcome:
        """Releases the round's sum once (noise, or the shares present, and the charge in one call); applies θ.

        ``revealed``: the server already holds the noised sum (secure aggregation): it is charged whatever is present.
        """
        state = self.state
        release = self.release
        if isinstance(release, SharedNoiseRelease):
            if not revealed and present < self.min_shares * (
                1 - 1e-9
            ):  # too few shares: θ stays, nothing is charged, run it again
                return RoundOutcome(None, refused)
            release.present = present
        target = ModelStateTarget(state, theta, other, self.server_lr)
        try:
            result = self.private_step(self.steps, total, self.normalizer, target)
        finally:
            if isinstance(release, SharedNoiseRelease):
                release.present = None
        self.steps += 1
        return RoundOutcome(result, refused)

    def _share_problem(self, declared: float | None) -> tuple[str | None, float]:
        """Why a site's declared share cannot be counted (None if it can), and its size in planned shares."""
        planned = self.share_std(self.steps)
        if declared is None:
            return "no declared noise share (noise_at='sites')", 0.0
        if not math.isfinite(declared) or declared < planned * (1 - 1e-9):
            return f"noise share std {declared:.6g} below the planned z·C/√m = {planned:.6g}", 0.0
        return None, (declared / planned) ** 2

    def epsilon(self) -> float:
        """ε of the run so far at the ledger's δ (RDP accountant), patient level."""
        return RDPAccountant().epsilon(self.ledger)

    def hospital_ledger(self, replace_one: bool = False) -> PrivacyLedger:
        """The same rounds seen with a whole site as the unit: each a Gaussian of multiplier z·C/C_site, unsampled.

        Derived from the patient ledger's events (the noise each round actually had), not charged separately: there is
        one charge point. The site sum is clipped to C_site, so removing all of one site's patients moves the noised
        sum by at most C_site (the normalizer q·N is declared, the same whichever data the site holds); every site is
        asked every round, so there is no amplification. ``replace_one``: one site's data replaced by any other, which
        moves the sum by up to 2·C_site (multiplier z·C/(2·C_site)).
        """
        if self.site_clip is None:
            raise PrivacyConfigError(
                "`FederatedServer`: hospital-level ε needs a bound on one site's reply. HINT: pass site_clip=… "
                "(the server clips each site's sum to it)."
            )
        ledger = PrivacyLedger("site", self.ledger.delta)
        for event, count in self.ledger.entries:
            ledger.record(self._as_site_event(event, 2.0 if replace_one else 1.0), count)
        return ledger

    def _as_site_event(self, event: PrivacyEvent, sensitivities: float = 1.0) -> PrivacyEvent:
        assert self.site_clip is not None
        if not isinstance(event, PoissonSampledEvent) or not isinstance(event.event, GaussianEvent):
            raise PrivacyConfigError(f"`FederatedServer`: no hospital-level reading of {event!r}.")
        return GaussianEvent(event.event.noise_multiplier * self.clip_norm / (sensitivities * self.site_clip))

    def epsilon_without_secure_aggregation(self) -> float:
        """ε against a server that sees each site's sum (noise at the sites, no secure aggregation).

        Each site's sum carries its share alone: a Gaussian of multiplier σ_s/C for that site's patients, sampled at
        q, for every request whose replies the server received (released or not, refused or not, each request a fresh
        Poisson sample), at the smallest share a received reply declared; ∞ if a reply declared none.
        """
        assert self.sites is not None
        ledger = PrivacyLedger("patient", self.ledger.delta)
        for share in self.seen_shares:
            if share <= 0:
                return math.inf  # a reply without a share: the server holds that site's un-noised sum
            ledger.record(PoissonSampledEvent(self.sample_rate, GaussianEvent(share / self.clip_norm)))
        return RDPAccountant().epsilon(ledger) if ledger.steps else 0.0

    def hospital_epsilon(self, replace_one: bool = False) -> float:
        """ε with a whole site as the unit (needs ``site_clip``); neither this nor the patient ε implies the other.

        ``replace_one``: one hospital's data replaced rather than removed (sensitivity 2·C_site).
        """
        return RDPAccountant().epsilon(self.hospital_ledger(replace_one))

    def _last_multiplier(self) -> float:
        """The multiplier the last round was charged (the planned one before any round)."""
        if not self.ledger.entries:
            return self.release.schedule.checked(0)
        event = self.ledger.entries[-1][0]
        assert isinstance(event, PoissonSampledEvent) and isinstance(event.event, GaussianEvent)
        return event.event.noise_multiplier

    def report(self) -> dict[str, Any]:
        """The run's privacy at a glance: patient-level ε (and hospital-level with ``site_clip``), the noise, q·N."""
        out: dict[str, Any] = {
            "unit": "patient",
            "epsilon": self.epsilon() if self.steps else 0.0,
            "delta": self.ledger.delta,
            "accountant": "rdp",
            "rounds": self.steps,
            "sample_rate": self.sample_rate,
            "num_patients": self.num_patients,
            "normalizer": self.normalizer,
            "clip_norm": self.clip_norm,
            "noise_multiplier": self._last_multiplier(),
            "noise_std": self._last_multiplier() * self.clip_norm,
            "target_epsilon": self.target_epsilon,
            "max_epsilon": self.max_epsilon,
            "stop_reason": self.stop_reason,
        }
        out["noise_at"] = self.noise_at
        if self.noise_at == "sites":
            out["epsilon_without_secure_aggregation"] = self.epsilon_without_secure_aggregation()
        if self.site_clip is not None:
            out["hospital_level"] = {
                "unit": "site",
                "site_clip": self.site_clip,
                "epsilon": self.hospital_epsilon() if self.steps else 0.0,
                "epsilon_replace_one": self.hospital_epsilon(replace_one=True) if self.steps else 0.0,
                "what": "a whole hospital as the unit, every site every round (no amplification). 'epsilon': all of "
                "one hospital's patients added or removed (its reply moves the sum by at most site_clip; the "
                "normalizer q·N is the consortium's declared N, the same in both worlds, and the hospital's "
                "membership is public); 'epsilon_replace_one': one hospital's data replaced by any other "
                "(sensitivity 2·site_clip)",
            }
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """θ, the ledger and the counters; not the noise generator.

        Whoever holds a checkpoint and the θ_t the sites received could regenerate every round's noise from the
        generator's state and recover the un-noised sums: a resumed server draws fresh noise from the OS CSPRNG.
        """
        return {
            "steps": self.steps,
            "requests": self.requests,
            "seen_shares": list(self.seen_shares),
            "theta": self.theta().clone(),
            "ledger": self.ledger.state_dict(),
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Continues a run where `state_dict` left it: the ledger exact, θ as saved, fresh noise.

        A state whose counter and ledger disagree, or whose ledger is for another unit or δ than this server's, is
        refused: the noise was calibrated for this server's settings.
        """
        missing = {"steps", "theta", "ledger"} - set(saved)
        if missing:
            raise PrivacyStateError(
                f"`FederatedServer`: the saved state lacks {sorted(missing)}: resuming would start a fresh ledger. "
                "HINT: load a state written by FederatedServer.state_dict()."
            )
        ledger = PrivacyLedger("patient", self.ledger.delta)
        ledger.load_state_dict(saved["ledger"])
        if ledger.unit != self.ledger.unit or ledger.delta != self.ledger.delta:
            raise PrivacyStateError(
                f"`FederatedServer`: the saved ledger is for unit={ledger.unit!r}, δ={ledger.delta:g}; this server's "
                f"is unit={self.ledger.unit!r}, δ={self.ledger.delta:g}. HINT: resume with the settings that wrote it."
            )
        if ledger.steps != saved["steps"]:
            raise PrivacyStateError(
                f"`FederatedServer`: the saved round counter ({saved['steps']}) disagrees with its ledger "
                f"({ledger.steps} rounds). HINT: load an unmodified state."
            )
        self.release.generator.manual_seed(secure_seed("noise"))
        self.ledger.load_state_dict(saved["ledger"])
        self.state.refresh()
        self.state.load(saved["theta"])
        self.steps = int(saved["steps"])
        self.requests = int(saved.get("requests", self.steps))
        self.seen_shares = [float(v) for v in saved.get("seen_shares", [])]
