"""lightning-dp: differentially private training of medical-imaging models in PyTorch Lightning."""

from lightning_dp.accounting import (
    PrivacyLedger,
    RDPAccountant,
    calibrate_noise_multiplier,
    calibrate_steps,
    get_accountant,
)
from lightning_dp.checkpoints import publishable_checkpoint
from lightning_dp.epsilon import get_epsilon
from lightning_dp.errors import (
    PrivacyBudgetExceededError,
    PrivacyConfigError,
    PrivacyStateError,
    PrivacyWarning,
    UnsupportedEventError,
)

__version__ = "0.1.0"

__all__ = [
    "PrivacyBudgetExceededError",
    "PrivacyConfigError",
    "PrivacyLedger",
    "PrivacyStateError",
    "PrivacyWarning",
    "RDPAccountant",
    "UnsupportedEventError",
    "__version__",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "get_accountant",
    "get_epsilon",
    "publishable_checkpoint",
]
