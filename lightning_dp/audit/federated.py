"""White-box audit of the federated round: a canary patient at one site, the run through Flower, every θ observed.

`FederatedAudit` runs federated P3SGD (`lightning_dp.federated`) as it is deployed: each hospital a `Site` behind the
``ClientApp`` of `site_app`, the server's loop `run_rounds` sending θ_t and receiving the clipped sums as Flower
``Message`` s, through `LocalGrid` (the same ``ClientApp`` and message path, in one process). It runs two worlds in
lockstep: with a *canary* patient at one site (images far larger than the others', adversarial labels, a heavy loss
weight: its local update is far above C) and without it, with the same site seeds (the same coins for every other
patient: the canary is appended last at its site, so it draws its coin after theirs) and the same server noise seed.
Before every round the "out" server is set to the "in" server's θ_t (the neighbouring data set, evaluated at the
same released model), so both rounds start from one θ_t and draw the same noise.

The auditor observes every θ_t at the server and every message the server received (the sites' clipped sums S_w).
Each world's release, brought back to the public normalizer, D_w = (θ_{t+1} − θ_t)·q·N / server_lr (N declared: the
same in both worlds), is S_w + Z with the *same* Z in both worlds. Three checks, each stated per round:

* **sensitivity**: the canary moves the release by at most C: ``moved`` = ‖D_in − D_out‖ / C ≤ 1 + tolerance (that
  is, the two worlds' θ changes, each at its public normalizer, differ by at most server_lr·C/(q·N)); and by what
  its site sent alone: ``excess`` = ‖(D_in − D_out) − (S_in − S_out)‖ / C ≤ tolerance (a server that treats the
  worlds differently, e.g. divides by the private count of included patients, shows here). The tolerance (0.02·C,
  `lightning_dp.audit.sensitivity.TOLERANCE`) is for fp32 round-off; its bound is computed and must be below half.
* **noise**: the release less the sum the server received, (D_in − S_in) / C, is the noise alone on every
  coordinate: N(0, z²) with z the multiplier the ledger charges (`noise_equals_ledger`: two-sided χ² pooled, per
  round, per tensor, per coordinate) and fresh at every lag (`fresh_noise`); the noise std each round reports is
  z·C/(q·N) exactly (relative 1e-9).
* **rate**: the canary's inclusion, read from the released θ (a round it joins moves the release by C, one it
  misses by 0), is Binomial(T, q) with q the ledger's sample rate (two-sided exact binomial test), and so is the sum
  of the sites' coins over all patients and rounds (`Site.patients_of_round`, what each site's reply uses).

Each statistical check fails correct code with probability at most ``significance`` (default 1e-3, the noise checks'
`NOISE_CHECK_SIGNIFICANCE`; the two rate tests at half of it each). What it does not see: a leak that the canary's
clipped update does not show (the coupling scenarios of `SensitivityAudit` cover those for the engines both paths
share), distributed noise and secure aggregation (not implemented), and the ε of the ledger itself (the accountant is
audited by `CallbackAudit`). A passing audit is evidence from one canary, not a proof.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from scipy import stats
from torch import Tensor, nn

from lightning_dp.accounting import PoissonSampledEvent
from lightning_dp.audit.callback_audit import NOISE_CHECK_SIGNIFICANCE, _Units, _weighted_loss
from lightning_dp.audit.noise import NoiseCheck, fresh_noise, ledger_multipliers, noise_equals_ledger
from lightning_dp.audit.sensitivity import TOLERANCE
from lightning_dp.errors import PrivacyConfigError, check_count, check_finite_positive, check_sample_rate
from lightning_dp.federated import FederatedServer, Site
from lightning_dp.sanitization import ModelState
from lightning_dp.training.patient_rounds import LocalSGD, PatientData, RoundParts
from lightning_dp.training.threads import ThreadGovernor

__all__ = ["FederatedAudit", "FederatedAuditResult"]

#: How far the canary must move the release in a round it joins, in units of C, to count as included (it moves it by
#: exactly 1 when its clip is active, by 0 when it is not sampled).
INCLUDED = 0.5
#: The noise std a round reports must equal z·C/(q·N) to this relative precision.
REPORTED_RTOL = 1e-9


@dataclass
class FederatedAuditResult:
    """What a `FederatedAudit` measured, per round t, in units of C.

    ``moved[t]`` = ‖D_in − D_out‖ (1 in a round the canary joins, 0 otherwise; at most 1 + tolerance), ``excess[t]``
    = ‖(D_in − D_out) − (S_in − S_out)‖ (0 up to round-off), ``site_moved[t]`` = ‖S_in − S_out‖ (what the canary's
    site sent differently), ``included[t]`` whether the canary joined round t (read from θ). ``noise_ratio`` is the
    measured noise sd over the ledger's multiplier, pooled (1 for correct code), ``canary_rate`` and
    ``population_rate`` the measured inclusion rates against the ledger's ``sample_rate``. ``checks`` holds the
    verdicts: "sensitivity", "noise std", "fresh noise", "rate".
    """

    rounds: int
    sites: list[str]
    canary_site: str
    sample_rate: float
    clip_norm: float
    noise_multiplier: float
    normalizer: float
    moved: list[float]
    excess: list[float]
    site_moved: list[float]
    included: list[bool]
    noise_ratio: float
    canary_rate: float
    population_rate: float
    population_coins: int
    reported_noise_std: list[float]
    epsilon: float
    delta: float
    tolerance: float
    significance: float
    checks: tuple[NoiseCheck, ...]
    residual: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0), repr=False)

    def check(self, name: str) -> NoiseCheck:
        """The check called ``name``."""
        return next(c for c in self.checks if c.name == name)

    @property
    def failed(self) -> list[str]:
        """The checks the run failed."""
        return [c.name for c in self.checks if not c.passed]

    @property
    def passed(self) -> bool:
        """Every check passed."""
        return not self.failed

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("residual", "checks")}
        out["checks"] = {c.name: [c.passed, c.statistic, c.limit, c.worst] for c in self.checks}
        out.update(passed=self.passed, failed=self.failed, kind="white-box audit of the federated round (Flower)")
        return out

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        verdict += "".join(check.failure(".4g") for check in self.checks)
        return (
            f"federated P3SGD over {len(self.sites)} sites, canary at {self.canary_site!r}, {self.rounds} rounds "
            f"through Flower: {verdict}. The canary moved the release by {max(self.moved):.4f}·C at most (bound 1), "
            f"{max(self.excess):.3g}·C beyond what its site sent (tolerance {self.tolerance:g}); noise sd "
            f"{self.noise_ratio:.3f}× the ledger's z = {self.noise_multiplier:g}; inclusion rate: canary "
            f"{self.canary_rate:.3f} ({sum(self.included)}/{self.rounds}), all patients {self.population_rate:.3f} "
            f"({self.population_coins} coins), ledger q = {self.sample_rate:g}."
        )


def _observed_grid(client_app: Any, node_configs: list[dict[str, Any]]) -> Any:
    """A `LocalGrid` that keeps the clipped sums the server received (what a white-box auditor at the server sees)."""
    from lightning_dp.federated.flower import LocalGrid

    class _ObservedGrid(LocalGrid):
        def __init__(self) -> None:
            super().__init__(client_app, node_configs)
            self.received: list[Tensor] = []

        def pull_messages(self, message_ids: Any) -> Any:
            replies = list(super().pull_messages(message_ids))
            for reply in replies:
                content: Any = reply.content
                if not reply.has_error() and "clipped_sum" in content:
                    self.received.append(torch.from_numpy(content["clipped_sum"]["clipped_sum"].numpy().copy()))
            return replies

    return _ObservedGrid()


class FederatedAudit:
    """Audits federated P3SGD through Flower with a canary patient at one site (see the module docstring).

    Args:
        model: builds the model (an ``nn.Module`` from images to logits; called under the same torch seed for the
            server and every site, so they start equal). Trained by weighted cross-entropy.
        sites: each hospital's name → ``(x, y, patients)``, its images, labels and patient ids.
        canary: ``(x, y)``, the canary patient's images and labels (appended last at ``canary_site``).
        canary_site: the hospital that holds the canary.
        sample_rate: q of every site and of the server's ledger.
        clip_norm: C.
        noise_multiplier: z.
        rounds: T, the rounds observed in each world.
        server_lr: θ_{t+1} = θ_t + server_lr·Δ̃.
        local: each patient's local SGD (a full-batch step by default).
        canary_weight: the canary's loss weight (its update must be far above C).
        significance: the false-alarm probability of each statistical check.
        tolerance: the fp32 round-off allowed in the sensitivity check, in units of C.
        seed: the sites' and the server's seeds (public; the same in both worlds).

    Raises:
        PrivacyConfigError: an unknown canary site, tensors that do not match, or a round that did not run with every
            site (a budget, a dropout, a refused reply).

    Example:
        >>> from lightning_dp.audit.scenarios import federated_scenario
        >>> result = federated_scenario(rounds=4).run()  # three hospitals through Flower's messages, in-process
        >>> result.passed, round(max(result.moved), 3), result.failed
        (True, 1.0, [])
    """

    def __init__(
        self,
        *,
        model: Callable[[], nn.Module],
        sites: Mapping[str, Sequence[Tensor]],
        canary: Sequence[Tensor],
        canary_site: str,
        sample_rate: float,
        clip_norm: float,
        noise_multiplier: float,
        rounds: int = 20,
        server_lr: float = 1.0,
        local: LocalSGD | None = None,
        canary_weight: float = 50.0,
        significance: float = NOISE_CHECK_SIGNIFICANCE,
        tolerance: float = TOLERANCE,
        seed: int = 0,
    ) -> None:
        owner = "FederatedAudit"
        if canary_site not in sites:
            raise PrivacyConfigError(
                f"`{owner}(canary_site={canary_site!r})`: no such site; the sites are {sorted(sites)}. "
                "HINT: name one of the hospitals."
            )
        for name, parts in sites.items():
            if len(parts) != 3 or not len(parts[0]) == len(parts[1]) == len(parts[2]):
                raise PrivacyConfigError(
                    f"`{owner}`: site {name!r} needs (x, y, patients) of one length each. HINT: one patient id per "
                    "image."
                )
        if len(canary) != 2 or len(canary[0]) != len(canary[1]) or len(canary[1]) == 0:
            raise PrivacyConfigError(f"`{owner}`: the canary needs (x, y) of one length > 0. HINT: its images, labels.")
        if not (0.0 < significance < 1.0):
            raise PrivacyConfigError(f"`{owner}(significance={significance})`: must be in (0, 1), e.g. 1e-3.")
        if not (math.isfinite(tolerance) and tolerance >= 0):
            raise PrivacyConfigError(f"`{owner}(tolerance={tolerance})`: must be a finite number >= 0, e.g. 0.02.")
        self.model = model
        self.sites = {name: tuple(parts) for name, parts in sites.items()}
        self.canary = tuple(canary)
        self.canary_site = canary_site
        self.sample_rate = check_sample_rate(owner, sample_rate)
        self.clip_norm = check_finite_positive(owner, "clip_norm", clip_norm, "e.g. 0.5.")
        self.noise_multiplier = check_finite_positive(owner, "noise_multiplier", noise_multiplier, "e.g. 1.0.")
        self.rounds = check_count(owner, "rounds", rounds, "e.g. 20.", minimum=2)
        self.server_lr = check_finite_positive(owner, "server_lr", server_lr, "e.g. 1.0.")
        self.local = local if local is not None else LocalSGD(lr=0.2, batch_size=max(self._largest_patient(), 1))
        self.canary_weight = check_finite_positive(owner, "canary_weight", canary_weight, "e.g. 50.")
        self.significance = float(significance)
        self.tolerance = float(tolerance)
        self.seed = int(seed)
        self.built: dict[tuple[str, str], Site] = {}

    def _largest_patient(self) -> int:
        counts = [int(torch.unique(p, return_counts=True)[1].max()) for _, _, p in self.sites.values()]
        return max(counts + [len(self.canary[1])])

    # ------------------------------------------------------------------ the two worlds
    def _site(self, world: str, name: str) -> Site:
        """A hospital of ``world`` ("in": with the canary at its site, appended last; "out": without)."""
        x, y, patients = self.sites[name]
        w = torch.ones(len(y))
        ids = sorted(set(patients.tolist()))
        groups = [torch.nonzero(patients == p).flatten().tolist() for p in ids]
        keys: list[Any] = [f"{name}-{p}" for p in ids]
        if world == "in" and name == self.canary_site:
            cx, cy = self.canary
            groups.append(list(range(len(y), len(y) + len(cy))))
            keys.append(f"{name}-canary")
            x, y = torch.cat([x, cx]), torch.cat([y, cy])
            w = torch.cat([w, torch.full((len(cy),), self.canary_weight)])
        torch.manual_seed(self.seed)
        net = self.model()

        def step(batch: Any, batch_idx: int) -> Tensor:
            return _weighted_loss(net(batch[0]), batch[1], batch[2])

        parts = RoundParts(
            net, ModelState(net), step, PatientData(_Units(x, y, w, None), groups, keys), self.local, self.clip_norm
        )
        index = sorted(self.sites).index(name)
        site = Site(name, parts, sample_rate=self.sample_rate, seed=self.seed * 1000 + index + 1)
        self.built[(world, name)] = site
        return site

    def _server(self, world: str) -> FederatedServer:
        # N is declared by the consortium before the data are counted: the same in both worlds (the canary's
        # included), so the two releases have one normalizer and the only difference is the canary's sum.
        patients = sum(len(set(p.tolist())) for _, _, p in self.sites.values()) + 1
        torch.manual_seed(self.seed)
        return FederatedServer(
            self.model(),
            num_patients=patients,
            sample_rate=self.sample_rate,
            clip_norm=self.clip_norm,
            noise=self.noise_multiplier,
            server_lr=self.server_lr,
            seed=self.seed,
        )

    def _grid(self, world: str) -> Any:
        from lightning_dp.federated.flower import site_app

        app = site_app(lambda context: self._site(str(context.node_config["world"]), str(context.node_config["site"])))
        return _observed_grid(app, [{"site": name, "world": world} for name in sorted(self.sites)])

    # ------------------------------------------------------------------ the audit
    def run(self) -> FederatedAuditResult:
        """Both worlds in lockstep through Flower, every θ_t and message observed, then the four checks."""
        from lightning_dp.federated.flower import run_rounds

        self.built.clear()
        governor = ThreadGovernor()  # many tiny kernels: on the cores other processes leave free (a shared machine)
        try:
            return self._run(governor, run_rounds)
        finally:
            governor.restore()

    def _run(self, governor: ThreadGovernor, run_rounds: Callable[..., Any]) -> FederatedAuditResult:
        from lightning_dp.federated.flower import RoundLog

        servers = {w: self._server(w) for w in ("in", "out")}
        grids = {w: self._grid(w) for w in ("in", "out")}
        normalizers = {w: s.normalizer for w, s in servers.items()}  # the public q·N (declared: equal in both worlds)
        clip = self.clip_norm
        moved, excess, site_moved, residuals, reported = [], [], [], [], []
        round_off = 0.0
        for t in range(self.rounds):
            governor.adjust()
            theta = servers["in"].theta().clone()
            servers["out"].state.refresh()
            servers["out"].state.load(theta)  # the neighbouring data set at the same released θ_t
            release, received = {}, {}
            for world in ("in", "out"):
                logs: list[RoundLog] = []
                grids[world].received.clear()
                run_rounds(grids[world], servers[world], t + 1, sites=len(self.sites), on_round=logs.append)
                if len(logs) != 1 or logs[0].refused:
                    raise PrivacyConfigError(
                        f"`FederatedAudit`: round {t} of the {world!r} world did not run with every site "
                        f"({[log.refused for log in logs]}). HINT: no budget, dropouts or refusals in the audited run."
                    )
                after = servers[world].theta()
                scale = normalizers[world] / self.server_lr
                release[world] = (after.double() - theta.double()) * scale
                received[world] = torch.stack(grids[world].received).double().sum(0)
                round_off += 2.0**-24 * float(after.norm()) * scale / clip
                if world == "in":
                    reported.append(float(logs[0].noise_std))
            difference = release["in"] - release["out"]
            sent = received["in"] - received["out"]
            moved.append(float(difference.norm()) / clip)
            excess.append(float((difference - sent).norm()) / clip)
            site_moved.append(float(sent.norm()) / clip)
            residuals.append(((release["in"] - received["in"]) / clip).numpy())
        round_off /= self.rounds
        if round_off > self.tolerance / 2:
            raise PrivacyConfigError(
                f"`FederatedAudit`: the fp32 round-off of the releases, rescaled by q·N/server_lr, can reach "
                f"{round_off:.3g}·C, more than half the tolerance {self.tolerance:g}. HINT: a larger server_lr or clip "
                "norm, or fewer patients."
            )
        server = servers["in"]
        residual = np.stack(residuals)
        ledger_z = ledger_multipliers(server.ledger)
        tensors = [(name, p.numel()) for name, p in server.state.module.named_parameters() if p.requires_grad]
        included = [m > INCLUDED for m in moved]
        coins = sum(  # white-box: the coins each site's reply drew (its own `patients_of_round`)
            len(site.patients_of_round(t))
            for (world, _), site in self.built.items()
            if world == "in"
            for t in range(self.rounds)
        )
        checks = (
            self._sensitivity(moved, excess),
            self._noise(residual, ledger_z, tensors, reported, normalizers["in"]),
            fresh_noise(residual, residual[:0], self.significance),
            self._rate(included, coins, server),
        )
        total = self.rounds * server.num_patients
        return FederatedAuditResult(
            rounds=self.rounds,
            sites=sorted(self.sites),
            canary_site=self.canary_site,
            sample_rate=self._ledger_rate(server),
            clip_norm=clip,
            noise_multiplier=self.noise_multiplier,
            normalizer=normalizers["in"],
            moved=moved,
            excess=excess,
            site_moved=site_moved,
            included=included,
            noise_ratio=float(np.sqrt(((residual / ledger_z[:, None]) ** 2).mean()))
            if len(ledger_z) == self.rounds
            else math.nan,
            canary_rate=sum(included) / self.rounds,
            population_rate=coins / total,
            population_coins=total,
            reported_noise_std=reported,
            epsilon=server.epsilon(),
            delta=server.ledger.delta,
            tolerance=self.tolerance,
            significance=self.significance,
            checks=checks,
            residual=residual,
        )

    # ------------------------------------------------------------------ the checks
    def _sensitivity(self, moved: list[float], excess: list[float]) -> NoiseCheck:
        """moved ≤ 1 + tolerance and excess ≤ tolerance in every round; the statistic is the worse, relative."""
        t_moved, t_excess = int(np.argmax(moved)), int(np.argmax(excess))
        over_moved = moved[t_moved] / (1.0 + self.tolerance)
        over_excess = excess[t_excess] / self.tolerance if self.tolerance > 0 else math.inf * excess[t_excess]
        if over_moved >= over_excess:
            statistic, limit, where = moved[t_moved], 1.0 + self.tolerance, f"round {t_moved}: moved (·C)"
        else:
            statistic, limit, where = excess[t_excess], self.tolerance, f"round {t_excess}: beyond its site's sum (·C)"
        passed = max(moved) <= 1.0 + self.tolerance and max(excess) <= self.tolerance
        return NoiseCheck("sensitivity", passed, statistic, limit, where, 0.0, 2 * len(moved))

    def _noise(
        self,
        residual: NDArray[np.float64],
        ledger_z: NDArray[np.float64],
        tensors: list[tuple[str, int]],
        reported: list[float],
        normalizer: float,
    ) -> NoiseCheck:
        """The residual noise is N(0, z_t²) per coordinate; each round reports z_t·C/(q·N) as its noise std."""
        check = noise_equals_ledger(residual, ledger_z, tensors, self.significance)
        if not check.passed or len(ledger_z) != len(reported):
            return check
        expected = ledger_z * self.clip_norm / normalizer
        off = np.abs(np.asarray(reported) / expected - 1.0)
        t = int(np.argmax(off))
        if off[t] > REPORTED_RTOL:
            where = f"round {t}: reported noise std {reported[t]:.6g}, the ledger's z·C/(q·N) {expected[t]:.6g}"
            return NoiseCheck(check.name, False, reported[t] / expected[t], 1.0, where, check.significance, check.tests)
        return check

    def _ledger_rate(self, server: FederatedServer) -> float:
        rates = {e.sample_rate if isinstance(e, PoissonSampledEvent) else math.nan for e, _ in server.ledger.entries}
        return rates.pop() if len(rates) == 1 else math.nan

    def _rate(self, included: list[bool], coins: int, server: FederatedServer) -> NoiseCheck:
        """Canary inclusion (from θ) and all the sites' coins ~ Binomial(·, q_ledger): two-sided, each at α/2."""
        q = self._ledger_rate(server)
        if not math.isfinite(q):
            return NoiseCheck("rate", False, 0.0, 1.0, "the ledger charges no single Poisson rate", 0.0, 0)
        tests = [
            (
                stats.binomtest(sum(included), self.rounds, q).pvalue,
                f"the canary's inclusion ({sum(included)} of "
                f"{self.rounds} rounds, read from θ) against the ledger's q = {q:g}",
            ),
            (
                stats.binomtest(coins, self.rounds * server.num_patients, q).pvalue,
                f"the sites' coins ({coins} of {self.rounds * server.num_patients}) against the ledger's q = {q:g}",
            ),
        ]
        p, where = min(tests)
        alpha = self.significance / 2
        return NoiseCheck("rate", bool(p >= alpha), float(p), alpha, where, self.significance, 2)
