"""White-box audit of the federated round: a canary patient at one site, the run through Flower, every θ observed.

`FederatedAudit` runs federated P3SGD (`lightning_dp.federated`) as it is deployed: each hospital a `Site` behind the
``ClientApp`` of `site_app`, the server's loop `run_rounds` sending θ_t and receiving the sites' replies as Flower
``Message`` s, through `LocalGrid` (the same ``ClientApp`` and message path, in one process). It runs two worlds in
lockstep: with a *canary* patient at one site (images far larger than the others', adversarial labels, a heavy loss
weight: its local update is far above C) and without it, with the same site seeds (the same coins for every other
patient: the canary is appended last at its site, so it draws its coin after theirs). Before every round the "out"
server is set to the "in" server's θ_t (the neighbouring data set, evaluated at the same released model).

Where the noise is added (``noise_at``), and what is held equal between the worlds:

* ``"server"``: the server adds N(0, z²C²) once, from its seed, the same in both worlds, so both draw the same noise
  Z and the canary's effect is read without noise.
* ``"sites"``: each of the m sites adds its share N(0, z²C²/m) (`Site.noise_share`) and the server adds none; with
  ``secure_aggregation=True`` the sum is formed by Flower's SecAgg+ (`lightning_dp.federated.secure.SecureSum`) and
  the server receives nothing but the sum. **The shares are not held equal between the worlds**: each site draws
  them as it does in deployment (from the OS CSPRNG, at every reply), and the audit subtracts the shares it measured
  instead. What is held equal is only what the neighbouring relation and the lockstep need: the sites' secret seeds
  (the coins and the patients' random streams), θ_t, the data of every other patient, and the public settings.
  Holding the shares equal (seeding them from the audit's seed) would make the worlds' shares identical by
  construction and would hide the one bug that only a second run shows, a share drawn from a public seed (the round
  number, the site's name): two runs of the same public configuration must draw different shares, and the two
  worlds are two such runs.

The auditor observes every θ_t at the server and every reply the server received (in plain rounds the messages, R_k;
through SecAgg+ the server receives only their sum, and the auditor reads each site's reply where it is made). It
builds the sites itself and reads, white-box, each site's clipped sum S_k before any share (`Site.clipped_sum`), so a
site's share is R_k − S_k. Each world's release, brought back to the public normalizer, D_w = (θ_{t+1} − θ_t)·q·N /
server_lr (N declared: the same in both worlds), is S_w + (its noise), S_w = Σ_k S_k over the sites whose reply the
server summed. The checks, each stated per round:

* **sensitivity**: the canary moves the release, less its noise, by at most C: ``moved`` = ‖(D_in − N_in) − (D_out −
  N_out)‖ / C ≤ 1 + tolerance, with N_w = R_w − S_w the sum of the world's measured shares (0 with the noise at the
  server, where the two worlds' Z is one); and by what its site sent alone: ``excess`` = ‖(D_in − D_out) − (R_in −
  R_out)‖ / C ≤ tolerance (a server that treats the worlds differently, e.g. divides by the private count of
  included patients, shows here). The tolerance (0.02·C, `lightning_dp.audit.sensitivity.TOLERANCE`) is for fp32
  round-off (and SecAgg+'s quantization, ~1e-5·C); its bound is computed and must be below half.
* **noise std**: the release less the clipped sums, (D_w − S_w) / C, is the noise alone on every coordinate: N(0,
  z_t²) with z_t the multiplier the ledger charged for that round (`noise_equals_ledger`: two-sided χ² pooled, per
  round, per tensor, per coordinate), and each round reports z_t·C/(q·N) as its noise std (relative 1e-9). With the
  noise at the sites z_t is what the server charged for the shares that arrived (z·√(m'/m), m' of m), both worlds
  are tested (their noise is independent), and shares of the right size that cancel, or that add up to less than
  what was charged, fail here.
* **share std** (noise at the sites): each site's share, R_k − S_k, is N(0, σ_k²) per coordinate with σ_k the std
  the site declared in its reply (what the server charges from, and what ε without secure aggregation assumes):
  `noise_equals_ledger` per site, at ``significance``/m each.
* **fresh noise** (`fresh_noise`): no two noise vectors correlate beyond chance: with the noise at the server, the
  rounds' noise at every lag; at the sites, every pair of shares (m sites × T rounds × 2 worlds): a share reused
  in a later round, a share that another site's cancels, or a share a second run draws again (a public seed) has
  |correlation| 1.
* **rate**: the canary's inclusion, read from the released θ less its noise (a round it joins moves it by C, one it
  misses by 0), is Binomial(T, q) with q the ledger's sample rate (two-sided exact binomial test), and so is the sum
  of the sites' coins over all patients and rounds (`Site.patients_of_round`, what each site's reply uses).

``drop`` makes named sites miss named rounds (a public schedule, the same in both worlds): the server then sums the
others, and, with the noise at the sites, charges z·√(m'/m) for the m' shares that arrived (``min_shares`` is set
to the fewest the schedule leaves); the noise check holds the release to that charge.

Each statistical check fails correct code with probability at most ``significance`` (default 1e-3, the noise checks'
`NOISE_CHECK_SIGNIFICANCE`; the two rate tests at half of it each). What it does not see: a leak that the canary's
clipped update does not show (the coupling scenarios of `SensitivityAudit` cover those for the engines both paths
share); with the noise at the server, a server noise seed that is public (the audit sets the seed, the same in both
worlds; `FederatedServer` draws it from the OS CSPRNG by default); SecAgg+'s own cryptography (the audit reads the
replies where the sites make them, and checks that the unmasked sum is theirs, not that the masks hide them); shares
that are dependent in a way no pair of them shows (e.g. three sites whose shares sum to zero fail the noise check,
not the pairwise one); and the ε of the ledger itself (the accountant is audited by `CallbackAudit`). A passing
audit is evidence from one canary, not a proof.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

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
from lightning_dp.federated import FederatedServer, Site, share_std
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
    verdicts: "sensitivity", "noise std", "fresh noise", "rate", and with the noise at the sites "share std".

    With the noise at the sites (``noise_at="sites"``): ``shares_summed[t]`` is how many sites' shares the server
    summed in round t ("in" world), ``noise_ratio`` is pooled over both worlds, ``share_ratio`` is the measured sd
    of the sites' shares over the std each declared, pooled (1 for correct code), and ``shares`` holds every share
    in units of C, (world, round, site, coordinate) with NaN rows for a site that did not reply.
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
    noise_at: str = "server"
    secure_aggregation: bool = False
    shares_summed: list[int] = field(default_factory=list)
    share_ratio: float = math.nan
    shares: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0), repr=False)

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
        out = {k: v for k, v in asdict(self).items() if k not in ("residual", "checks", "shares")}
        out["checks"] = {c.name: [c.passed, c.statistic, c.limit, c.worst] for c in self.checks}
        out.update(passed=self.passed, failed=self.failed, kind="white-box audit of the federated round (Flower)")
        return out

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        verdict += "".join(check.failure(".4g") for check in self.checks)
        where = {"server": "noise at the server", "sites": "noise shares at the sites"}.get(self.noise_at, "")
        where += " summed by SecAgg+" if self.secure_aggregation else ""
        return (
            f"federated P3SGD over {len(self.sites)} sites ({where}), canary at {self.canary_site!r}, {self.rounds} "
            f"rounds through Flower: {verdict}. The canary moved the release by {max(self.moved):.4f}·C at most "
            f"(bound 1), {max(self.excess):.3g}·C beyond what its site sent (tolerance {self.tolerance:g}); noise sd "
            f"{self.noise_ratio:.3f}× the ledger's z = {self.noise_multiplier:g}"
            + (f" (the shares' sd {self.share_ratio:.3f}× declared)" if self.noise_at == "sites" else "")
            + "; inclusion rate: canary "
            f"{self.canary_rate:.3f} ({sum(self.included)}/{self.rounds}), all patients {self.population_rate:.3f} "
            f"({self.population_coins} coins), ledger q = {self.sample_rate:g}."
        )


def _observed_grid(client_app: Any, node_configs: list[dict[str, Any]], drop: Any = None) -> Any:
    """A `LocalGrid` that keeps the replies the server received, by site (what a white-box auditor at the server sees).

    In a SecAgg+ round the messages carry masked vectors, not replies: nothing is kept (the server sees only the sum).
    """
    from lightning_dp.federated.flower import LocalGrid

    class _ObservedGrid(LocalGrid):
        def __init__(self) -> None:
            super().__init__(client_app, node_configs, drop=drop)
            self.received: dict[str, Tensor] = {}

        def pull_messages(self, message_ids: Any) -> Any:
            replies = list(super().pull_messages(message_ids))
            for reply in replies:
                content: Any = reply.content
                if not reply.has_error() and "clipped_sum" in content:
                    name = str(content["site"]["name"])
                    self.received[name] = torch.from_numpy(content["clipped_sum"]["clipped_sum"].numpy().copy())
            return replies

    return _ObservedGrid()


def _recorded(store: dict[str, Tensor], name: str, method: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``method`` (a site's bound method), with a copy of each value it returns kept in ``store[name]``."""

    def call(*args: Any, **kwargs: Any) -> Tensor:
        out = method(*args, **kwargs)
        store[name] = out.detach().double().clone()  # a copy: `Site.reply` adds the share to its clipped sum in place
        return out

    return call


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
        seed: the sites' and the server's seeds (public; the same in both worlds). With the noise at the sites it
            seeds no noise: each site draws its shares from the OS CSPRNG, as deployed.
        noise_at: ``"server"`` (the server adds the noise) or ``"sites"`` (each site adds its share z·C/√m,
            `lightning_dp.federated.share_std`; the server charges the shares that arrived).
        secure_aggregation: with ``noise_at="sites"``, every round's sum by SecAgg+ (`SecureSum`, over `LocalGrid`).
        drop: site name → the rounds (0-based) in which that site's message is lost (public, the same in both
            worlds); with the noise at the sites the server's ``min_shares`` is the fewest sites this leaves.

    Raises:
        PrivacyConfigError: an unknown canary or dropped site, tensors that do not match, SecAgg+ without the noise at
            the sites or with dropouts, a round without a site, or a round that did not run with every site that the
            schedule keeps (a budget, an unplanned dropout, a refused reply).

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
        noise_at: Literal["server", "sites"] = "server",
        secure_aggregation: bool = False,
        drop: Mapping[str, Collection[int]] | None = None,
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
        if noise_at not in ("server", "sites"):
            raise PrivacyConfigError(f"`{owner}(noise_at={noise_at!r})`: must be 'server' or 'sites'.")
        if secure_aggregation and noise_at != "sites":
            raise PrivacyConfigError(
                f"`{owner}(secure_aggregation=True)`: SecAgg+ carries the sites' noise shares. HINT: noise_at='sites'."
            )
        schedule = {str(name): sorted({int(t) for t in rounds_}) for name, rounds_ in (drop or {}).items()}
        unknown = sorted(set(schedule) - set(sites))
        if unknown:
            raise PrivacyConfigError(
                f"`{owner}(drop=…)`: no such site {unknown}; the sites are {sorted(sites)}. HINT: name hospitals."
            )
        if secure_aggregation and any(schedule.values()):
            raise PrivacyConfigError(
                f"`{owner}`: dropouts are audited in plain rounds only (a site that leaves SecAgg+ halts its round). "
                "HINT: drop=None with secure_aggregation=True."
            )
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
        self.noise_at = noise_at
        self.secure_aggregation = bool(secure_aggregation)
        self.drop = schedule
        fewest = min(len(self.sites) - len(self._dropped(t)) for t in range(self.rounds))
        if fewest < 1:
            raise PrivacyConfigError(f"`{owner}(drop=…)`: a round in which no site replies. HINT: keep one site.")
        self.min_shares = fewest
        self.built: dict[tuple[str, str], Site] = {}
        # White-box, per world, for the round in progress: each site's clipped sum S_k and the reply it made.
        self._sums: dict[str, dict[str, Tensor]] = {"in": {}, "out": {}}
        self._replies: dict[str, dict[str, Tensor]] = {"in": {}, "out": {}}

    def _largest_patient(self) -> int:
        counts = [int(torch.unique(p, return_counts=True)[1].max()) for _, _, p in self.sites.values()]
        return max(counts + [len(self.canary[1])])

    def _dropped(self, round_number: int) -> set[str]:
        """The sites whose message is lost in that round (the public schedule ``drop``)."""
        return {name for name, rounds in self.drop.items() if round_number in rounds}

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
        noise_std = (
            share_std(self.noise_multiplier, self.clip_norm, len(self.sites)) if self.noise_at == "sites" else 0.0
        )
        site = Site(name, parts, sample_rate=self.sample_rate, seed=self.seed * 1000 + index + 1, noise_std=noise_std)
        # White-box: the clipped sum before any share, and the reply the site made (through SecAgg+ the server never
        # sees it). Bound now, so a mutant patched into the class is what runs.
        site.clipped_sum = _recorded(self._sums[world], name, site.clipped_sum)  # type: ignore[method-assign]
        site.reply = _recorded(self._replies[world], name, site.reply)  # type: ignore[method-assign]
        self.built[(world, name)] = site
        return site

    def _server(self, world: str) -> FederatedServer:
        # N is declared by the consortium before the data are counted: the same in both worlds (the canary's
        # included), so the two releases have one normalizer and the only difference is the canary's sum.
        patients = sum(len(set(p.tolist())) for _, _, p in self.sites.values()) + 1
        sites = self.noise_at == "sites"
        torch.manual_seed(self.seed)
        return FederatedServer(
            self.model(),
            num_patients=patients,
            sample_rate=self.sample_rate,
            clip_norm=self.clip_norm,
            noise=self.noise_multiplier,
            server_lr=self.server_lr,
            seed=self.seed,
            noise_at=self.noise_at,
            sites=len(self.sites) if sites else None,
            min_shares=self.min_shares if sites else None,
        )

    def _grid(self, world: str, names: list[str], servers: Mapping[str, FederatedServer]) -> Any:
        from lightning_dp.federated.flower import TRAIN, site_app

        app = site_app(lambda context: self._site(str(context.node_config["world"]), str(context.node_config["site"])))

        def drop(node: int, message: Any) -> bool:  # the public schedule: a train message of a listed round is lost
            if message.metadata.message_type != TRAIN or not self.drop:
                return False
            return names[node - 1] in self._dropped(servers[world].steps)

        return _observed_grid(app, [{"site": name, "world": world} for name in names], drop)

    # ------------------------------------------------------------------ the audit
    def run(self) -> FederatedAuditResult:
        """Both worlds in lockstep through Flower, every θ_t and reply observed, then the checks."""
        from lightning_dp.federated.flower import run_rounds

        self.built.clear()
        governor = ThreadGovernor()  # many tiny kernels: on the cores other processes leave free (a shared machine)
        try:
            return self._run(governor, run_rounds)
        finally:
            governor.restore()

    def _secure_sum(self) -> Any:
        if not self.secure_aggregation:
            return None
        from lightning_dp.federated.secure import SecureSum

        return SecureSum()

    def _run(self, governor: ThreadGovernor, run_rounds: Callable[..., Any]) -> FederatedAuditResult:
        from lightning_dp.federated.flower import RoundLog

        names = sorted(self.sites)
        servers = {w: self._server(w) for w in ("in", "out")}
        grids = {w: self._grid(w, names, servers) for w in ("in", "out")}
        normalizers = {w: s.normalizer for w, s in servers.items()}  # the public q·N (declared: equal in both worlds)
        clip, d = self.clip_norm, servers["in"].theta().numel()
        moved, excess, site_moved, reported, summed = [], [], [], [], []
        residuals: dict[str, list[NDArray[np.float64]]] = {"in": [], "out": []}
        shares = np.full((2, self.rounds, len(names), d), np.nan)  # (world, round, site, coordinate), units of C
        round_off = 0.0
        for t in range(self.rounds):
            governor.adjust()
            theta = servers["in"].theta().clone()
            servers["out"].state.refresh()
            servers["out"].state.load(theta)  # the neighbouring data set at the same released θ_t
            release, received, sums = {}, {}, {}
            for w, world in enumerate(("in", "out")):
                logs: list[RoundLog] = []
                grids[world].received.clear()
                self._sums[world].clear()
                self._replies[world].clear()
                run_rounds(
                    grids[world],
                    servers[world],
                    t + 1,
                    sites=len(self.sites),
                    on_round=logs.append,
                    secure=self._secure_sum(),
                    max_empty_rounds=1,
                )
                lost = self._dropped(t)
                if len(logs) != 1 or set(logs[0].refused) != lost:
                    raise PrivacyConfigError(
                        f"`FederatedAudit`: round {t} of the {world!r} world did not run with every site the schedule "
                        f"keeps ({[log.refused for log in logs]}; dropped by the schedule: {sorted(lost)}). HINT: no "
                        "budget, unplanned dropouts or refusals in the audited run."
                    )
                arrived = [name for name in names if name not in lost]
                replies = self._replies[world] if self.secure_aggregation else grids[world].received
                if sorted(replies) != arrived or sorted(self._sums[world]) != arrived:
                    raise PrivacyConfigError(
                        f"`FederatedAudit`: round {t} of the {world!r} world: replies from {sorted(replies)}, clipped "
                        f"sums from {sorted(self._sums[world])}, expected {arrived}. HINT: the audit builds the sites "
                        "itself; a site built elsewhere cannot be read."
                    )
                after = servers[world].theta()
                scale = normalizers[world] / self.server_lr
                release[world] = (after.double() - theta.double()) * scale
                received[world] = torch.stack([replies[name].double() for name in arrived]).sum(0)
                sums[world] = torch.stack([self._sums[world][name] for name in arrived]).sum(0)
                for name in arrived:
                    shares[w, t, names.index(name)] = (
                        (replies[name].double() - self._sums[world][name]) / clip
                    ).numpy()
                residuals[world].append(((release[world] - sums[world]) / clip).numpy())
                round_off += 2.0**-24 * float(after.norm()) * scale / clip
                if world == "in":
                    reported.append(float(logs[0].noise_std))
                    summed.append(len(arrived))
            noise = {world: received[world] - sums[world] for world in release}  # Σ of the measured shares (or 0)
            difference = release["in"] - release["out"]
            moved.append(float((difference - (noise["in"] - noise["out"])).norm()) / clip)
            excess.append(float((difference - (received["in"] - received["out"])).norm()) / clip)
            site_moved.append(float((sums["in"] - sums["out"]).norm()) / clip)
        round_off /= self.rounds
        if round_off > self.tolerance / 2:
            raise PrivacyConfigError(
                f"`FederatedAudit`: the fp32 round-off of the releases, rescaled by q·N/server_lr, can reach "
                f"{round_off:.3g}·C, more than half the tolerance {self.tolerance:g}. HINT: a larger server_lr or clip "
                "norm, or fewer patients."
            )
        server = servers["in"]
        sites_mode = self.noise_at == "sites"
        ledgers = {w: ledger_multipliers(s.ledger) for w, s in servers.items()}
        ledger_z = ledgers["in"]
        # With the noise at the sites the worlds' noise is independent: both are tested, each against its own ledger.
        # At the server it is one Z in both worlds: the "in" world alone.
        residual = np.stack(residuals["in"] + residuals["out"]) if sites_mode else np.stack(residuals["in"])
        tested_z = np.concatenate([ledgers["in"], ledgers["out"]]) if sites_mode else ledger_z
        tensors = [(name, p.numel()) for name, p in server.state.module.named_parameters() if p.requires_grad]
        included = [m > INCLUDED for m in moved]
        coins = sum(  # white-box: the coins each site's reply drew (its own `patients_of_round`)
            len(site.patients_of_round(t))
            for (world, _), site in self.built.items()
            if world == "in"
            for t in range(self.rounds)
        )
        declared = {name: self.built[("in", name)].noise_std / clip for name in names}
        if sites_mode:
            fresh = self._fresh_shares(shares, names)
        else:
            fresh = fresh_noise(residual, residual[:0], self.significance)
        checks = [
            self._sensitivity(moved, excess),
            self._noise(residual, tested_z, tensors, reported, normalizers["in"]),
        ]
        if sites_mode:
            checks.append(self._share_std(shares, names, declared, tensors))
        checks += [fresh, self._rate(included, coins, server)]
        total = self.rounds * server.num_patients
        scaled = shares / np.array([declared[name] if declared[name] > 0 else math.nan for name in names])[:, None]
        share_ratio = float(np.sqrt(np.nanmean(scaled**2))) if sites_mode else math.nan
        return FederatedAuditResult(
            rounds=self.rounds,
            sites=names,
            canary_site=self.canary_site,
            sample_rate=self._ledger_rate(server),
            clip_norm=clip,
            noise_multiplier=self.noise_multiplier,
            normalizer=normalizers["in"],
            moved=moved,
            excess=excess,
            site_moved=site_moved,
            included=included,
            noise_ratio=float(np.sqrt(((residual / tested_z[:, None]) ** 2).mean()))
            if len(tested_z) == len(residual)
            else math.nan,
            canary_rate=sum(included) / self.rounds,
            population_rate=coins / total,
            population_coins=total,
            reported_noise_std=reported,
            epsilon=server.epsilon(),
            delta=server.ledger.delta,
            tolerance=self.tolerance,
            significance=self.significance,
            checks=tuple(checks),
            residual=residual,
            noise_at=self.noise_at,
            secure_aggregation=self.secure_aggregation,
            shares_summed=summed,
            share_ratio=share_ratio,
            shares=shares if sites_mode else np.zeros(0),
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

    def _share_std(
        self,
        shares: NDArray[np.float64],
        names: list[str],
        declared: Mapping[str, float],
        tensors: list[tuple[str, int]],
    ) -> NoiseCheck:
        """Each site's shares, both worlds, are N(0, σ_k²) per coordinate, σ_k the std it declared (units of C)."""
        checks = []
        for k, name in enumerate(names):
            rows = shares[:, :, k].reshape(-1, shares.shape[-1])
            rows = rows[~np.isnan(rows[:, 0])]
            if declared[name] <= 0:
                where = f"site {name!r} declared no noise share"
                return NoiseCheck("share std", False, 0.0, 1.0, where, self.significance, 0)
            check = noise_equals_ledger(
                rows, np.full(len(rows), declared[name]), tensors, self.significance / len(names)
            )
            checks.append((check, name))
        tests = sum(check.tests for check, _ in checks)
        failed = [(check, name) for check, name in checks if not check.passed]
        check, name = failed[0] if failed else max(checks, key=lambda c: abs(c[0].statistic - 1.0))
        where = f"site {name!r}: {check.worst} (its declared share {declared[name]:.4g}·C)"
        return NoiseCheck("share std", not failed, check.statistic, check.limit, where, self.significance, tests)

    def _fresh_shares(self, shares: NDArray[np.float64], names: list[str]) -> NoiseCheck:
        """No two shares correlate beyond chance: across sites, rounds (at every lag) and the two worlds (two runs)."""
        rows, labels = [], []
        for w, world in enumerate(("in", "out")):
            for t in range(shares.shape[1]):
                for k, name in enumerate(names):
                    if not np.isnan(shares[w, t, k, 0]):
                        rows.append(shares[w, t, k])
                        labels.append(f"site {name!r} round {t} ({world} world)")
        return fresh_noise(np.stack(rows), np.zeros((0, shares.shape[-1])), self.significance, labels)

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
