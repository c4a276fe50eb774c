"""The white-box audit of the federated round through Flower: correct code passes, every federated mutant is caught.

`federated_scenario`: three hospitals (5, 4, 6 patients), a canary patient at "a" whose update is far above C,
q = ½, C = 0.5, z = 1, 20 rounds per world, driven by `run_rounds` over `LocalGrid` and `site_app`. Tolerances (stated
in `lightning_dp.audit.federated`): sensitivity 0.02·C of fp32 round-off (measured ≤ 3e-6·C); each statistical check
(noise std, fresh noise, rate) false-alarms with probability ≤ 1e-3. The seeds are fixed, so every assertion is
deterministic.
"""

import pytest

from lightning_dp.audit import FederatedAudit
from lightning_dp.audit.mutants import MUTANTS
from lightning_dp.audit.scenarios import federated_scenario
from lightning_dp.errors import PrivacyConfigError

FEDERATED = [m for m in MUTANTS if "P3SGD-federated" in m.mechanisms]


def test_the_correct_federated_round_passes_and_sees_the_canary():
    result = federated_scenario().run()
    assert result.passed, result.summary()
    included = [m for m, inside in zip(result.moved, result.included) if inside]
    missed = [m for m, inside in zip(result.moved, result.included) if not inside]
    assert 0 < len(included) < result.rounds, result.summary()  # the canary joins some rounds, not all
    assert included == [pytest.approx(1.0, abs=1e-4)] * len(included)  # by exactly C: its clip is active
    assert missed == [pytest.approx(0.0, abs=1e-4)] * len(missed)  # the other patients' coins are the same
    assert max(result.excess) <= 1e-4 and result.site_moved == pytest.approx(result.moved, abs=1e-4)
    assert result.noise_ratio == pytest.approx(1.0, rel=0.05)
    assert result.reported_noise_std == [pytest.approx(1.0 * 0.5 / (0.5 * 16), rel=1e-12)] * result.rounds
    assert result.sample_rate == 0.5 and result.population_rate == pytest.approx(0.5, abs=0.1)
    assert result.epsilon > 0 and set(result.failed) == set()


@pytest.mark.parametrize("mutant", FEDERATED, ids=[m.name for m in FEDERATED])
def test_every_federated_mutant_is_caught(mutant):
    with mutant.applied():
        result = federated_scenario(rounds=mutant.steps).run()
    assert mutant.check in result.failed, f"{mutant.name} ({mutant.where}) not caught: {result.summary()}"
    if mutant.name == "site clips at 2·C":
        assert max(result.moved) == pytest.approx(2.0, abs=1e-3)  # its site sends the canary clipped to 2C
    if mutant.name == "server noise std / √2":
        assert result.noise_ratio == pytest.approx(2**-0.5, rel=0.05)
        assert result.check("sensitivity").passed and result.check("rate").passed
    if mutant.name == "sites sample at 2q":
        assert result.population_rate == 1.0 and result.canary_rate == 1.0  # 2q = 1
        assert result.check("sensitivity").passed and result.check("noise std").passed
    if mutant.name == "federated ledger charged at q/2":
        assert result.sample_rate == 0.25 and result.population_rate == pytest.approx(0.5, abs=0.1)
    if mutant.name == "federated normalizer from the sites' counts":
        assert max(result.excess) > 0.5  # the same noise, divided differently in the two worlds


def test_the_federated_mutants_restore_the_library():
    from lightning_dp.federated import FederatedServer, Site

    before = (Site.reply, Site.patients_of_round, FederatedServer._new_release, FederatedServer.normalizer)
    for mutant in FEDERATED:
        with mutant.applied():
            assert (Site.reply, Site.patients_of_round, FederatedServer._new_release, FederatedServer.normalizer) != (
                before
            )
    assert (Site.reply, Site.patients_of_round, FederatedServer._new_release, FederatedServer.normalizer) == before


def test_an_audit_that_names_no_site_or_mismatched_tensors_is_refused():
    audit = federated_scenario(rounds=2)
    with pytest.raises(PrivacyConfigError, match=r"canary_site='z'.*no such site"):
        FederatedAudit(
            model=audit.model,
            sites=audit.sites,
            canary=audit.canary,
            canary_site="z",
            sample_rate=0.5,
            clip_norm=0.5,
            noise_multiplier=1.0,
        )
    x, y, patients = audit.sites["a"]
    with pytest.raises(PrivacyConfigError, match="site 'a' needs"):
        FederatedAudit(
            model=audit.model,
            sites={**audit.sites, "a": (x, y[:-1], patients)},
            canary=audit.canary,
            canary_site="a",
            sample_rate=0.5,
            clip_norm=0.5,
            noise_multiplier=1.0,
        )
