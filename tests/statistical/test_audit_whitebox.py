"""The white-box step audit has teeth: correct steps pass tightly, each known bug class is caught.

Tolerance: every ε_lower is a Clopper–Pearson bound at 95 % confidence (the threshold chosen on a
separate 20 % split of the runs); the seeds are fixed, so each assertion is deterministic, and at
these seeds the bounds sit well clear of the asserted lines (margins printed on failure).
"""

import pytest
import torch

from lightning_dp.accounting import PrivacyLedger
from lightning_dp.audit import StepAudit
from lightning_dp.errors import PrivacyConfigError
from lightning_dp.sanitization.release import Release
from lightning_dp.schedules import ExponentialDecay

pytestmark = pytest.mark.statistical

DPSGD = dict(level="sample", sample_rate=1.0, noise_multiplier=2.0, steps=4, trials=100_000, seed=3)
P3SGD = dict(
    level="patient",
    sample_rate=1.0,
    noise_multiplier=ExponentialDecay(initial=2.4, decay=0.8),
    steps=4,
    trials=100_000,
    population=10,
    seed=5,
)


def margin(result):
    return f"ε_lower {result.epsilon_lower:.3f} vs ε_upper {result.epsilon_upper:.3f} (GDP {result.epsilon_gdp:.3f})"


@pytest.mark.parametrize("config", [DPSGD, P3SGD], ids=["dpsgd", "p3sgd-decay"])
def test_correct_full_batch_steps_pass_tightly(config):
    result = StepAudit(**config).run()
    assert result.passed, margin(result)
    assert result.epsilon_lower >= 0.5 * result.epsilon_upper, margin(result)
    assert result.epsilon_gdp <= result.epsilon_upper, margin(result)
    assert len(result.in_scores) == len(result.out_scores) == config["trials"]


def test_subsampled_step_passes_and_still_sees_the_canary():
    result = StepAudit(sample_rate=0.5, noise_multiplier=1.0, steps=4, trials=100_000, seed=7).run()
    assert result.passed, margin(result)
    assert result.epsilon_lower >= 0.3 * result.epsilon_upper, margin(result)


@pytest.mark.parametrize("config", [DPSGD, P3SGD], ids=["dpsgd", "p3sgd-decay"])
def test_halved_noise_is_caught(config, monkeypatch):
    original = Release._gaussian
    monkeypatch.setattr(Release, "_gaussian", lambda self, like, std: original(self, like, std / 2))
    result = StepAudit(**config).run()
    assert not result.passed, margin(result)


def test_charging_one_step_in_four_is_caught(monkeypatch):
    original = PrivacyLedger.record
    calls: dict[int, int] = {}

    def record(self, event, count=1):
        calls[id(self)] = calls.get(id(self), 0) + 1
        if calls[id(self)] % 4 == 1:
            original(self, event, count)

    monkeypatch.setattr(PrivacyLedger, "record", record)
    result = StepAudit(**DPSGD).run()
    assert not result.passed, margin(result)


class RealizedBatch(StepAudit):
    """Bug: the update is divided by the realized number of units instead of the expected q·N."""

    def release_step(self, step, local_sums, counts, releases):
        reduced = torch.stack(local_sums).sum(dim=0)
        update = releases[0].release(step, reduced.flatten(), 1.0).update.view(self.trials, self.dim)
        return update / counts.clamp_min(1)[:, None]


def test_normalizing_by_the_realized_batch_is_caught():
    config = {**DPSGD, "trials": 200_000}
    assert StepAudit(others="opposed", **config).run().passed  # the same toy data, correct step
    result = RealizedBatch(others="opposed", **config).run()
    assert not result.passed, margin(result)


class PerRankNoise(StepAudit):
    """Each rank adds its own noise (independent generators) to its local sum before the reduction."""

    std_divisor: str = "world"

    def release_step(self, step, local_sums, counts, releases):
        total = 0
        k = len(releases)
        for rank, (release, local) in enumerate(zip(releases, local_sums)):
            release.generator.manual_seed(1000 * step + rank + self.seed)
            release.ledger.record(release.event(step))
            std = release.noise_multiplier(step) * release.clip_norm / self.normalizer
            std = std / k if self.std_divisor == "world" else std / k**0.5
            total = total + release._gaussian(local.flatten().float(), std) + local.flatten() / self.normalizer
        return total.view(self.trials, self.dim)


@pytest.mark.distributed
def test_ddp_noise_per_rank_without_rescaling_is_caught():
    # σ/world_size per rank, as if standard deviations added up: the total is σ/√world_size.
    result = PerRankNoise(world_size=4, **DPSGD).run()
    assert not result.passed, margin(result)


@pytest.mark.distributed
def test_ddp_correct_noise_passes():
    assert StepAudit(world_size=2, **DPSGD).run().passed  # shared generator, noise once on the reduced sum
    per_rank = PerRankNoise(world_size=4, **DPSGD)
    per_rank.std_divisor = "sqrt"  # σ/√world_size per rank: the total is σ, a correct (other) design
    assert per_rank.run().passed


def test_bad_configuration_is_named():
    with pytest.raises(PrivacyConfigError, match="opposed units need a full batch"):
        StepAudit(sample_rate=0.5, noise_multiplier=1.0, steps=2, others="opposed")
    with pytest.raises(PrivacyConfigError, match="level must be"):
        StepAudit(level="pixel", sample_rate=0.5, noise_multiplier=1.0, steps=2)  # type: ignore[arg-type]
    with pytest.raises(PrivacyConfigError, match="noise_multiplier must be a finite number"):
        StepAudit(sample_rate=0.5, noise_multiplier=-1.0, steps=2)
