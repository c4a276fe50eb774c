"""The white-box callback audit on a CUDA device: every scenario passes there, and a planted bug is caught there.

The CPU twins are tests/statistical/test_audit_callbacks.py (the same scenarios, the same assertions, the same
seeds); here the callbacks train on the GPU (``accelerator="gpu"``) while the auditor's float64 reference runs on
the CPU. The noise is drawn on the device from the callbacks' own generators, so the draws differ from the CPU
run's: the tolerances are the statistical ones of the CPU tests (ε_lower ≤ ε_upper at 95 %, the noise checks at
1e-3 each), not bit-for-bit equality.
"""

from __future__ import annotations

import pytest

from lightning_dp.audit.mutants import MUTANTS
from tests.statistical.test_audit_callbacks import SCENARIOS, STEPS, margin

pytestmark = [pytest.mark.statistical, pytest.mark.gpu]

ON_GPU = {"accelerator": "gpu", "devices": 1}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_correct_callbacks_pass_and_see_the_canary_on_cuda(scenario: str) -> None:
    audit = SCENARIOS[scenario](STEPS)
    audit.trainer_kwargs = dict(ON_GPU)
    result = audit.run()
    assert result.passed, margin(result)
    assert abs(result.beta - 1.0) < 0.5, margin(result)
    if scenario != "P3SGD-selection":
        assert result.noise_sd == pytest.approx(0.5, rel=0.1), margin(result)
    assert result.canary_norm > 0.9 and result.population_clipped == 0.0, margin(result)
    assert result.noise_fresh and not result.changed_state, margin(result)
    assert all(check.passed for check in result.checks), margin(result)


def test_noise_std_over_sqrt2_is_caught_on_cuda() -> None:
    mutant = next(m for m in MUTANTS if m.name == "noise std / √2")
    with mutant.applied():
        audit = SCENARIOS["DPSGD"](mutant.steps)
        audit.trainer_kwargs = dict(ON_GPU)
        result = audit.run()
    assert not result.passed, margin(result)
    assert mutant.check in result.failed, margin(result)
