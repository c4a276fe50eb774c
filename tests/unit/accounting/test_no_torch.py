"""The accounting layer is pure math: importing it and computing an RDP ε must not import torch."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import lightning_dp.accounting as a
from lightning_dp.schedules import ExponentialDecay

ledger = a.PrivacyLedger(unit="patient", delta=1e-5)
ledger.record(a.PoissonSampledEvent(0.04, a.GaussianEvent(1.5)), count=2250)
alone = a.PoissonSampledEvent(0.1, a.ExponentialMechanismEvent(0.316))
ledger.record(a.ComposedEvent((a.ZCDPEvent(0.005), alone)), count=10)
selection = a.ComposedEvent((a.GaussianEvent(1.0), a.ExponentialMechanismEvent(0.316, 2)))
ledger.record(a.PoissonSampledEvent(0.1, selection), count=10)
assert a.get_accountant("rdp").epsilon(ledger) > 0
assert a.get_accountant("moments").epsilon(ledger) > 0
assert a.calibrate_noise_multiplier(1.0, 1e-5, 0.01, 100) > 0
assert a.calibrate_steps(1.0, 1e-5, 0.01, ExponentialDecay(2.8, 0.99)) > 0
a.tcdp_plan_unchecked(0.01, 2.8, 0.99, 100, 1e-4)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "opacus", "pytorch_lightning", "lightning"})
assert not heavy, heavy
print("ok")
"""


def test_accounting_does_not_import_torch() -> None:
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.stdout.strip() == "ok"
