"""A one-run audit at patient level: m canary patients, each in by a secret coin, one P3SGD run, three ε lower bounds.

`OneRunAudit` trains once. Each of m canary *patients* (several images each) joins the training data by an
independent fair coin, drawn from a generator seeded from the OS CSPRNG (`secure_seed`) unless a seed is given, and
the real `P3SGD` callback fits a model on the patients whose coin came up "in" (its Poisson sampler, its local SGD and
per-patient clip, its `GaussianRelease`, its ledger and accountant: nothing of the private step is re-implemented).
The number of patients the callback divides by is the public m (``num_patients=m``, q·m the normalizer), never the
count the coins produced.

**The canaries (white-box gradient canaries; Nasr et al. 2023, Steinke, Nasr and Jagielski 2023, §6).** The model is
a linear layer with two classes and no bias over inputs of dimension m; canary i's images are the i-th basis vector
(label 0, loss weighted by ``canary_weight``). Its local update is therefore a fixed direction u_i (+1 on weight
[0, i], −1 on [1, i], over √2), whatever θ_t is, far above C, so that clipping brings it to exactly C·u_i. The u_i
are orthonormal: one canary's update does not move another's score. The auditor knows every u_i (public) and scores
canary i by the sum of the released updates along u_i, in units of C:

    s_i = ⟨θ_T − θ_0, u_i⟩ · q·m / (server_lr · C)  ~  N(b_i · (number of rounds i was sampled in), T·z²)

with b_i the coin. With constant noise this is the likelihood-ratio statistic of every release at once (the sum of
the released updates is sufficient along u_i), so reading only θ_0 and θ_T loses nothing.

**The tightest honest setting is q = 1** (the default). With Poisson sampling at q < 1 a canary joins only some rounds
and its score mixes rounds with and without it, while the accountant's amplification by subsampling is real privacy
that a one-run audit cannot see canary by canary: the bound falls far below the printed ε (docs/results/audit.md,
"One run, at patient level", measures it). At q = 1 the T rounds compose to one Gaussian mechanism per canary, with
trade-off curve G_μ, μ = √T / z: the printed ε (RDP or PRV) is then within a few per cent of the exact ε of the run.

**The join.** Scores are produced per canary *identifier* (the patient id the training data use), membership is
kept per identifier from the coins, and `join_by_id` puts them together; it raises on a missing, duplicated or extra
identifier (fails closed) instead of aligning two arrays by position.

**The bounds** (each holds with probability ≥ 1 − ``significance`` on its own, over the coins and the noise):

* ``snj``: Steinke, Nasr and Jagielski (NeurIPS 2023), `epsilon_one_run`: guesses "in" above a threshold,
  every threshold of the ROC hull with a Bonferroni correction. Valid for any (ε, δ)-DP mechanism.
* ``fdp``: the same guessing game read through the trade-off curve of (ε, δ)-DP, f_{ε,δ}, with the tail bound of
  Mahloujifar, Melis and Chaudhuri (ICML 2025, "Auditing f-Differential Privacy in One Run"), `fdp_rejects`:
  guesses on both sides (the top k/2 scores "in", the bottom k/2 "out") for k in a fixed grid of
  `GUESS_FRACTIONS` of m, Bonferroni over the grid. Valid for any (ε, δ)-DP mechanism; tighter than ``snj``.
* ``gdp``: the same test against μ-Gaussian DP: μ_lower such that the run is not μ-GDP for any μ < μ_lower, and
  ε_lower = ε_GDP(μ_lower, δ) (`gdp_epsilon`). **Assumption:** this ε is a lower bound on the run's ε at δ only for a
  mechanism whose privacy is described by a Gaussian trade-off curve (if it is μ-GDP for no μ below μ_lower, its ε at
  δ is at least ε_lower). It is the exact curve of the audited run at q = 1 (T Gaussian rounds compose to G_{√T/z}),
  so on correct code ε_lower ≤ ε_GDP(√T/z, δ) ≤ ε_printed; a mechanism that is (ε_printed, δ)-DP without being
  Gaussian-like could in principle exceed it without a bug. The rigorous reading is μ_lower against the configured μ.

**Siblings.** `lightning_dp.audit.one_run_federated.FederatedOneRunAudit` runs the same gradient canaries through
federated P3SGD (the canaries spread over the sites, Flower's messages, the noise at the server or in shares at the
sites); `lightning_dp.audit.one_run_loss.LossOneRunAudit` is the black-box audit (input-space canaries beside a
population, scored by the released model's loss). The coins, the calibration of z, the join and the bounds are this
module's `_OneRunDesign`, once.

A passing audit is a lower bound from one attack on one canary design, not a proof of privacy.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import torch
from numpy.typing import ArrayLike, NDArray
from scipy import special
from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_dp.accounting.calibration import calibrate_noise_multiplier
from lightning_dp.audit.bounds import epsilon_one_run, gdp_epsilon
from lightning_dp.audit.callback_audit import fit_world
from lightning_dp.errors import (
    PrivacyConfigError,
    PrivacyStateError,
    PrivacyWarning,
    check_count,
    check_finite_positive,
    check_sample_rate,
)
from lightning_dp.sampling.patients import secure_seed

__all__ = [
    "GUESS_FRACTIONS",
    "FdpBound",
    "OneRunAudit",
    "OneRunAuditResult",
    "approx_dp_inverse_blow_up",
    "fdp_rejects",
    "gdp_inverse_blow_up",
    "guess_counts",
    "join_by_id",
    "one_run_fdp",
]

#: The numbers of guesses the f-DP bounds try, as fractions of the m canaries (fixed before the scores are seen; the
#: significance is split evenly over them).
GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


# ---------------------------------------------------------------------------------------------------- the f-DP bound
def gdp_inverse_blow_up(mu: float) -> Callable[[float], float]:
    """B⁻¹ for μ-GDP: B(x) = 1 − G_μ(x) = Φ(Φ⁻¹(x) + μ), so B⁻¹(y) = Φ(Φ⁻¹(y) − μ).

    Example:
        >>> inverse = gdp_inverse_blow_up(1.0)
        >>> round(inverse(0.5), 4), inverse(0.0), inverse(1.0)
        (0.1587, 0.0, 1.0)
    """

    def inverse(y: float) -> float:
        return float(special.ndtr(special.ndtri(min(max(y, 0.0), 1.0)) - mu))

    return inverse


def approx_dp_inverse_blow_up(epsilon: float, delta: float) -> Callable[[float], float]:
    """B⁻¹ for (ε, δ)-DP: B(x) = 1 − f_{ε,δ}(x) = min(1, δ + e^ε·x, 1 − e^−ε·(1 − δ − x)), inverted piece by piece.

    Example:
        >>> inverse = approx_dp_inverse_blow_up(math.log(2.0), 0.0)
        >>> inverse(0.2), inverse(0.9)
        (0.1, 0.8)
    """
    grow, shrink = math.exp(epsilon), math.exp(-epsilon)

    def inverse(y: float) -> float:
        y = min(max(y, 0.0), 1.0)
        return max(0.0, (y - delta) * shrink, 1.0 - delta - grow * (1.0 - y))

    return inverse


def fdp_rejects(
    inverse_blow_up: Callable[[float], float], canaries: int, guesses: int, correct: int, significance: float
) -> bool:
    """True when an f-DP mechanism makes ≥ ``correct`` right of ``guesses`` guesses with probability ≤ ``significance``.

    The guessing game of Steinke, Nasr and Jagielski (2023): m = ``canaries`` canaries, each in by an independent fair
    coin; the auditor guesses the coin of exactly ``guesses`` of them from the output (and abstains on the rest). The
    mechanism is f-DP with respect to each canary, B = 1 − f its blow-up function, ``inverse_blow_up`` = B⁻¹.

    The tail bound is Mahloujifar, Melis and Chaudhuri (ICML 2025), for two possible values per canary: with p_l the
    probability of exactly l right guesses, c' = ``guesses``, R_i = Σ_{l≥i} l·p_l / m and H_i = Σ_{l≥i} (c'−l)·p_l / m,
    f-DP of each canary given the others' coins, averaged (B is concave), gives R_i ≤ B(H_{i−1}) for i = 1..c'. If
    P[≥ c right] ≥ τ, the smallest total mass these constraints allow is computed from i = c down by

        r_c = τ·c/m, h_c = τ·(c'−c)/m;  h_i = max(h_{i+1}, B⁻¹(r_{i+1})),  r_i = r_{i+1} + i/(c'−i)·(h_i − h_{i+1})

    (by induction H_i ≥ h_i and R_i ≥ r_i + i/(c'−i)·(H_i − h_i), the mass above c moved down to c only loosens the
    constraints), and the total mass is m·(R_0 + H_0)/c' = 1. So r_0 + h_0 > c'/m contradicts P[≥ c right] ≥ τ.
    Nothing is assumed about the scores (they may be correlated); the number of guesses must be fixed in advance.

    Example:
        >>> fdp_rejects(gdp_inverse_blow_up(0.5), 1000, 100, 100, 0.05)  # 100 of 100 right is too many for μ = 0.5
        True
        >>> fdp_rejects(gdp_inverse_blow_up(4.0), 1000, 100, 100, 0.05)
        False
    """
    if not 0 < guesses <= canaries or not 0 <= correct <= guesses:
        raise PrivacyConfigError(
            f"`fdp_rejects`: need 0 ≤ correct ≤ guesses ≤ canaries and guesses > 0, found {correct} right of {guesses} "
            f"guesses among {canaries} canaries."
        )
    cap = guesses / canaries
    r = significance * correct / canaries
    h = significance * (guesses - correct) / canaries
    if r + h > cap:
        return True
    for i in range(correct - 1, -1, -1):
        h_next = max(h, inverse_blow_up(r))
        r += i / (guesses - i) * (h_next - h)
        h = h_next
        if r + h > cap:  # r and h only grow as i falls: the total is already too large
            return True
    return False


def guess_counts(
    in_scores: ArrayLike, out_scores: ArrayLike, fractions: Sequence[float] = GUESS_FRACTIONS
) -> list[tuple[int, int]]:
    """(guesses, right ones) for k = max(1, round(fraction·m)): the top ⌈k/2⌉ scores guessed in, the bottom ⌊k/2⌋ out.

    Ties are broken against the auditor (at equal scores an out-canary ranks above an in-canary).

    Example:
        >>> guess_counts([3.0, 2.0, 0.5], [1.0, -1.0, 0.0], fractions=(0.5, 1.0))
        [(3, 3), (6, 4)]
        >>> guess_counts([1.0], [1.0], fractions=(1.0,))  # a tie: both guesses wrong
        [(2, 0)]
    """
    ins = np.asarray(in_scores, dtype=np.float64).ravel()
    outs = np.asarray(out_scores, dtype=np.float64).ravel()
    scores = np.concatenate([outs, ins])
    member = np.concatenate([np.zeros(outs.size, dtype=bool), np.ones(ins.size, dtype=bool)])
    # stable sort on −score: at equal scores the out-canaries come first (wrong "in" guesses at the top) and the
    # in-canaries last (wrong "out" guesses at the bottom), the auditor's worst case
    order = np.argsort(-scores, kind="stable")
    m = scores.size
    counts = []
    for k in sorted({min(m, max(1, round(f * m))) for f in fractions}):
        top, bottom = order[: (k + 1) // 2], order[m - k // 2 :] if k // 2 else order[:0]
        counts.append((k, int(member[top].sum() + (~member[bottom]).sum())))
    return counts


@dataclass(frozen=True)
class FdpBound:
    """An f-DP one-run bound: the parameter (μ or ε) that is rejected below, its ε at δ, and the guesses it used."""

    family: Literal["gdp", "approx"]
    parameter: float
    epsilon: float
    guesses: int
    correct: int


def _largest_rejected(rejects: Callable[[float], bool], ceiling: float) -> float:
    """The largest x in [0, ceiling] with rejects(x), for rejects true on an interval [0, x*) (0 if never)."""
    if not rejects(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while rejects(hi):
        lo, hi = hi, 2.0 * hi
        if hi > ceiling:
            return ceiling
    while hi - lo > 1e-6 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        if rejects(mid):
            lo = mid
        else:
            hi = mid
    return lo


def one_run_fdp(
    in_scores: ArrayLike,
    out_scores: ArrayLike,
    *,
    delta: float,
    family: Literal["gdp", "approx"],
    significance: float = 0.05,
    fractions: Sequence[float] = GUESS_FRACTIONS,
) -> FdpBound:
    """The f-DP one-run lower bound (Mahloujifar et al. 2025) for one family of trade-off curves.

    ``family="approx"``: f_{ε,δ}; the largest ε rejected at this δ is an ε lower bound for any mechanism.
    ``family="gdp"``: G_μ; the largest μ rejected, and its ε at δ (`gdp_epsilon`), a lower bound on ε only for
    mechanisms with a Gaussian trade-off curve (module docstring). The significance is split evenly over the numbers
    of guesses in ``fractions`` (Bonferroni), so the bound holds with probability ≥ 1 − significance.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> coins = rng.random(2000) < 0.5
        >>> scores = rng.normal(2.0 * coins, 1.0)  # a 2-GDP mechanism, read exactly
        >>> bound = one_run_fdp(scores[coins], scores[~coins], delta=1e-5, family="gdp")
        >>> 0.5 < bound.parameter < 2.0
        True
    """
    if family not in ("gdp", "approx"):
        raise PrivacyConfigError(f"`one_run_fdp(family={family!r})`: family must be 'gdp' or 'approx'.")
    if not 0.0 < significance < 1.0:
        raise PrivacyConfigError(f"`one_run_fdp(significance={significance!r})`: must be in (0, 1), e.g. 0.05.")
    if not 0.0 <= delta < 1.0:
        raise PrivacyConfigError(f"`one_run_fdp(delta={delta!r})`: must be in [0, 1), e.g. 1e-5.")
    counts = guess_counts(in_scores, out_scores, fractions)
    m = int(np.asarray(in_scores).size + np.asarray(out_scores).size)
    tau = significance / len(counts)
    best = FdpBound(family, 0.0, 0.0, 0, 0)
    for guesses, correct in counts:

        def rejects(value: float, k: int = guesses, c: int = correct) -> bool:
            curve = gdp_inverse_blow_up(value) if family == "gdp" else approx_dp_inverse_blow_up(value, delta)
            return fdp_rejects(curve, m, k, c, tau)

        param = _largest_rejected(rejects, ceiling=64.0)
        eps = param if family == "approx" else (gdp_epsilon(param, delta) if param > 0 else 0.0)
        if param > best.parameter:
            best = FdpBound(family, param, eps, guesses, correct)
    return best


# ---------------------------------------------------------------------------------------------------- the join
def join_by_id(
    membership: Sequence[tuple[Hashable, bool]], scores: Sequence[tuple[Hashable, float]]
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(in-scores, out-scores): each canary's score joined to its coin **by identifier**; fails closed.

    Raises `PrivacyStateError` when an identifier is duplicated on either side, a canary has no score, or a score
    belongs to no canary: an audit whose scores are not the canaries' is no audit, whatever number it would print.

    Example:
        >>> join_by_id([("a", True), ("b", False)], [("b", -1.0), ("a", 2.0)])
        (array([2.]), array([-1.]))
        >>> join_by_id([("a", True), ("b", False)], [("a", 2.0)])
        Traceback (most recent call last):
        ...
        lightning_dp.errors.PrivacyStateError: `join_by_id`: 1 canary without a score (['b'])...
    """
    coins: dict[Hashable, bool] = {}
    seen: dict[Hashable, float] = {}
    duplicated: list[Hashable] = []
    for cid, coin in membership:
        if cid in coins:
            duplicated.append(cid)
        coins[cid] = bool(coin)
    for cid, score in scores:
        if cid in seen:
            duplicated.append(cid)
        seen[cid] = float(score)
    missing = [cid for cid in coins if cid not in seen]
    extra = [cid for cid in seen if cid not in coins]
    problems = []
    if duplicated:
        problems.append(f"{len(duplicated)} identifier(s) given twice ({duplicated[:5]})")
    if missing:
        problems.append(f"{len(missing)} canary without a score ({missing[:5]})")
    if extra:
        problems.append(f"{len(extra)} score(s) for no canary ({extra[:5]})")
    if problems:
        raise PrivacyStateError(
            f"`join_by_id`: {'; '.join(problems)}. The scores must be exactly one per canary, keyed by the canary's "
            "patient id. HINT: score every canary of the table the coins were drawn for, once."
        )
    values = np.asarray([seen[cid] for cid in coins], dtype=np.float64)
    inside = np.asarray([coins[cid] for cid in coins], dtype=bool)
    if not np.all(np.isfinite(values)):
        raise PrivacyStateError(f"`join_by_id`: {int(np.sum(~np.isfinite(values)))} scores are not finite.")
    return values[inside], values[~inside]


# ---------------------------------------------------------------------------------------------------- the audit
class _CanaryPatients(Dataset[tuple[Tensor, Tensor, Tensor]]):
    """The included canary patients: patient ``ids[j]`` has ``images`` images, each the basis vector e_{columns[j]}.

    Images are built when fetched (m·k·m floats would not fit for large m). The P3SGD interface:
    ``patient_to_indices`` (keyed by the patients' own ids) and ``num_patients``.
    """

    def __init__(self, ids: Sequence[str], columns: Sequence[int], images: int, dim: int, weight: float) -> None:
        self.dim, self.weight = dim, weight
        self.columns = [c for c in columns for _ in range(images)]
        self.patient_to_indices = {pid: list(range(j * images, (j + 1) * images)) for j, pid in enumerate(ids)}
        self.num_patients = len(ids)

    def __len__(self) -> int:
        return len(self.columns)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        x = torch.zeros(self.dim)
        x[self.columns[i]] = 1.0
        return x, torch.tensor(0), torch.tensor(self.weight)


@dataclass
class OneRunAuditResult:
    """What a one-run audit measured. ``passed``: no lower bound exceeds the printed ε.

    ``epsilon_printed`` is the ε the run's accountant reports for the run's ledger; ``snj``, ``fdp`` and ``gdp``
    the three lower bounds (module docstring), ``mu_lower`` the rejected GDP μ and ``mu_configured`` √(Σ_t 1/z_t²),
    the μ of the configured mechanism at q = 1 (NaN for q < 1, where the curve is not Gaussian). ``mean_in`` and
    ``mean_out`` are the scores' means, ``sd_out`` their spread: for gradient canaries in units of C (T·q and 0 on
    correct code, sd √T·z at q = 1), for loss scores in nats.

    ``mechanism`` names what was audited (the `P3SGD` callback, or federated P3SGD through Flower and where its noise
    is added), ``scoring`` how the canaries were scored: ``"gradient"`` (white-box gradient canaries, read from the
    released θ) or ``"loss"`` (black-box: input-space canaries, each scored by the released model's loss on it).
    ``sites`` is the number of hospitals (federated; 0 otherwise), ``population`` the ordinary patients trained
    beside the canaries and ``population_accuracy`` the released model's accuracy on fresh draws of their task (loss
    scoring; NaN otherwise).
    """

    canaries: int
    included: int
    images_per_patient: int
    steps: int
    sample_rate: float
    noise_multiplier: float
    delta: float
    significance: float
    accountant: str
    epsilon_printed: float
    snj_epsilon: float
    snj_guesses: int
    fdp_epsilon: float
    fdp_guesses: int
    gdp_epsilon: float
    mu_lower: float
    mu_configured: float
    gdp_guesses: int
    mean_in: float
    mean_out: float
    sd_out: float
    seconds: float
    round_path: str
    mechanism: str = "P3SGD callback"
    scoring: Literal["gradient", "loss"] = "gradient"
    sites: int = 0
    population: int = 0
    population_accuracy: float = math.nan

    @property
    def epsilon_lower(self) -> float:
        """The largest of the three lower bounds."""
        return max(self.snj_epsilon, self.fdp_epsilon, self.gdp_epsilon)

    @property
    def passed(self) -> bool:
        return self.epsilon_lower <= self.epsilon_printed

    def ratio(self, bound: Literal["snj", "fdp", "gdp"]) -> float:
        """ε_lower / ε_printed for one bound (1 is a perfectly tight audit)."""
        value = {"snj": self.snj_epsilon, "fdp": self.fdp_epsilon, "gdp": self.gdp_epsilon}[bound]
        return value / self.epsilon_printed if self.epsilon_printed > 0 else math.inf

    @property
    def kind(self) -> str:
        """What kind of audit this was, in words."""
        if self.scoring == "loss":
            return (
                "one-run black-box audit, input-space canary patients scored by the released model's loss, "
                + self.mechanism
            )
        return f"one-run white-box audit, gradient-canary patients, {self.mechanism}"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            epsilon_lower=self.epsilon_lower,
            passed=self.passed,
            ratio_snj=self.ratio("snj"),
            ratio_fdp=self.ratio("fdp"),
            ratio_gdp=self.ratio("gdp"),
            kind=self.kind,
        )
        return out

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED: a lower bound exceeds the printed ε"
        scores = "gradient canaries" if self.scoring == "gradient" else "loss scores"
        return (
            f"{self.mechanism}, one run, {self.canaries} canary patients ({self.included} in; {scores}), "
            f"T={self.steps}, q={self.sample_rate}, z={self.noise_multiplier:.3f}: ε_printed "
            f"{self.epsilon_printed:.2f} [{self.accountant}] at δ={self.delta:g}; ε_lower SNJ {self.snj_epsilon:.2f}, "
            f"f-DP (ε,δ) {self.fdp_epsilon:.2f}, GDP {self.gdp_epsilon:.2f} "
            f"(μ_lower {self.mu_lower:.3f} vs configured {self.mu_configured:.3f}): {verdict}."
        )


class _OneRunDesign:
    """What every one-run audit shares: the m canary patients, their secret coins, the run's noise, the three bounds.

    The subclasses differ in what they train (the `P3SGD` callback, or federated P3SGD through Flower) and in how they
    score a canary (its gradient direction in the released θ, or the released model's loss on it); the coins, the
    calibration of z, the join by id and the bounds are these, once. Arguments as `OneRunAudit` documents them.
    """

    owner = "OneRunAudit"

    def __init__(
        self,
        *,
        canaries: int,
        images_per_patient: int,
        steps: int,
        noise_multiplier: float | None,
        target_epsilon: float | None,
        sample_rate: float,
        clip_norm: float,
        delta: float,
        accountant: Literal["rdp", "prv"],
        significance: float,
        coin_seed: int | None,
        seed: int | None,
        local_lr: float,
    ) -> None:
        owner = self.owner
        self.canaries = check_count(owner, "canaries", canaries, "e.g. 1000 canary patients.", minimum=10)
        self.images_per_patient = check_count(owner, "images_per_patient", images_per_patient, "e.g. 4.", minimum=1)
        self.steps = check_count(owner, "steps", steps, "e.g. 4.", minimum=1)
        self.sample_rate = check_sample_rate(owner, sample_rate)
        self.clip_norm = check_finite_positive(owner, "clip_norm", clip_norm, "e.g. 1.0.")
        if not 0.0 < delta < 1.0:
            raise PrivacyConfigError(f"`{owner}(delta={delta!r})`: delta must be in (0, 1), e.g. 1e-5.")
        self.delta = float(delta)
        if accountant not in ("rdp", "prv"):
            raise PrivacyConfigError(f"`{owner}(accountant={accountant!r})`: the accountant is 'rdp' or 'prv'.")
        self.accountant: Literal["rdp", "prv"] = accountant
        if not 0.0 < significance < 1.0:
            raise PrivacyConfigError(f"`{owner}(significance={significance!r})`: must be in (0, 1), e.g. 0.05.")
        self.significance = float(significance)
        if (noise_multiplier is None) == (target_epsilon is None):
            raise PrivacyConfigError(
                f"`{owner}(noise_multiplier={noise_multiplier}, target_epsilon={target_epsilon})`: give exactly one. "
                "HINT: target_epsilon=4.0 calibrates z with the chosen accountant."
            )
        if noise_multiplier is None:
            assert target_epsilon is not None
            target = check_finite_positive(owner, "target_epsilon", target_epsilon, "e.g. 4.0.")
            noise_multiplier = calibrate_noise_multiplier(target, self.delta, self.sample_rate, self.steps, accountant)
        self.noise_multiplier = check_finite_positive(owner, "noise_multiplier", noise_multiplier, "e.g. 1.0.")
        self.coin_seed = secure_seed("audit") if coin_seed is None else int(coin_seed)
        self.seed = secure_seed("audit") if seed is None else int(seed)
        self.local_lr = check_finite_positive(owner, "local_lr", local_lr, "e.g. 0.1.")

    # ------------------------------------------------------------------ the canaries
    def canary_ids(self) -> list[str]:
        """The canaries' patient ids; canary i's direction (or image) is the i-th."""
        width = len(str(self.canaries - 1))
        return [f"canary-{i:0{width}d}" for i in range(self.canaries)]

    def coins(self) -> list[tuple[str, bool]]:
        """(patient id, in?) for every canary: independent fair coins from ``coin_seed`` (secret by default)."""
        generator = torch.Generator().manual_seed(self.coin_seed)
        draws = torch.rand(self.canaries, generator=generator, dtype=torch.float64) < 0.5
        return list(zip(self.canary_ids(), draws.tolist()))

    def _included(self, membership: Sequence[tuple[str, bool]]) -> list[str]:
        included = [pid for pid, coin in membership if coin]
        if not included:
            raise PrivacyStateError(f"`{self.owner}`: no canary came up 'in'. HINT: use more canaries.")
        return included

    # ------------------------------------------------------------------ the bounds
    def _result(
        self,
        membership: Sequence[tuple[Hashable, bool]],
        scores: Sequence[tuple[Hashable, float]],
        *,
        epsilon_printed: float,
        accountant: str,
        started: float,
        round_path: str,
        mechanism: str,
        scoring: Literal["gradient", "loss"],
        sites: int = 0,
        population: int = 0,
        population_accuracy: float = math.nan,
    ) -> OneRunAuditResult:
        """Joins the scores to the coins by id (failing closed), computes the three bounds, builds the result."""
        in_scores, out_scores = join_by_id(membership, scores)
        snj, snj_guesses = epsilon_one_run(in_scores, out_scores, delta=self.delta, significance=self.significance)
        fdp = one_run_fdp(in_scores, out_scores, family="approx", delta=self.delta, significance=self.significance)
        gdp = one_run_fdp(in_scores, out_scores, family="gdp", delta=self.delta, significance=self.significance)
        mu_configured = math.sqrt(self.steps) / self.noise_multiplier if self.sample_rate == 1.0 else math.nan
        return OneRunAuditResult(
            canaries=self.canaries,
            included=int(in_scores.size),
            images_per_patient=self.images_per_patient,
            steps=self.steps,
            sample_rate=self.sample_rate,
            noise_multiplier=self.noise_multiplier,
            delta=self.delta,
            significance=self.significance,
            accountant=accountant,
            epsilon_printed=float(epsilon_printed),
            snj_epsilon=float(snj),
            snj_guesses=int(snj_guesses),
            fdp_epsilon=fdp.epsilon,
            fdp_guesses=fdp.guesses,
            gdp_epsilon=gdp.epsilon,
            mu_lower=gdp.parameter,
            mu_configured=mu_configured,
            gdp_guesses=gdp.guesses,
            mean_in=float(in_scores.mean()),
            mean_out=float(out_scores.mean()) if out_scores.size else math.nan,
            sd_out=float(out_scores.std(ddof=1)) if out_scores.size > 1 else math.nan,
            seconds=time.perf_counter() - started,
            round_path=round_path,
            mechanism=mechanism,
            scoring=scoring,
            sites=sites,
            population=population,
            population_accuracy=population_accuracy,
        )


class _GradientCanaries(_OneRunDesign):
    """The white-box gradient canaries (module docstring): the model, the canary patients' data, the score.

    Shared by `OneRunAudit` (the `P3SGD` callback) and `lightning_dp.audit.one_run_federated.FederatedOneRunAudit`
    (federated P3SGD through Flower): both release θ_{t+1} = θ_t + server_lr·(Σ clipped + noise)/(q·m).
    """

    canary_weight: float

    def model(self) -> nn.Module:
        """The audited model: Linear(m → 2, no bias), starting at 0 (public)."""
        linear = nn.Linear(self.canaries, 2, bias=False)
        nn.init.zeros_(linear.weight)
        return linear

    def canary_data(self, ids: Sequence[str]) -> _CanaryPatients:
        """The canary patients ``ids`` (their images are the basis vectors of their columns), as P3SGD reads them."""
        columns = {pid: i for i, pid in enumerate(self.canary_ids())}
        return _CanaryPatients(
            ids, [columns[pid] for pid in ids], self.images_per_patient, self.canaries, self.canary_weight
        )

    def scores(self, theta_0: Tensor, theta_T: Tensor) -> list[tuple[str, float]]:  # noqa: N803 - θ_T
        """(patient id, s_i) for every canary: the released sum along u_i, in units of C (module docstring)."""
        m = self.canaries
        released = (theta_T.double() - theta_0.double()).view(2, m) * (self.sample_rate * m)  # server_lr = 1
        along = (released[0] - released[1]) / (math.sqrt(2.0) * self.clip_norm)
        return list(zip(self.canary_ids(), along.tolist()))


class OneRunAudit(_GradientCanaries):
    """One P3SGD run with m canary patients, each in by a secret fair coin; three ε lower bounds (module docstring).

    Args:
        canaries: m, the number of canary patients (1,000 or more for a useful bound).
        images_per_patient: images of each canary patient (all of them in one local mini-batch).
        steps: T, the rounds of the run.
        noise_multiplier: z; or None with ``target_epsilon``.
        target_epsilon: calibrate z so that the run's printed ε is this (the callback's accountant, at δ).
        sample_rate: q of the callback (1.0, the default, is the tightest audit).
        clip_norm: C.
        delta: δ of the ledger and of every bound.
        accountant: the callback's accountant (``"rdp"`` or ``"prv"``): it prints ε_printed.
        significance: each bound holds with probability ≥ 1 − significance.
        coin_seed: seeds the coins; None (default) draws the seed from the OS CSPRNG (`secure_seed`), so that nothing
            in the configuration predicts which canaries are in.
        seed: seeds the callback's sampler and noise; None draws them from the OS CSPRNG.
        canary_weight: the canaries' loss weight (their local updates must be far above C).
        local_lr: the local SGD's rate.

    Example:
        >>> audit = OneRunAudit(canaries=1000, steps=2, target_epsilon=8.0, coin_seed=0, seed=0)
        >>> result = audit.run()  # doctest: +SKIP
        >>> result.passed, result.gdp_epsilon > 0.3 * result.epsilon_printed  # doctest: +SKIP
        (True, True)
    """

    owner = "OneRunAudit"

    def __init__(
        self,
        *,
        canaries: int = 1000,
        images_per_patient: int = 4,
        steps: int = 4,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        sample_rate: float = 1.0,
        clip_norm: float = 1.0,
        delta: float = 1e-5,
        accountant: Literal["rdp", "prv"] = "rdp",
        significance: float = 0.05,
        coin_seed: int | None = None,
        seed: int | None = None,
        canary_weight: float = 100.0,
        local_lr: float = 0.1,
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
            accountant=accountant,
            significance=significance,
            coin_seed=coin_seed,
            seed=seed,
            local_lr=local_lr,
        )
        self.canary_weight = check_finite_positive(self.owner, "canary_weight", canary_weight, "e.g. 100.")

    def callback(self) -> Any:
        """The P3SGD callback as configured (the public m declared as N)."""
        from lightning_dp.callbacks.p3sgd import P3SGD

        return P3SGD(
            sample_rate=self.sample_rate,
            clip_norm=self.clip_norm,
            noise_scales=(self.noise_multiplier,),
            local_lr=self.local_lr,
            local_batch_size=self.images_per_patient,
            server_lr=1.0,
            delta=self.delta,
            accountant=self.accountant,
            seed=self.seed,
            vectorize="auto",
            num_patients=self.canaries,
        )

    # ------------------------------------------------------------------ the run
    def run(self) -> OneRunAuditResult:
        """Draws the coins, trains once, scores every canary by id, joins, bounds."""
        start = time.perf_counter()
        membership = self.coins()
        data = self.canary_data(self._included(membership))
        callback = self.callback()
        with warnings.catch_warnings():
            # the declared N (m) differs from the patients the coins let in, by design: the note is for data holders
            warnings.filterwarnings("ignore", category=PrivacyWarning)
            observer = fit_world(self.model(), callback, data, self.local_lr, self.steps, {}, self.canaries)
        if len(observer.thetas) != self.steps + 1:
            raise PrivacyStateError(f"`OneRunAudit`: the run made {len(observer.thetas) - 1} of {self.steps} rounds.")
        return self._result(
            membership,
            self.scores(observer.thetas[0], observer.thetas[-1]),
            epsilon_printed=float(callback.accountant.epsilon(callback.ledger)),
            accountant=self.accountant,
            started=start,
            round_path=str(callback.round_path),
            mechanism="P3SGD callback",
            scoring="gradient",
        )
