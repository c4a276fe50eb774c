"""Noise at the sites, audited: each share's bug first shown to leak, then caught by `FederatedAudit`.

The leaks are measured on the library's own objects (three `Site` s with no patients, so each reply is its share
alone, and a `FederatedServer(noise_at="sites")` that releases their sum): the noise in the release against the
multiplier its ledger charged, and what an observer of two releases (or of the public settings) can subtract. The
audit runs `federated_scenario(noise_at="sites")`: three hospitals (5, 4, 6 patients), a canary at "a", q = ½,
C = 0.5, z = 1, each site's share z·C/√3, through Flower's messages over `LocalGrid` (plain, or summed by SecAgg+).

Tolerances: a measured sd over d = 5,050 coordinates and 4 rounds (20,200 values) has a relative standard error
of 1/√(2·20,200) ≈ 0.005; ±5 % is 10 standard errors. The cosine of two independent isotropic vectors in d = 5,050
dimensions has sd 1/√d ≈ 0.014; |cos| < 0.1 is 7 sd. The audit's statistical checks each false-alarm with
probability ≤ 1e-3 (stated in `lightning_dp.audit.federated`); the audits' seeds are fixed but the shares come from
the OS CSPRNG (as deployed), so a correct run fails a check with probability ≤ 4e-3 per audit.
"""

import math

import numpy as np
import pytest
import torch
from torch import nn

from lightning_dp.audit import FederatedAudit
from lightning_dp.audit.mutants import MUTANTS
from lightning_dp.audit.noise import noise_equals_ledger
from lightning_dp.audit.scenarios import federated_scenario
from lightning_dp.errors import PrivacyConfigError
from lightning_dp.federated import FederatedServer, Site, share_std
from lightning_dp.sanitization import ModelState
from lightning_dp.training.patient_rounds import LocalSGD, PatientData, RoundParts

Z, CLIP, NAMES = 1.0, 0.5, ("a", "b", "c")
SITES_MODES = ("P3SGD-federated-sites", "P3SGD-federated-secure", "P3SGD-federated-dropout")
SITES_MUTANTS = [(m, s) for m in MUTANTS for s in m.mechanisms if s in SITES_MODES]


def _mutant(name: str):
    return next(m for m in MUTANTS if m.name == name)


def _sites(seed: int = 0) -> list[Site]:
    """Three hospitals with no patients: each reply is the site's noise share alone (5,050 coordinates)."""
    out = []
    for k, name in enumerate(NAMES):
        net = nn.Linear(100, 50)
        parts = RoundParts(net, ModelState(net), lambda b, i: b, PatientData([], [], []), LocalSGD(), CLIP)
        out.append(Site(name, parts, sample_rate=0.5, seed=seed + k, noise_std=share_std(Z, CLIP, len(NAMES))))
    return out


def _releases(rounds: int, seed: int = 0) -> tuple[list[torch.Tensor], list[float]]:
    """The noise of each released update, D_t = (θ_{t+1} − θ_t)·q·N (the sums are zero), and the ledger's z_t·C."""
    server = FederatedServer(nn.Linear(100, 50), 100, 0.5, CLIP, noise=Z, noise_at="sites", sites=len(NAMES), seed=0)
    sites = _sites(seed)
    noise, charged = [], []
    for _ in range(rounds):
        theta = server.theta().clone()
        request = server.new_request()
        replies = {site.name: site.reply(theta, request) for site in sites}
        outcome = server.round(replies, {site.name: site.noise_std for site in sites})
        assert outcome.result is not None and not outcome.refused
        noise.append((server.theta().double() - theta.double()) * server.normalizer)
        charged.append(outcome.result.released.noise_std * server.normalizer)
    return noise, charged


def _sd_ratio(noise: list[torch.Tensor], charged: list[float]) -> float:
    return math.sqrt(sum(float((n / c).pow(2).mean()) for n, c in zip(noise, charged)) / len(noise))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a.double(), b.double()) / (a.double().norm() * b.double().norm()))


# ------------------------------------------------------------------ the leaks, measured without the audit
def test_the_default_shares_sum_to_the_charged_noise_and_differ_between_rounds_and_runs():
    noise, charged = _releases(4)
    assert charged == [pytest.approx(Z * CLIP, rel=1e-12)] * 4  # all three shares arrived: z, not less
    assert _sd_ratio(noise, charged) == pytest.approx(1.0, rel=0.05)
    assert abs(_cos(noise[0], noise[1])) < 0.1  # consecutive rounds: fresh
    one, two = _sites(seed=0), _sites(seed=0)  # two runs of one public config, even with the same secret seeds
    assert abs(_cos(one[0].noise_share(5050, 0), two[0].noise_share(5050, 0))) < 0.1
    assert abs(_cos(one[0].noise_share(5050, 0), one[1].noise_share(5050, 0))) < 0.1  # two sites


def test_pairwise_cancelling_shares_leave_a_third_of_the_charged_variance():
    with _mutant("site shares cancel pairwise").applied():
        noise, charged = _releases(4)
        site_a, site_b, _ = _sites()
        a, b = site_a.noise_share(5050, 0), site_b.noise_share(5050, 0)
    assert float(a.std()) == pytest.approx(share_std(Z, CLIP, 3), rel=0.05)  # each share alone has the planned size
    assert float((a + b).abs().max()) == 0.0  # but a's and b's cancel exactly
    assert _sd_ratio(noise, charged) == pytest.approx(3**-0.5, rel=0.05)  # the ledger charges z, z/√3 is present


def test_a_share_reused_across_rounds_cancels_in_the_difference_of_two_releases():
    with _mutant("site share reused across rounds").applied():
        noise, charged = _releases(2)
    assert _sd_ratio(noise, charged) == pytest.approx(1.0, rel=0.05)  # each release alone carries its noise
    # An observer of θ_0, θ_1, θ_2 reads S_1 − S_0 without noise: the second difference leaves fp32 round-off only
    # (fresh shares would leave noise of sd √2·z·C there).
    assert float((noise[1] - noise[0]).abs().max()) < 1e-4 * Z * CLIP


def test_a_share_seeded_from_the_round_is_regenerated_by_anyone():
    with _mutant("site share seeded from the round").applied():
        noise, charged = _releases(2, seed=0)
        again, _ = _releases(2, seed=7)  # another run: other secret seeds
        observer = _sites(seed=123)  # anyone with the public settings (names, z, C, m) and the round number
        regenerated = [sum(site.noise_share(5050, t) for site in observer) for t in range(2)]
    assert _sd_ratio(noise, charged) == pytest.approx(1.0, rel=0.05)  # the right size, and fresh across rounds
    assert abs(_cos(noise[0], noise[1])) < 0.1
    assert _cos(noise[0], again[0]) > 0.999_99  # two runs release the same noise
    for t in range(2):
        assert isinstance(regenerated[t], torch.Tensor)
        assert float((noise[t] - regenerated[t]).abs().max()) < 1e-4 * Z * CLIP  # subtracted: no noise is left


# ------------------------------------------------------------------ the audit
def test_the_correct_round_with_noise_at_the_sites_passes_and_measures_the_shares():
    result = federated_scenario(noise_at="sites").run()
    assert result.passed, result.summary()
    assert set(c.name for c in result.checks) == {"sensitivity", "noise std", "share std", "fresh noise", "rate"}
    included = [m for m, inside in zip(result.moved, result.included) if inside]
    assert 0 < len(included) < result.rounds and included == [pytest.approx(1.0, abs=1e-4)] * len(included)
    assert max(result.excess) <= 1e-4  # the server summed what the sites sent, in both worlds alike
    assert result.noise_ratio == pytest.approx(1.0, rel=0.05)  # 6,160 values: relative standard error 0.009
    assert result.share_ratio == pytest.approx(1.0, rel=0.05)
    assert result.shares.shape == (2, 20, 3, 154) and result.shares_summed == [3] * 20
    assert result.reported_noise_std == [pytest.approx(Z * CLIP / (0.5 * 16), rel=1e-12)] * result.rounds


def test_the_correct_round_through_secure_aggregation_passes():
    result = federated_scenario(rounds=8, noise_at="sites", secure_aggregation=True).run()
    assert result.passed, result.summary()
    assert result.secure_aggregation and result.shares_summed == [3] * 8
    assert max(result.excess) <= 1e-3  # SecAgg+'s quantization: ≤ 3·11.5/2²² ≈ 8e-6 per coordinate, 154 of them


def test_a_round_with_a_share_missing_is_held_to_the_charge_of_the_shares_that_arrived():
    result = federated_scenario(noise_at="sites", drop={"c": list(range(1, 20, 2))}).run()
    assert result.passed, result.summary()
    assert result.shares_summed == [3, 2] * 10
    planned = Z * CLIP / (0.5 * 16)
    assert result.reported_noise_std == [pytest.approx(planned), pytest.approx(planned * (2 / 3) ** 0.5)] * 10


@pytest.mark.parametrize(("mutant", "scenario"), SITES_MUTANTS, ids=[f"{m.name}-{s}" for m, s in SITES_MUTANTS])
def test_every_noise_at_the_sites_mutant_is_caught(mutant, scenario):
    secure, dropout = scenario.endswith("secure"), scenario.endswith("dropout")
    rounds = mutant.steps if not secure else 10
    with mutant.applied():
        audit = federated_scenario(
            rounds=rounds,
            noise_at="sites",
            secure_aggregation=secure,
            drop={"c": list(range(1, rounds, 2))} if dropout else None,
        )
        result = audit.run()
    assert mutant.check in result.failed, f"{mutant.name} ({mutant.where}) not caught: {result.summary()}"
    assert result.check("sensitivity").passed and result.check("rate").passed  # the bug is in the noise alone
    fresh = result.check("fresh noise")
    if mutant.name == "site shares cancel pairwise":
        assert result.noise_ratio == pytest.approx(3**-0.5, rel=0.1)  # only the unpaired site's share is left
        assert result.share_ratio == pytest.approx(1.0, rel=0.1)  # each share alone has the declared size
    if mutant.name == "site share reused across rounds":
        assert fresh.statistic == pytest.approx(1.0, abs=1e-9)
    if mutant.name == "site share seeded from the round":
        # Within a run everything is right: the sum's size and freshness within each world (each at false-alarm
        # probability 1e-3). Only the two worlds, two runs that draw their shares independently, show it: had the
        # audit held the shares equal between the worlds, this mutant would pass. (Both worlds' copies of one share
        # also over-disperse the χ² tests that pool the worlds, which may fail too.)
        in_world = result.residual[: result.rounds]
        assert noise_equals_ledger(in_world, np.full(result.rounds, Z), [("all", 154)], 1e-3).passed
        assert fresh.statistic == pytest.approx(1.0, abs=1e-9) and "(in world) and" in fresh.worst
        assert "(out world)" in fresh.worst and fresh.worst.split(" (in world)")[0] in fresh.worst.split(" and ")[1]
        rows = torch.from_numpy(result.shares[0].reshape(-1, 154))  # the "in" world's shares alone
        unit = rows / rows.norm(dim=1, keepdim=True)
        gram = (unit @ unit.T).abs() - torch.eye(len(rows), dtype=rows.dtype)
        assert float(gram.max()) < fresh.limit
    if mutant.name == "missing shares charged as present":
        assert result.check("fresh noise").passed and result.check("share std").passed
        assert result.reported_noise_std[1] == pytest.approx(result.reported_noise_std[0])  # z charged with 2 of 3


def test_the_share_mutants_restore_the_library():
    from lightning_dp.federated.server import SharedNoiseRelease

    before = (Site.noise_share, SharedNoiseRelease.noise_multiplier)
    for mutant, _ in SITES_MUTANTS:
        with mutant.applied():
            assert (Site.noise_share, SharedNoiseRelease.noise_multiplier) != before
    assert (Site.noise_share, SharedNoiseRelease.noise_multiplier) == before


def test_an_audit_of_secure_aggregation_without_the_noise_at_the_sites_or_with_dropouts_is_refused():
    audit = federated_scenario(rounds=2)
    common = dict(
        model=audit.model,
        sites=audit.sites,
        canary=audit.canary,
        canary_site="a",
        sample_rate=0.5,
        clip_norm=0.5,
        noise_multiplier=1.0,
    )
    with pytest.raises(PrivacyConfigError, match="SecAgg\\+ carries the sites' noise shares"):
        FederatedAudit(**common, secure_aggregation=True)
    with pytest.raises(PrivacyConfigError, match="dropouts are audited in plain rounds only"):
        FederatedAudit(**common, noise_at="sites", secure_aggregation=True, drop={"c": [1]})
    with pytest.raises(PrivacyConfigError, match=r"no such site \['z'\]"):
        FederatedAudit(**common, noise_at="sites", drop={"z": [1]})
    with pytest.raises(PrivacyConfigError, match="a round in which no site replies"):
        FederatedAudit(**common, rounds=2, noise_at="sites", drop={n: [0] for n in audit.sites})
