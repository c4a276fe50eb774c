"""The white-box audit's noise checks on simulated runs: their false-alarm rate on correct noise, their power on bugs.

A simulated run is what `CallbackAudit` measures (units of C): at each of T steps and in both worlds an
isotropic Gaussian noise vector of sd s_t in d dimensions, split along a random canary direction u_t (the "in"
world adds the canary's clipped norm m_t = 1 there) and orthogonal to it.

Tolerance: each check is run at significance 0.2 on 400 correct runs; the false-alarm rate must stay below
0.2 + 3 binomial standard errors (0.26). The checks are Bonferroni-corrected (fresh noise, noise vs ledger) or
use an estimated common factor (noise as released), so their rate is at most about 0.2 (noise std, the federated
audit's two-sided check, likewise); the audit runs them at 1e-3. Planted bugs are caught in every one of 20 runs at
1e-3.
"""

import numpy as np
import pytest

from lightning_dp.audit.noise import fresh_noise, noise_as_released, noise_equals_ledger, noise_vs_ledger

T, D = 20, 60
TENSORS = [("weight", 50), ("bias", 10)]
RUNS, RATE = 400, 0.2
LIMIT = RATE + 3 * (RATE * (1 - RATE) / RUNS) ** 0.5


def simulate(rng, sd=0.5, canary=1.0, edit=None):
    """(orthogonal in/out, residual out, (y_in, m_in, y_out)) of one simulated run; sd: a number or (2, T)."""
    sd = np.broadcast_to(np.asarray(sd, dtype=np.float64), (2, T))
    noise = rng.normal(size=(2, T, D)) * sd[..., None]
    if edit is not None:
        edit(noise)
    u = rng.normal(size=(2, T, D))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    along = (noise * u).sum(-1)
    orthogonal = noise - along[..., None] * u
    m = np.full(T, canary)
    return (orthogonal[0], orthogonal[1]), noise[1], (along[0] + m, m, along[1])


def vs_ledger(run, ledger=0.5, significance=RATE):
    orthogonal, residual, along = run
    z = np.full(T, ledger)
    return noise_vs_ledger(orthogonal, residual, along, (z, z), TENSORS, significance)


def test_fresh_noise_false_alarm_rate():
    rng = np.random.default_rng(0)
    alarms = sum(not fresh_noise(*simulate(rng)[0], RATE).passed for _ in range(RUNS))
    assert alarms / RUNS <= LIMIT, alarms


@pytest.mark.parametrize("sd", [0.5, "selection"])
def test_noise_vs_ledger_false_alarm_rate(sd):
    # "selection": P3SGD's candidates, a step's noise at z_min = 0.5 or at 1.0, the ledger charging z_min.
    rng = np.random.default_rng(1)
    scales = np.where(rng.random((2, T)) < 0.5, 0.5, 1.0) if sd == "selection" else sd
    alarms = sum(not vs_ledger(simulate(rng, scales)).passed for _ in range(RUNS))
    assert alarms / RUNS <= LIMIT, alarms


def test_noise_as_released_false_alarm_rate():
    rng = np.random.default_rng(2)
    alarms = 0
    for _ in range(RUNS):
        scales = np.where(rng.random((2, T)) < 0.5, 0.5, 1.0)
        alarms += not noise_as_released(simulate(rng, scales)[0], (scales[0], scales[1]), RATE).passed
    assert alarms / RUNS <= LIMIT, alarms


def zero(index):
    def edit(noise):
        noise[..., index] = 0.0

    return edit


@pytest.mark.parametrize(
    ("bug", "where"),
    [
        ({"edit": zero(slice(50, 60))}, "tensor 'bias'"),  # a tensor released without noise
        ({"edit": zero(slice(57, 60))}, "coordinate"),  # a slice of it
        ({"sd": 0.4}, ""),  # the ledger says 0.5, 0.4 was drawn everywhere (a ledger at 1.25·z)
    ],
)
def test_noise_below_the_ledger_is_caught(bug, where):
    rng = np.random.default_rng(3)
    for _ in range(20):
        check = vs_ledger(simulate(rng, **bug), significance=1e-3)
        assert not check.passed and where in check.worst, check


def test_noise_missing_along_the_canary_is_caught():
    rng = np.random.default_rng(4)
    for _ in range(20):
        (orth_in, orth_out), residual, (y_in, m, y_out) = simulate(rng)
        # No noise where the canary is: the projections are exact (the rest of the noise is intact).
        check = vs_ledger(((orth_in, orth_out), residual, (m, m, 0 * y_out)), significance=1e-3)
        assert not check.passed and check.worst == "along the canary's direction", check


@pytest.mark.parametrize("reuse", ["lag 2", "lag 7", "across"])
def test_reused_noise_is_caught_at_any_lag_and_across_worlds(reuse):
    rng = np.random.default_rng(5)

    def edit(noise):
        if reuse == "across":
            noise[1, 4] = noise[0, 9]
        else:
            lag = int(reuse.split()[1])
            noise[0, 3 + lag] = noise[0, 3]

    for _ in range(20):
        check = fresh_noise(*simulate(rng, edit=edit)[0], 1e-3)
        assert not check.passed and (reuse in check.worst), check


def test_noise_not_as_released_is_caught():
    rng = np.random.default_rng(6)
    scales = np.full((2, T), 0.5)
    scales[0, 5] = 1.0  # drawn at 1.0, reported as 0.5
    for _ in range(20):
        reported = np.full(T, 0.5)
        check = noise_as_released(simulate(rng, scales)[0], (reported, reported), 1e-3)
        assert not check.passed and check.worst.startswith("step 5 (in world)"), check


def test_a_ledger_with_fewer_steps_than_releases_fails():
    orthogonal, residual, along = simulate(np.random.default_rng(7))
    z = np.full(T, 0.5)
    check = noise_vs_ledger(orthogonal, residual, along, (z[:-1], z), TENSORS, 1e-3)
    assert not check.passed and "records 19 Gaussian steps for 20 releases" in check.worst


def test_noise_equals_ledger_false_alarm_rate():
    rng = np.random.default_rng(5)
    z = np.full(T, 0.5)
    runs = [rng.normal(0, 0.5, (T, D)) for _ in range(RUNS)]
    alarms = np.mean([not noise_equals_ledger(noise, z, TENSORS, RATE).passed for noise in runs])
    assert alarms < LIMIT, alarms


@pytest.mark.parametrize("factor", [2**-0.5, 1.25])
def test_noise_off_the_ledger_either_way_is_caught(factor):
    """Two-sided: less noise than charged leaks, more is a release that is not the one charged."""
    rng = np.random.default_rng(6)
    z = np.full(T, 0.5)
    checks = [noise_equals_ledger(rng.normal(0, 0.5 * factor, (T, D)), z, TENSORS, 1e-3) for _ in range(20)]
    assert not any(c.passed for c in checks)
    assert all((c.statistic < 1) == (factor < 1) for c in checks), [c.statistic for c in checks]


def test_noise_equals_ledger_finds_an_un_noised_tensor():
    rng = np.random.default_rng(7)
    noise = rng.normal(0, 0.5, (T, D))
    noise[:, 50:] = 0.0
    check = noise_equals_ledger(noise, np.full(T, 0.5), TENSORS, 1e-3)
    assert not check.passed and check.statistic == 0.0
