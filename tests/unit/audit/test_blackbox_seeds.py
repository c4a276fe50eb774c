"""`MembershipAudit` seeds every generator of every run differently, however many runs (issue 31, item 13).

Before the fix run r's sampler had seed + 31·(r + 1) and its noise seed + 37·(r + 1): from 37 runs up a
run's sampler drew the same stream as an earlier run's noise (31·37 = 37·31).
"""

import pytest
import torch

from lightning_dp.audit import blackbox
from lightning_dp.audit.blackbox import MembershipAudit

RUNS = 40  # above 37, where the old seeds collided
ROLES = ("model", "sampler", "noise")


@pytest.mark.parametrize("level", ["sample", "patient"])
def test_every_generator_of_every_run_gets_its_own_seed(monkeypatch, level):
    seeds: list[tuple[str, int]] = []
    manual_seed = torch.manual_seed

    def recording(name, cls):
        class Recording(cls):
            def __init__(self, *args, **kwargs):
                seeds.append((name, int(kwargs["seed"])))
                super().__init__(*args, **kwargs)

        return Recording

    monkeypatch.setattr(blackbox, "GaussianRelease", recording("noise", blackbox.GaussianRelease))
    monkeypatch.setattr(blackbox, "PoissonSampleSampler", recording("sampler", blackbox.PoissonSampleSampler))
    monkeypatch.setattr(blackbox, "PoissonPatientSampler", recording("sampler", blackbox.PoissonPatientSampler))
    monkeypatch.setattr(torch, "manual_seed", lambda s: (seeds.append(("model", int(s))), manual_seed(s))[1])
    audit = MembershipAudit(
        level=level, images_per_patient=2, runs=RUNS, canaries=1, population=2, features=2, hidden=2, steps=1, seed=5
    )
    audit.run()
    roles = [role for role, _ in seeds]
    assert {role: roles.count(role) for role in ROLES} == dict.fromkeys(ROLES, RUNS)
    values = [s for _, s in seeds] + [audit.seed, audit.seed + 1]  # + the data's and the coins' generators
    assert len(set(values)) == len(values), sorted(values)


def test_run_seeds_are_distinct_for_many_runs():
    audit = MembershipAudit(runs=4, seed=0)
    values = [audit.run_seed(run, role) for run in range(10_000) for role in ROLES] + [0, 1]
    assert len(set(values)) == len(values)
