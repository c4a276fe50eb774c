"""`lightning-dp plan`: answers, JSON shape, solving, and one-line errors with exit status 2."""

from __future__ import annotations

import json

import pytest

from lightning_dp.accounting.rdp import DEFAULT_ORDERS
from lightning_dp.cli import main

REQUIRED_KEYS = {"epsilon", "delta", "accountant", "steps", "sample_rate", "noise_multiplier"}


def _plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _opacus_rdp(q: float, z: float, steps: int, delta: float) -> float:
    # dp-accounting would drop the fractional orders its series does not converge on at q=0.1
    # (and report a looser 6.017); Opacus evaluates them, so it is the like-for-like reference.
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    orders = list(DEFAULT_ORDERS)
    eps, _ = get_privacy_spent(
        orders=orders, rdp=compute_rdp(q=q, noise_multiplier=z, steps=steps, orders=orders), delta=delta
    )
    return float(eps)


def test_plan_epsilon_matches_opacus(capsys: pytest.CaptureFixture[str]) -> None:
    out = _plan_json(capsys, "--sample-rate", "0.1", "--noise-multiplier", "1.0", "--steps", "100", "--delta", "5e-4")
    assert set(out) >= REQUIRED_KEYS
    reference = _opacus_rdp(0.1, 1.0, 100, 5e-4)
    assert out["epsilon"] == pytest.approx(reference, rel=1e-3), (
        "plan's RDP ε must match Opacus' RDP analysis within 0.1 %"
    )
    assert (out["accountant"], out["steps"], out["sample_rate"]) == ("rdp", 100, 0.1)


def test_plan_solves_for_noise_multiplier_without_exceeding_target(capsys: pytest.CaptureFixture[str]) -> None:
    out = _plan_json(
        capsys, "--sample-rate", "0.04", "--steps", "2250", "--delta", "1e-5", "--target-epsilon", "7.3291"
    )
    assert out["solved_for"] == "noise_multiplier"
    assert out["epsilon"] <= 7.3291
    # Opacus' golden value: σ = 1.5 gives ε = 7.3291 at these settings, so the answer is ≈ 1.5.
    assert out["noise_multiplier"] == pytest.approx(1.5, rel=2e-3)


def test_plan_solves_for_steps_with_decay(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--sample-rate", "0.01", "--noise-multiplier", "2.8", "--delta", "1e-4", "--decay", "0.999"]
    out = _plan_json(capsys, *args, "--target-epsilon", "2.0")
    assert out["solved_for"] == "steps" and out["epsilon"] <= 2.0
    over = _plan_json(capsys, *args, "--steps", str(out["steps"] + 50))
    assert over["epsilon"] > 2.0, "50 more steps than the solved count must exceed the target"


def test_plan_refuses_invalid_tcdp_closed_form(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "--sample-rate",
        "0.01",
        "--noise-multiplier",
        "2.8",
        "--steps",
        "500",
        "--delta",
        "1e-4",
        "--decay",
        "0.99",
    ]
    out = _plan_json(capsys, *args)
    # docs/algorithms/decay.md, 'The closed form, and where it is not valid': outside its conditions the closed
    # form reads 8.0 while RDP gives 37.0.
    assert out["tcdp"]["valid"] is False and out["tcdp"]["epsilon"] is None
    assert any("rho_t" in c for c in out["tcdp"]["failed_conditions"])
    assert out["epsilon"] == pytest.approx(37.0, abs=0.1)


def test_plan_table_is_human_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--sample-rate", "0.1", "--noise-multiplier", "1", "--steps", "10", "--delta", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert "epsilon" in out and "rdp" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--sample-rate", "1.5", "--noise-multiplier", "1", "--steps", "10", "--delta", "1e-5"], "--sample-rate"),
        (["--sample-rate", "0.1", "--noise-multiplier", "0", "--steps", "10", "--delta", "1e-5"], "--noise-multiplier"),
        (["--sample-rate", "0.1", "--noise-multiplier", "1", "--steps", "-3", "--delta", "1e-5"], "--steps"),
        (["--sample-rate", "0.1", "--noise-multiplier", "1", "--steps", "10", "--delta", "1"], "--delta"),
        (["--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5"], "--noise-multiplier"),
        (
            [
                "--sample-rate",
                "0.1",
                "--noise-multiplier",
                "1",
                "--steps",
                "10",
                "--delta",
                "1e-5",
                "--accountant",
                "x",
            ],
            "x",
        ),
    ],
)
def test_plan_bad_arguments_exit_2_with_one_line(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # In process (a subprocess costs ~7 s of imports a case); the console script's own exit path is tested in
    # test_cli_help.py.
    try:
        status = main(["plan", *args])
    except SystemExit as exit_info:  # argparse's own errors
        status = exit_info.code  # type: ignore[assignment]
    assert status == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert needle in lines[0]


def test_plan_from_the_data_sets_size_batch_and_epochs(capsys: pytest.CaptureFixture[str]) -> None:
    # 700 patients, 70 per round, 10 epochs: q = 0.1, 100 rounds, δ = min(1e-5, 1/7000) = 1e-5 (the library default).
    out = _plan_json(capsys, "--units", "700", "--batch-size", "70", "--epochs", "10", "--noise-multiplier", "1.0")
    assert (out["sample_rate"], out["steps"], out["delta"], out["units"]) == (0.1, 100, 1e-5, 700)
    assert out["epsilon"] == pytest.approx(_opacus_rdp(0.1, 1.0, 100, 1e-5), rel=1e-3)
    big = _plan_json(capsys, "--units", "200000", "--batch-size", "256", "--steps", "10", "--noise-multiplier", "1")
    assert big["delta"] == pytest.approx(5e-7) and "default for N" in big["delta_source"]
    bare = _plan_json(capsys, "--sample-rate", "0.1", "--steps", "10", "--noise-multiplier", "1")
    assert bare["delta"] == 1e-5 and "give --units" in bare["delta_source"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--batch-size", "8", "--steps", "10", "--noise-multiplier", "1"], "needs --units"),
        (["--units", "10", "--batch-size", "20", "--steps", "10", "--noise-multiplier", "1"], "larger than --units"),
        (["--units", "100", "--batch-size", "10", "--sample-rate", "0.1", "--steps", "5"], "not both"),
        (["--sample-rate", "0.1", "--steps", "5", "--epochs", "2", "--noise-multiplier", "1"], "--steps or --epochs"),
        (["--steps", "5", "--noise-multiplier", "1"], "give --sample-rate q, or --units N"),
    ],
)
def test_plan_refuses_conflicting_sizes_in_one_line(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
