"""Black-box membership inference: it finds the leak of a non-private run, and stays below a DP run's ε.

Tolerance: the bounds hold with probability ≥ 95 % each (Clopper–Pearson / Steinke et al.'s p-value);
the seeds are fixed, so the assertions are deterministic.

Patient level (P3SGD): 8 runs × 32 canary patients of 16 images, 32 ordinary patients, q = 0.2. Measured
(seed 0): non-private ε_lower 2.93 (ceiling 3.71); P3SGD at z = 6, 40 rounds ε_lower 0.00 ≤ ε_upper 0.886.
The same patients trained by sample-level DP-SGD at the same q, z, T (so the same ε_upper 0.886, per
sample) give a patient-level ε_lower of 2.06 (seeds 1, 2: 1.92, 1.76), while a sample-level canary audit of
that DP-SGD finds 0.00.
"""

import pytest
import torch

from lightning_dp.accounting import GaussianEvent, PoissonSampledEvent
from lightning_dp.audit.blackbox import MembershipAudit
from lightning_dp.errors import PrivacyConfigError

pytestmark = pytest.mark.statistical

SMALL = dict(runs=8, canaries=32, sample_rate=0.2, lr=1.0, features=32, hidden=128, population=128, seed=0)
PATIENTS = dict(SMALL, level="patient", images_per_patient=16, population=32)


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


def test_patient_level_non_private_training_leaks_and_the_attack_sees_it():
    result = MembershipAudit(private=False, steps=60, **PATIENTS).run()
    assert (result.level, result.training, result.images_per_patient) == ("patient", "patient", 16)
    assert result.epsilon_one_run > 2.0, result  # measured 2.93
    assert result.epsilon_one_run <= result.one_run_ceiling
    assert result.epsilon_upper == float("inf")


def test_p3sgd_stays_below_its_patient_level_epsilon():
    result = MembershipAudit(private=True, noise_multiplier=6.0, steps=40, **PATIENTS).run()
    assert result.epsilon_upper < 1.0  # measured 0.886: the same guarantee the DP-SGD run below gets per sample
    assert result.passed, result
    assert len(result.in_scores) + len(result.out_scores) == PATIENTS["runs"] * PATIENTS["canaries"]


def test_sample_level_dpsgd_leaks_patients_beyond_its_sample_level_epsilon():
    # The point of the patient level: DP-SGD's per-sample ε says little about a patient's 16 images.
    common = dict(private=True, noise_multiplier=6.0, steps=40)
    patients = MembershipAudit(training="sample", **common, **PATIENTS).run()
    samples = MembershipAudit(**common, **dict(SMALL, population=32 * 16)).run()  # as many ordinary images
    assert patients.epsilon_upper == pytest.approx(samples.epsilon_upper) and patients.epsilon_upper < 1.0
    assert not patients.passed, patients  # measured ε_lower 2.06 > ε_upper 0.886 (per sample)
    assert patients.epsilon_lower > samples.epsilon_lower + 1.0, (patients, samples)  # measured 2.06 vs 0.00


def test_patient_level_training_charges_a_patient_ledger_once_per_round():
    tiny = dict(level="patient", images_per_patient=3, local_steps=2, noise_multiplier=2.0, sample_rate=0.5, steps=3)
    tiny.update(runs=4, canaries=2, population=4, features=4, hidden=8, seed=0)
    audit = MembershipAudit(**tiny)
    x, y, cx, cy = audit.dataset()
    assert x.shape == (4, 3, 4) and cx.shape == (4, 2, 3, 4)
    assert bool((cy == cy[..., :1]).all())  # one (wrong) label per canary patient
    _, ledger = audit.train(0, x, y)
    assert ledger.unit == "patient"
    assert ledger.entries == ((PoissonSampledEvent(0.5, GaussianEvent(2.0)), 3),)
    _, ledger = MembershipAudit(training="sample", **tiny).train(0, x, y)  # the same patients' 12 images, DP-SGD
    assert ledger.unit == "sample" and ledger.steps == 3


def test_bad_configuration_is_named():
    with pytest.raises(PrivacyConfigError, match="runs"):
        MembershipAudit(runs=1)
    with pytest.raises(PrivacyConfigError, match="accountant"):
        MembershipAudit(accountant="moments")  # type: ignore[arg-type]
    with pytest.raises(PrivacyConfigError, match="level"):
        MembershipAudit(level="image")  # type: ignore[arg-type]
    with pytest.raises(PrivacyConfigError, match="needs level='patient'"):
        MembershipAudit(level="sample", training="patient")
    with pytest.raises(PrivacyConfigError, match="images_per_patient"):
        MembershipAudit(level="patient", images_per_patient=0)
    with pytest.raises(PrivacyConfigError, match="local_steps"):
        MembershipAudit(level="patient", local_steps=0)
