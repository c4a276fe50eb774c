"""A one-run audit of federated P3SGD: m canary patients spread over the sites, secret coins, one run through Flower.

`FederatedOneRunAudit` is `lightning_dp.audit.one_run.OneRunAudit` with the federated round in place of the `P3SGD`
callback. The consortium runs as deployed: each hospital a `Site` behind the ``ClientApp`` of `site_app`, the server's
loop `run_rounds` sending θ_t and receiving the sites' replies as Flower ``Message`` s through `LocalGrid` (the same
``ClientApp`` and message path, in one process), `FederatedServer` summing, adding the noise (``noise_at="server"``)
or releasing the sum of the sites' noise shares (``noise_at="sites"``, optionally formed by SecAgg+), charging its
patient-level ledger and dividing by the public q·m (the m canaries declared as N, whatever the coins let in).

**The canaries** are `OneRunAudit`'s white-box gradient canaries: a two-class linear model over m inputs, canary i's
images the basis vector e_i with a heavy loss weight, so its clipped update is exactly C along its own direction u_i.
Canary i lives at site i mod S (public), and is in the training data of its site by an independent fair coin drawn
from a generator seeded from the OS CSPRNG unless ``coin_seed`` is given. Each site trains its included canaries
(its own Poisson coins at rate q, its own local SGD and per-patient clip) and replies; nothing else is there. The
score of canary i is the sum of the released updates along u_i in units of C, read from the server's θ_0 and θ_T
alone (`OneRunAudit.scores`: with constant noise the sum is sufficient along u_i), joined to the coin **by patient
id** (`join_by_id` fails closed on a missing, duplicated or extra id).

**The bounds** are `OneRunAudit`'s (SNJ, f-DP (ε, δ), GDP; the same code), against the ε the server's ledger prints
(RDP, patient level). At q = 1 the run is T Gaussian mechanisms per canary, μ = √T/z, as single-site P3SGD: a
federated round that adds the noise once (or shares that sum to it) must audit as the callback does, and a round that
adds less noise than it charges (e.g. shares of z/4 while the ledger charges z) reads μ_lower above the configured
μ. What it does not see: anything that leaves a site beside the reply (the observer tier, `ObserverAudit`, compares
every channel), and, with the noise at the sites, the sites' individual replies (the audit reads the sum the server
releases, as an observer of θ does; `FederatedAudit` reads each share white-box).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Literal

from torch import Tensor

from lightning_dp.audit.callback_audit import _weighted_loss
from lightning_dp.audit.one_run import OneRunAuditResult, _GradientCanaries
from lightning_dp.errors import (
    PrivacyConfigError,
    PrivacyStateError,
    PrivacyWarning,
    check_count,
    check_finite_positive,
)
from lightning_dp.sampling.randomness import unit_seed
from lightning_dp.sanitization import ModelState
from lightning_dp.training.patient_rounds import LocalSGD, PatientData, RoundParts

__all__ = ["FederatedOneRunAudit"]


class FederatedOneRunAudit(_GradientCanaries):
    """One federated P3SGD run through Flower with m canary patients over S sites; three ε lower bounds.

    Args:
        canaries: m, the number of canary patients (1,000 or more for a useful bound); canary i is at site i mod S.
        sites: S, the number of hospitals.
        images_per_patient: images of each canary patient (all of them in one local mini-batch).
        steps: T, the rounds of the run.
        noise_multiplier: z; or None with ``target_epsilon``.
        target_epsilon: calibrate z so that the server's printed ε (RDP, patient level) after T rounds is this.
        sample_rate: q of every site's coins and of the server's ledger (1.0, the default, is the tightest audit).
        clip_norm: C.
        delta: δ of the server's ledger and of every bound.
        significance: each bound holds with probability ≥ 1 − significance.
        coin_seed: seeds the canaries' coins; None (default) draws it from the OS CSPRNG.
        seed: the server's noise seed and, through it, the sites' secrets (coins, per-patient streams); None draws it
            from the OS CSPRNG. Noise shares (``noise_at="sites"``) are always drawn from the OS CSPRNG at every
            reply, as deployed.
        canary_weight: the canaries' loss weight (their local updates must be far above C).
        local_lr: the local SGD's rate.
        noise_at: ``"server"`` (default: the server adds N(0, z²C²) once) or ``"sites"`` (each site adds its share
            z·C/√S, `lightning_dp.federated.share_std`; the server charges the shares that arrived).
        secure_aggregation: with ``noise_at="sites"``, every round's sum by Flower's SecAgg+ (`SecureSum`).
        vectorize: each site's round (`Site`'s ``vectorize``): ``"auto"`` (default) runs it batched where that is
            exactly the loop; ``False`` the loop.

    Raises:
        PrivacyConfigError: an argument out of range, or SecAgg+ without the noise at the sites.
        PrivacyStateError: no canary came up "in", a round did not run with every site (a refusal, a dropout, the
            budget), or the scores are not exactly one per canary (`join_by_id`).

    Example:
        >>> audit = FederatedOneRunAudit(canaries=1000, sites=3, steps=2, target_epsilon=8.0, coin_seed=0, seed=0)
        >>> result = audit.run()  # doctest: +SKIP
        >>> result.passed, result.gdp_epsilon > 0.3 * result.epsilon_printed  # doctest: +SKIP
        (True, True)
    """

    owner = "FederatedOneRunAudit"

    def __init__(
        self,
        *,
        canaries: int = 1000,
        sites: int = 3,
        images_per_patient: int = 4,
        steps: int = 4,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        sample_rate: float = 1.0,
        clip_norm: float = 1.0,
        delta: float = 1e-5,
        significance: float = 0.05,
        coin_seed: int | None = None,
        seed: int | None = None,
        canary_weight: float = 100.0,
        local_lr: float = 0.1,
        noise_at: Literal["server", "sites"] = "server",
        secure_aggregation: bool = False,
        vectorize: Literal["auto", False] = "auto",
    ) -> None:
        super().__init__(
            canaries=canaries,
            images_per_patient=images_per_patient,
            steps=steps,
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            sample_rate=sample_rate,
            clip_norm=clip_norm,
            delta=delta,
            accountant="rdp",  # what `FederatedServer.epsilon` reports
            significance=significance,
            coin_seed=coin_seed,
            seed=seed,
            local_lr=local_lr,
        )
        owner = self.owner
        self.canary_weight = check_finite_positive(owner, "canary_weight", canary_weight, "e.g. 100.")
        self.sites = check_count(owner, "sites", sites, "e.g. 3 hospitals.", minimum=1)
        if noise_at not in ("server", "sites"):
            raise PrivacyConfigError(f"`{owner}(noise_at={noise_at!r})`: must be 'server' or 'sites'.")
        self.noise_at: Literal["server", "sites"] = noise_at
        if secure_aggregation and noise_at != "sites":
            raise PrivacyConfigError(
                f"`{owner}(secure_aggregation=True)`: SecAgg+ carries the sites' noise shares. HINT: noise_at='sites'."
            )
        self.secure_aggregation = bool(secure_aggregation)
        if vectorize not in ("auto", False):
            raise PrivacyConfigError(f"`{owner}(vectorize={vectorize!r})`: must be 'auto' or False.")
        self.vectorize: Literal["auto", False] = vectorize

    # ------------------------------------------------------------------ the consortium
    def site_names(self) -> list[str]:
        """The hospitals' public names."""
        return [f"hospital-{k}" for k in range(self.sites)]

    def placement(self) -> dict[str, list[str]]:
        """Site name → the ids of the canaries it would hold (canary i at site i mod S; public)."""
        names = self.site_names()
        out: dict[str, list[str]] = {name: [] for name in names}
        for i, pid in enumerate(self.canary_ids()):
            out[names[i % self.sites]].append(pid)
        return out

    @property
    def mechanism(self) -> str:
        """The audited mechanism, in words."""
        where = "noise at the server" if self.noise_at == "server" else "noise shares at the sites"
        where += ", summed by SecAgg+" if self.secure_aggregation else ""
        return f"federated P3SGD through Flower ({self.sites} sites, {where})"

    def _site(self, name: str, included: list[str]) -> Any:
        """The hospital ``name`` holding the ``included`` canary patients (those of its canaries whose coin is in)."""
        from lightning_dp.federated import Site, share_std

        data = self.canary_data(included)
        net = self.model()

        def step(batch: Any, batch_idx: int) -> Tensor:
            return _weighted_loss(net(batch[0]), batch[1], batch[2])

        groups = [data.patient_to_indices[pid] for pid in included]
        parts = RoundParts(
            net,
            ModelState(net),
            step,
            PatientData(data, groups, list(included)),
            LocalSGD(lr=self.local_lr, batch_size=self.images_per_patient),
            self.clip_norm,
        )
        noise_std = share_std(self.noise_multiplier, self.clip_norm, self.sites) if self.noise_at == "sites" else 0.0
        return Site(
            name,
            parts,
            sample_rate=self.sample_rate,
            seed=unit_seed(self.seed, "federated-one-run-site", name),
            vectorize=self.vectorize,
            noise_std=noise_std,
        )

    def server(self) -> Any:
        """The `FederatedServer` as configured: the public m declared as N, z, q, C, δ; noise seeded by ``seed``."""
        from lightning_dp.federated import FederatedServer

        return FederatedServer(
            self.model(),
            num_patients=self.canaries,
            sample_rate=self.sample_rate,
            clip_norm=self.clip_norm,
            noise=self.noise_multiplier,
            delta=self.delta,
            server_lr=1.0,
            seed=self.seed,
            noise_at=self.noise_at,
            sites=self.sites if self.noise_at == "sites" else None,
        )

    # ------------------------------------------------------------------ the run
    def run(self) -> OneRunAuditResult:
        """Draws the coins, runs the consortium once through Flower, scores every canary by id, joins, bounds."""
        from lightning_dp.federated.flower import LocalGrid, run_rounds, site_app

        start = time.perf_counter()
        membership = self.coins()
        coin = dict(membership)
        self._included(membership)
        holds = {name: [pid for pid in ids if coin[pid]] for name, ids in self.placement().items()}
        built: dict[str, Any] = {}

        def make_site(context: Any) -> Any:
            name = str(context.node_config["site"])
            built[name] = self._site(name, holds[name])
            return built[name]

        server = self.server()
        theta_0 = server.theta().clone()
        grid = LocalGrid(site_app(make_site), [{"site": name} for name in self.site_names()])
        secure = None
        if self.secure_aggregation:
            from lightning_dp.federated.secure import SecureSum

            secure = SecureSum()
        with warnings.catch_warnings():
            # the declared N (m) differs from the patients the coins let in, by design: the note is for data holders
            warnings.filterwarnings("ignore", category=PrivacyWarning)
            logs = run_rounds(grid, server, self.steps, sites=self.sites, secure=secure, max_empty_rounds=1)
        incomplete = [(log.round, log.sites_replied, log.refused) for log in logs if log.refused]
        incomplete += [(log.round, log.sites_replied, {}) for log in logs if log.sites_replied != self.sites]
        if len(logs) != self.steps or incomplete:
            raise PrivacyStateError(
                f"`{self.owner}`: the consortium released {len(logs)} of {self.steps} rounds; rounds without every "
                f"site: {incomplete[:3]}. HINT: the audited run must have every site in every round (no budget stop, "
                "no dropout or refusal)."
            )
        paths = sorted({site.round.path for site in built.values()})
        return self._result(
            membership,
            self.scores(theta_0, server.theta()),
            epsilon_printed=server.epsilon(),
            accountant="rdp",
            started=start,
            round_path="/".join(paths),
            mechanism=self.mechanism,
            scoring="gradient",
            sites=self.sites,
        )
