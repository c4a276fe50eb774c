"""`lightning-dp plan --sites` and `--params`: a consortium against each site alone, before anyone trains."""

from __future__ import annotations

import json
import math

import pytest

from lightning_dp.accounting import NOISE_TO_SIGNAL_CLEAR, NOISE_TO_SIGNAL_LIMIT, default_delta
from lightning_dp.cli import main

# examples/federated_hospitals.py's consortium: four hospitals' training patients, q, C, rounds, the released values.
SITES = {"b": 28, "c": 42, "d": 56, "e": 70}
Q, C, T, D = 0.2, 0.3, 40, 962


def _plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _consortium(capsys: pytest.CaptureFixture[str], epsilon: float) -> dict:
    sites = ",".join(f"{k}={n}" for k, n in SITES.items())
    args = ["--sites", sites, "--sample-rate", str(Q), "--rounds", str(T), "--target-epsilon", str(epsilon)]
    return _plan_json(capsys, *args, "--delta", "1e-5", "--params", str(D), "--clip-norm", str(C))


def _dp_accounting_epsilon(z: float) -> float:
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.rdp import RdpAccountant

    event = dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(z))
    accountant = RdpAccountant()
    accountant.compose(event, T)
    return float(accountant.get_epsilon(1e-5))


def _verdict(ratio: float) -> str:
    return "learn" if ratio <= NOISE_TO_SIGNAL_CLEAR else "marginal" if ratio <= NOISE_TO_SIGNAL_LIMIT else "drown"


@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_plan_sites_noise_matches_an_independent_computation(
    epsilon: float, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _consortium(capsys, epsilon)
    z = out["noise_multiplier"]
    # dp-accounting's RDP accountant: the calibrated z reaches ε (its orders differ a little from ours: 0.2 %), and
    # 1 % less noise would not.
    assert _dp_accounting_epsilon(z) <= epsilon * 1.002
    assert _dp_accounting_epsilon(0.99 * z) > epsilon
    assert out["units"] == sum(SITES.values()) and out["expected_units"] == pytest.approx(Q * 196)
    rows = {row["site"]: row for row in out["sites"]}
    assert list(rows) == list(SITES)
    for name, n in [*SITES.items(), ("consortium", 196)]:
        row = out if name == "consortium" else rows[name]
        assert row["units"] == n
        # Same ε, q, rounds and δ: each site alone is calibrated to the same z (only N differs).
        assert row["noise_multiplier"] == pytest.approx(z, rel=1e-9) and row["epsilon"] <= epsilon
        assert row["noise_per_coordinate"] == pytest.approx(z * C / (Q * n), rel=1e-9)
        ratio = z * math.sqrt(D) / (Q * n * math.sqrt(T))
        assert row["noise_to_signal"] == pytest.approx(ratio, rel=1e-9)
        assert row["verdict"] == _verdict(ratio)
    # docs/results/federated.md's noise arithmetic: 0.290 alone at hospital_b, 0.041 federated (ε = 1).
    if epsilon == 1.0:
        assert round(rows["b"]["noise_per_coordinate"], 3) == 0.290 and round(out["noise_per_coordinate"], 3) == 0.041
        assert [rows[k]["verdict"] for k in SITES] + [out["verdict"]] == [
            "drown",
            "drown",
            "marginal",
            "marginal",
            "learn",
        ]


def test_plan_sites_default_delta_follows_each_site(capsys: pytest.CaptureFixture[str]) -> None:
    # Without --delta each plan takes the default for its own N: a site of 200,000 patients a smaller δ than one of
    # 5,000, so at the same target ε it needs more noise; with a fixed z every site spends the consortium's ε or so.
    args = ["--sites", "5000,200000", "--sample-rate", "0.01", "--steps", "100"]
    out = _plan_json(capsys, *args, "--target-epsilon", "2")
    small, large = out["sites"]
    assert (small["delta"], large["delta"], out["delta"]) == (1e-5, default_delta(200_000), default_delta(205_000))
    assert small["noise_multiplier"] < large["noise_multiplier"] <= out["noise_multiplier"]
    assert (small["site"], large["site"]) == ("site 1", "site 2")
    fixed = _plan_json(capsys, *args, "--noise-multiplier", "1.0", "--delta", "1e-6")
    assert all(row["epsilon"] == pytest.approx(fixed["epsilon"], rel=1e-12) for row in fixed["sites"])
    assert fixed["noise_to_signal"] is None and "needs --params" not in json.dumps(fixed)


def test_plan_sites_table_and_params_alone(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--sample-rate", "0.2", "--rounds", "40", "--noise-multiplier", "1.8", "--params", "962"]
    assert main(["plan", "--sites", "b=28,e=70", *args]) == 0
    table = capsys.readouterr().out
    assert "each site alone" in table and "consortium" in table
    assert "learn ≤ 1 < marginal ≤ 3 < drown" in table, "the verdict's thresholds are stated"
    assert "needs --clip-norm" in table
    single = _plan_json(capsys, "--units", "28", "--clip-norm", "0.3", *args)
    assert single["noise_to_signal"] == pytest.approx(1.8 * math.sqrt(962) / (0.2 * 28 * math.sqrt(40)))
    assert single["verdict"] == "marginal"
    assert main(["plan", *args]) == 0
    assert "needs N" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--sites", "28,x"], "found 'x'"),
        (["--sites", "28,0"], "at least 1"),
        (["--sites", "b=1,b=2"], "two sites are named 'b'"),
        (["--sites", "28,42", "--units", "70"], "--units is not used with --sites"),
        (["--sites", "28,42", "--batch-size", "5"], "--batch-size is not used with --sites"),
        (["--units", "70", "--params", "0"], "--params"),
        (["--sites", "28,42", "--config", "configs/p3sgd_resnet18_synthetic.yaml"], "not used with --config"),
    ],
)
def test_plan_sites_refuses_bad_input_in_one_line(
    extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--sample-rate", "0.2", "--steps", "10", "--noise-multiplier", "1", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "HINT" in err[0], err
