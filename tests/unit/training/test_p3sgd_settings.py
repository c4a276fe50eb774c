"""`P3SGDSettings`: P3SGD's argument checks outside the callback (issue 34: the constructor's checks moved here)."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_dp.callbacks import P3SGD
from lightning_dp.errors import PrivacyConfigError
from lightning_dp.schedules import ConstantNoise
from lightning_dp.training import LocalSGD, P3SGDSettings


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"sample_rate": 0.0}, "sample_rate"),
        ({"noise_schedule": 2.0}, "noise_schedule must be a NoiseSchedule"),
        ({"target_epsilon": 8.0, "accounting": "paper"}, "not a guarantee to calibrate to"),
        ({"noise_scales": (1.0, 2.0)}, "needs selection_epsilon"),
        ({"local_epochs": 0}, "local_epochs"),
        ({"accounting": "loose"}, "accounting must be 'rigorous' or 'paper'"),
        ({"variance_floor": 1.5}, "variance_floor"),
        ({"vectorize": True}, "vectorize must be 'auto' or False"),
        ({"vectorize_batch_size": 0}, "vectorize_batch_size"),
        # Two bad arguments: the first in P3SGD's order is named, as the callback always did.
        ({"clip_norm": -1.0, "local_lr": -1.0}, "clip_norm"),
    ],
)
def test_settings_refuse_what_p3sgd_refuses_with_the_same_message(arguments: dict[str, Any], match: str) -> None:
    given = {"sample_rate": 0.1, "clip_norm": 1.0, **arguments}
    with pytest.raises(PrivacyConfigError, match=match) as from_settings:
        P3SGDSettings(**given)
    with pytest.raises(PrivacyConfigError) as from_callback:
        P3SGD(**given)
    assert str(from_settings.value) == str(from_callback.value)


def test_settings_are_normalized_and_frozen() -> None:
    s = P3SGDSettings(0.1, 5, noise_scales=[3, 1], selection_epsilon=0.3, loss_bound=3.0, release_buffers=["a"])
    assert s.noise_scales == (1.0, 3.0) and s.clip_norm == 5.0 and isinstance(s.clip_norm, float)
    assert s.release_buffers == ("a",) and s.schedule == ConstantNoise(1.0) and s.noise_schedule is None
    assert s.local == LocalSGD() and s.selection is not None
    with pytest.raises(AttributeError):
        s.clip_norm = 2.0  # type: ignore[misc]
