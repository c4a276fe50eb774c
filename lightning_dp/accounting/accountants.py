"""Accountants: turn a `PrivacyLedger` into an (ε, δ) guarantee.

* ``rdp`` (default): Rényi DP composition with the Balle et al. (2020) conversion.
* ``prv``: numerical composition of privacy random variables (Gopi et al. 2021), via Opacus'
  PRV analysis, for every Poisson-sampled mechanism with a Gaussian part (a release alone, or a
  release and the selections run on its sample, `lightning_dp.accounting.prv`); any other events
  are accounted by RDP at δ/2 and the two guarantees added (basic composition), so the result is
  always a valid bound.

Mechanisms that read one Poisson sample are one `PoissonSampledEvent` and are amplified together
(their joint pair, both neighbouring directions); never each on its own.
* ``moments``: the moments accountant of Abadi et al. (2016) with integer λ = 1..32 and the
  classic tail bound — kept to reproduce the papers' numbers; it is valid but looser.

All three read the same ledger; none stores ε.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Iterable
from typing import Literal, Protocol, get_args

import numpy as np
from numpy.typing import NDArray

from lightning_dp.accounting.events import (
    ComposedEvent,
    ExponentialMechanismEvent,
    GaussianEvent,
    PoissonSampledEvent,
    PrivacyEvent,
    RepeatAndSelectEvent,
    SelfComposedEvent,
    ZCDPEvent,
)
from lightning_dp.accounting.ledger import PrivacyLedger, _check_delta
from lightning_dp.accounting.prv import MAX_PRV_POINTS, SampledKey, prv_epsilon
from lightning_dp.accounting.rdp import (
    DEFAULT_ORDERS,
    MOMENTS_ORDERS,
    epsilon_from_rdp,
    epsilon_from_rdp_moments,
    rdp_poisson_joint,
    rdp_pure_dp,
    rdp_subsampled_gaussian,
)
from lightning_dp.accounting.repeat_select import repeat_and_select_rdp
from lightning_dp.errors import PrivacyConfigError, UnsupportedEventError, check_finite_positive

__all__ = [
    "Accountant",
    "AccountantName",
    "MomentsAccountant",
    "PRVAccountant",
    "RDPAccountant",
    "gaussian_epsilon",
    "get_accountant",
]

AccountantName = Literal["rdp", "prv", "moments"]

#: Above this many distinct (rate, multiplier) pairs, multipliers are rounded *down* onto a geometric
#: grid: a smaller multiplier means more noise is assumed absent, so the bound only gets larger.
MAX_EXACT_GAUSSIANS = 256


class Accountant(Protocol):
    """What every accountant offers."""

    name: AccountantName

    def epsilon(self, ledger: PrivacyLedger, delta: float | None = None) -> float:
        """ε for ``delta`` (the ledger's δ if None), a valid upper bound for the ledger's unit."""
        ...


def _flatten(event: PrivacyEvent, count: int, out: list[tuple[PrivacyEvent, int]]) -> None:
    """Expands composed / self-composed events into leaf events with counts."""
    if isinstance(event, SelfComposedEvent):
        _flatten(event.event, count * event.count, out)
    elif isinstance(event, ComposedEvent):
        for inner in event.events:
            _flatten(inner, count, out)
    else:
        out.append((event, count))


def _leaves(entries: Iterable[tuple[PrivacyEvent, int]]) -> list[tuple[PrivacyEvent, int]]:
    out: list[tuple[PrivacyEvent, int]] = []
    for event, count in entries:
        _flatten(event, count, out)
    return out


def _sampled_key(event: PrivacyEvent) -> SampledKey | None:
    """(q, z, selection ε's) of a mechanism with a Gaussian part; None for any other leaf event."""
    if isinstance(event, PoissonSampledEvent):
        multiplier, epsilons = event.components()
        return None if multiplier is None else (event.sample_rate, multiplier, epsilons)
    if isinstance(event, GaussianEvent):
        return (1.0, event.noise_multiplier, ())
    return None


def round_down_geometric(values: NDArray[np.float64], ratio: float) -> NDArray[np.float64]:
    """Rounds positive ``values`` down onto the grid {(1 + ratio)^k}; never returns a value above its input."""
    step = math.log1p(ratio)
    rounded = np.exp(np.floor(np.log(values) / step) * step)
    return np.minimum(rounded, values)


def _group_gaussians(
    entries: Iterable[tuple[PrivacyEvent, int]], grid_ratio: float
) -> tuple[Counter[SampledKey], list[tuple[PrivacyEvent, int]]]:
    """Counts the steps of each mechanism with a Gaussian part by (rate, multiplier, selection ε's).

    Returns them and the other leaf events (zCDP, selections without a Gaussian on their sample).
    """
    gaussians: Counter[SampledKey] = Counter()
    others: list[tuple[PrivacyEvent, int]] = []
    for entry_event, entry_count in entries:
        if entry_count == 0:
            continue
        # Fast path: a ledger of a decaying schedule is 100,000s of plain subsampled Gaussians.
        if type(entry_event) is PoissonSampledEvent and type(entry_event.event) is GaussianEvent:
            gaussians[(entry_event.sample_rate, entry_event.event.noise_multiplier, ())] += entry_count
            continue
        for event, count in _leaves([(entry_event, entry_count)]):
            if count == 0:
                continue
            key = _sampled_key(event)
            if key is None:
                others.append((event, count))
            else:
                gaussians[key] += count
    if len(gaussians) > MAX_EXACT_GAUSSIANS:
        keys = list(gaussians)
        sigmas = round_down_geometric(np.array([k[1] for k in keys]), grid_ratio)
        regrouped: Counter[SampledKey] = Counter()
        for key, sigma in zip(keys, sigmas.tolist()):
            regrouped[(key[0], sigma, key[2])] += gaussians[key]
        gaussians = regrouped
    return gaussians, others


def _rdp_of_others(others: list[tuple[PrivacyEvent, int]], orders: NDArray[np.float64]) -> NDArray[np.float64]:
    total = np.zeros_like(orders)
    for event, count in others:
        if isinstance(event, ExponentialMechanismEvent):
            total += count * rdp_pure_dp(event.pure_epsilon, orders)
        elif isinstance(event, ZCDPEvent):
            total += count * event.rho * orders
        elif isinstance(event, PoissonSampledEvent):  # selections alone on a sample, no Gaussian
            total += count * rdp_poisson_joint(event.sample_rate, None, event.components()[1], orders)
        elif isinstance(event, RepeatAndSelectEvent):  # a private search: one trial's whole curve, transformed
            one = ledger_rdp([(event.event, 1)], orders)
            total += count * repeat_and_select_rdp(orders, one, event.mean, event.shape)
        else:  # pragma: no cover - events are validated on construction
            raise UnsupportedEventError(f"No RDP analysis for {type(event).__name__}.")
    return total


#: RDP curves of recently seen (rate, multiplier, selections, orders): a training run asks for ε after every
#: step with the same few events, and one curve costs ~0.1 s.
_CURVES: dict[tuple[float, float, tuple[float, ...], bytes], NDArray[np.float64]] = {}
_MAX_CACHED_CURVES = 256


def _curves(keys: list[SampledKey], orders: NDArray[np.float64]) -> NDArray[np.float64]:
    """RDP of each plain subsampled Gaussian, in one vectorized pass."""
    return rdp_subsampled_gaussian(np.array([k[0] for k in keys]), np.array([k[1] for k in keys]), orders)


def _gaussian_curves(keys: list[SampledKey], orders: NDArray[np.float64]) -> NDArray[np.float64]:
    """RDP of each key at ``orders``, one row per key (memoized for a few keys)."""
    if len(keys) > 16 and all(not k[2] for k in keys):  # noise decay: many distinct multipliers, one pass
        return _curves(keys, orders)
    tag = orders.tobytes()
    missing = [k for k in keys if (k[0], k[1], k[2], tag) not in _CURVES]
    if missing:
        if len(_CURVES) + len(missing) > _MAX_CACHED_CURVES:
            _CURVES.clear()
            missing = list(dict.fromkeys(keys))  # clearing dropped the keys that were there too
        plain = [k for k in missing if not k[2]]
        fresh = list(zip(plain, _curves(plain, orders))) if plain else []
        fresh += [(k, rdp_poisson_joint(k[0], k[1], k[2], orders)) for k in missing if k[2]]
        for key, curve in fresh:
            curve.setflags(write=False)
            _CURVES[(key[0], key[1], key[2], tag)] = curve
    return np.stack([_CURVES[(k[0], k[1], k[2], tag)] for k in keys])


def ledger_rdp(
    entries: Iterable[tuple[PrivacyEvent, int]], orders: NDArray[np.float64], grid_ratio: float = 1e-3
) -> NDArray[np.float64]:
    """The total RDP curve of a ledger's entries at ``orders``."""
    gaussians, others = _group_gaussians(entries, grid_ratio)
    total = _rdp_of_others(others, orders)
    if gaussians:
        keys = list(gaussians)
        counts = np.array([gaussians[k] for k in keys], dtype=np.float64)
        total = total + counts @ _gaussian_curves(keys, orders)
    return total


def _releases_anything(ledger: PrivacyLedger) -> bool:
    """False for an empty ledger and for one whose events release nothing (count 0, empty compositions)."""
    return any(count > 0 for _, count in _leaves(ledger.entries))


def _resolve_delta(ledger: PrivacyLedger, delta: float | None) -> float:
    return ledger.delta if delta is None else _check_delta("Accountant.epsilon", delta)


class RDPAccountant:
    """Rényi-DP accountant (the default).

    Args:
        orders: RDP orders to optimise over; Opacus' defaults plus larger integer orders.
        grid_ratio: relative spacing of the geometric grid onto which noise multipliers are rounded
            down when a ledger holds more than ``MAX_EXACT_GAUSSIANS`` distinct ones (noise decay).

    Example:
        >>> from lightning_dp.accounting import GaussianEvent, PoissonSampledEvent, PrivacyLedger
        >>> ledger = PrivacyLedger("sample", delta=1e-5)
        >>> ledger.record(PoissonSampledEvent(0.04, GaussianEvent(1.5)), count=2250)
        >>> round(RDPAccountant().epsilon(ledger), 4)
        7.3291
    """

    name: AccountantName = "rdp"

    def __init__(self, orders: NDArray[np.float64] | None = None, grid_ratio: float = 1e-3) -> None:
        self.orders = DEFAULT_ORDERS if orders is None else np.asarray(orders, dtype=np.float64)
        if self.orders.ndim != 1 or self.orders.size == 0 or not np.all(self.orders > 1):
            raise PrivacyConfigError(
                f"`RDPAccountant(orders=...)`: orders must be a non-empty 1-D array of numbers > 1, found "
                f"{self.orders!r}. HINT: leave orders unset to use the defaults."
            )
        self.grid_ratio = check_finite_positive(
            "RDPAccountant", "grid_ratio", grid_ratio, "1e-3 rounds multipliers down by at most 0.1%."
        )

    def rdp(self, ledger: PrivacyLedger) -> NDArray[np.float64]:
        return ledger_rdp(ledger.entries, self.orders, self.grid_ratio)

    def epsilon(self, ledger: PrivacyLedger, delta: float | None = None) -> float:
        delta = _resolve_delta(ledger, delta)
        if not _releases_anything(ledger):
            return 0.0
        return epsilon_from_rdp(self.rdp(ledger), delta, self.orders)


class MomentsAccountant:
    """The moments accountant as the papers used it: integer λ = 1..32, ε = min_λ (M(λ) + log 1/δ)/λ.

    Valid but looser than `RDPAccountant`; use it to reproduce published numbers.

    Example:
        >>> from lightning_dp.accounting import GaussianEvent, PoissonSampledEvent, PrivacyLedger
        >>> ledger = PrivacyLedger("sample", delta=1e-5)
        >>> ledger.record(PoissonSampledEvent(0.04, GaussianEvent(1.5)), count=2250)
        >>> MomentsAccountant().epsilon(ledger) > RDPAccountant().epsilon(ledger)
        True
    """

    name: AccountantName = "moments"

    def __init__(self, grid_ratio: float = 1e-3) -> None:
        self.orders = MOMENTS_ORDERS
        self.grid_ratio = check_finite_positive("MomentsAccountant", "grid_ratio", grid_ratio, "use 1e-3.")

    def epsilon(self, ledger: PrivacyLedger, delta: float | None = None) -> float:
        delta = _resolve_delta(ledger, delta)
        if not _releases_anything(ledger):
            return 0.0
        return epsilon_from_rdp_moments(ledger_rdp(ledger.entries, self.orders, self.grid_ratio), delta, self.orders)


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact ε at ``delta`` of the Gaussian mechanism with sensitivity/σ = ``mu`` (μ-GDP; Balle & Wang 2018).

    δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2); ε is found by bisection and the upper end returned.
    N Gaussians with multipliers z_i compose into one with μ = √(Σ 1/z_i²).

    Example:
        >>> round(gaussian_epsilon(1.0, 1e-5), 4)
        4.3772
    """
    check_finite_positive("gaussian_epsilon", "mu", mu, "sensitivity divided by the noise std.")

    def delta_of(eps: float) -> float:
        return _normal_cdf(-eps / mu + mu / 2) - math.exp(eps) * _normal_cdf(-eps / mu - mu / 2)

    if delta_of(0.0) <= delta:
        return 0.0
    low, high = 0.0, mu * mu / 2 + mu * math.sqrt(2 * math.log(1 / delta))  # the zCDP bound: δ(high) ≤ δ
    while delta_of(high) > delta:  # never taken in exact arithmetic; guards round-off
        high *= 2
    while high - low > 1e-10 * max(1.0, high):
        mid = (low + high) / 2
        if delta_of(mid) > delta:
            low = mid
        else:
            high = mid
    return high


class PRVAccountant:
    """Privacy-random-variable accountant (Gopi et al. 2021) using Opacus' PRV analysis.

    A ledger of un-sampled Gaussians only (PATE's aggregations) is composed exactly (`gaussian_epsilon`).
    The Poisson-sampled mechanisms with a Gaussian part (alone, or with the selections run on their
    sample: the joint pair, remove and add directions) are composed numerically and reported as the
    *upper* end of the error interval (``eps_error``). If the ledger also holds un-sampled selection or zCDP
    events, those are accounted by RDP and the two (ε, δ/2) guarantees are added — basic
    composition, always valid, sometimes looser than `RDPAccountant` alone.

    Args:
        eps_error: the numerical error allowed on ε (added to the estimate).
        grid_ratio: as for `RDPAccountant`; PRV composition cost grows with distinct multipliers, so
            the default grid is coarser (1 %).

    Example:
        >>> from lightning_dp.accounting import GaussianEvent, PoissonSampledEvent, PrivacyLedger
        >>> ledger = PrivacyLedger("sample", delta=1e-5)
        >>> ledger.record(PoissonSampledEvent(0.04, GaussianEvent(1.5)), count=2250)
        >>> PRVAccountant().epsilon(ledger) < RDPAccountant().epsilon(ledger)
        True
    """

    name: AccountantName = "prv"

    def __init__(self, eps_error: float = 0.01, grid_ratio: float = 1e-2) -> None:
        self.eps_error = check_finite_positive("PRVAccountant", "eps_error", eps_error, "use 0.01.")
        self.grid_ratio = check_finite_positive("PRVAccountant", "grid_ratio", grid_ratio, "use 1e-2.")

    def epsilon(self, ledger: PrivacyLedger, delta: float | None = None) -> float:
        delta = _resolve_delta(ledger, delta)
        gaussians, others = _group_gaussians(ledger.entries, self.grid_ratio)
        if not gaussians and not others:
            return 0.0
        if not others:
            return self._gaussian_epsilon(gaussians, delta)
        rest = epsilon_from_rdp(_rdp_of_others(others, DEFAULT_ORDERS), delta / 2, DEFAULT_ORDERS)
        if not gaussians:
            return rest
        return self._gaussian_epsilon(gaussians, delta / 2) + rest

    def _gaussian_epsilon(self, gaussians: Counter[SampledKey], delta: float) -> float:
        if all(rate == 1.0 and not selections for rate, _, selections in gaussians):
            # Un-sampled Gaussians (PATE's aggregations) compose into one Gaussian: ε is exact, no numerics needed.
            mu = math.sqrt(sum(count / sigma**2 for (_, sigma, _), count in gaussians.items()))
            return gaussian_epsilon(mu, delta)
        if any(key[2] for key in gaussians):  # selections on a release's sample: the joint pair, both directions
            return prv_epsilon(list(gaussians), list(gaussians.values()), delta, self.eps_error)
        # Imported here: Opacus imports torch, and the accounting layer must stay importable without it.
        from opacus.accountants.analysis.prv import (
            Domain,
            PoissonSubsampledGaussianPRV,
            TruncatedPrivacyRandomVariable,
            compose_heterogeneous,
            compute_safe_domain_size,
            discretize,
        )

        # The same steps as Opacus' PRVAccountant, with the domain size checked before allocating it.
        delta_error = delta / 1000
        prvs = [PoissonSubsampledGaussianPRV(rate, sigma) for rate, sigma, _ in gaussians]
        counts = list(gaussians.values())
        with warnings.catch_warnings():
            # Opacus sizes the domain with an RDP bound over its fixed grid of orders and warns when the best order
            # is at the grid's end ("Optimal order is the largest alpha"): that bound is then looser, the domain
            # wider, never too narrow, and the ε computed here is PRV's. Nothing a user could act on.
            warnings.filterwarnings("ignore", "Optimal order is the (smallest|largest) alpha", UserWarning)
            half_width = compute_safe_domain_size(prvs, counts, eps_error=self.eps_error, delta_error=delta_error)
        mesh = self.eps_error / math.sqrt(sum(counts) * math.log(12 / delta_error) / 2)
        points = 2 * half_width / mesh
        if points > MAX_PRV_POINTS:
            raise UnsupportedEventError(
                f"`PRVAccountant`: this ledger needs a PRV domain of {points:.3g} points (more than "
                f"{MAX_PRV_POINTS:.0e}); the noise is too small for numerical composition. "
                "HINT: use the 'rdp' accountant."
            )
        domain = Domain.create_aligned(-half_width, half_width, mesh)
        dprvs = [discretize(TruncatedPrivacyRandomVariable(p, domain.t_min, domain.t_max), domain) for p in prvs]
        dprv = compose_heterogeneous(dprvs=dprvs, num_self_compositions=counts)
        _, _, eps_upper = dprv.compute_epsilon(delta, delta_error, self.eps_error)
        return max(0.0, float(eps_upper))  # the numerical bound can dip a hair below 0 for tiny ledgers


_ACCOUNTANTS: dict[str, type[RDPAccountant] | type[PRVAccountant] | type[MomentsAccountant]] = {
    "rdp": RDPAccountant,
    "prv": PRVAccountant,
    "moments": MomentsAccountant,
}


def get_accountant(name: AccountantName) -> Accountant:
    """The accountant called ``name`` with default settings.

    Example:
        >>> get_accountant("rdp").name
        'rdp'
    """
    if name not in _ACCOUNTANTS:
        raise PrivacyConfigError(
            f"`get_accountant(name={name!r})`: name must be one of {list(get_args(AccountantName))}, found {name!r}. "
            "HINT: 'rdp' is the default; 'prv' is tighter; 'moments' reproduces the papers."
        )
    return _ACCOUNTANTS[name]()
