"""Black-box membership inference: it finds the leak of a non-private run, and stays below a DP run's ε.

Tolerance: the bounds hold with probability ≥ 95 % each (Clopper–Pearson / Steinke et al.'s p-value);
the seeds are fixed, so the assertions are deterministic.
"""

import pytest
import torch

from lightning_dp.audit.blackbox import MembershipAudit
from lightning_dp.errors import PrivacyConfigError

pytestmark = pytest.mark.statistical

SMALL = dict(runs=8, canaries=32, sample_rate=0.2, lr=1.0, features=32, hidden=128, population=128, seed=0)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_non_private_training_leaks_and_the_attack_sees_it():
    result = MembershipAudit(private=False, steps=200, **SMALL).run()
    assert result.epsilon_one_run > 2.0, result
    assert result.epsilon_one_run <= result.one_run_ceiling
    assert result.epsilon_upper == float("inf")


@pytest.mark.slow
def test_private_training_stays_below_its_epsilon():
    result = MembershipAudit(private=True, noise_multiplier=3.0, steps=40, **SMALL).run()
    assert result.epsilon_upper < 3.0  # a strong guarantee, so the comparison means something
    assert result.passed, result
    assert result.epsilon_one_run <= result.one_run_ceiling
    assert len(result.in_scores) + len(result.out_scores) == SMALL["runs"] * SMALL["canaries"]


def test_bad_configuration_is_named():
    with pytest.raises(PrivacyConfigError, match="runs"):
        MembershipAudit(runs=1)
    with pytest.raises(PrivacyConfigError, match="accountant"):
        MembershipAudit(accountant="moments")  # type: ignore[arg-type]
