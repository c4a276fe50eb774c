"""The white-box audit of the callbacks' own step: correct code passes and sees the canary; every mutant is caught.

Tolerance: ε_lower is a lower confidence bound at 95 % (a normal bound on the canary's pass-through factor
β and a χ² bound on the noise factor κ, each at 97.5 %), so the ε comparison false-alarms on correct code with
probability ≤ 5 % (measured margins: μ̂ lies 0.1–2.8 standard errors *below* μ_allowed, the catch threshold is
~2 above). Each noise check (fresh noise at every lag, noise vs ledger, noise as released) false-alarms with
probability ≤ 1e-3 (tests/unit/audit/test_noise_checks.py measures the rates on simulated runs). The seeds
are fixed, so every assertion is deterministic; the correct runs estimate β within ±0.5 of 1 (about 2.5
standard errors at T = 50) and the noise sd within 10 % of z = 0.5 (it is measured on hundreds of directions
per step). A mutant caught by the ε comparison must be caught with a plug-in probability ≥ 0.99 (μ̂ at least
2.33 standard errors beyond the catch threshold): its steps are sized for that, not for a coin flip.
"""

import pytest
import torch

from lightning_dp.audit import CallbackAudit
from lightning_dp.audit.mutants import MUTANTS
from lightning_dp.audit.scenarios import coupling_audit, dpsgd_audit, p3sgd_audit
from lightning_dp.callbacks import DPSGD, P3SGD
from lightning_dp.errors import PrivacyConfigError

pytestmark = pytest.mark.statistical

STEPS = 50
SCENARIOS = {
    "DPSGD": lambda steps: dpsgd_audit("conv", steps=steps),
    "DPSGD-transpose": lambda steps: dpsgd_audit("transpose", steps=steps),
    "DPSGD-kept": lambda steps: dpsgd_audit("kept", steps=steps),
    "P3SGD": lambda steps: p3sgd_audit(steps=steps),
    "P3SGD-selection": lambda steps: p3sgd_audit(noise_scales=(0.5, 1.0), local_steps=3, steps=steps),
    "P3SGD-vectorized": lambda steps: p3sgd_audit(vectorize="auto", steps=steps),
    "P3SGD-stacked": lambda steps: p3sgd_audit(vectorize="auto", local_steps=3, steps=steps),
}
#: The paired-world sensitivity audits (issue 31, items 1, 2, 5): their canaries expose coupling between units.
COUPLING = {
    "DPSGD-cancel": lambda steps: coupling_audit("cancel"),
    "DPSGD-neighbour": lambda steps: coupling_audit("neighbour"),
    "P3SGD-augment": lambda steps: coupling_audit("augment"),
    "DPSGD-normalizer": lambda steps: coupling_audit("normalizer"),
}


def margin(result):
    if not hasattr(result, "beta"):  # a SensitivityAuditResult
        return result.summary() + f" moved {result.moved}, excess {result.excess}"
    return result.summary() + f" β̂ {result.beta:.3f}, μ̂ {result.mu:.2f}, μ_lower {result.mu_lower:.2f} {result.checks}"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_correct_callbacks_pass_and_see_the_canary(scenario):
    result = SCENARIOS[scenario](STEPS).run()
    assert result.passed, margin(result)
    assert abs(result.beta - 1.0) < 0.5, margin(result)  # the canary is seen, at its clipped size
    assert result.epsilon_lower > 0.1 * result.epsilon_upper, margin(result)
    if scenario != "P3SGD-selection":  # one noise scale: the measured noise is z·C on every direction
        assert result.noise_sd == pytest.approx(0.5, rel=0.1), margin(result)
    assert result.canary_norm > 0.9, margin(result)  # the clip is active: the canary is far above C
    assert result.population_clipped == 0.0, margin(result)  # a wrong clip would move the canary alone
    assert result.noise_fresh and not result.changed_state, margin(result)
    assert all(check.passed for check in result.checks), margin(result)
    ledger = result.check("noise vs ledger")  # measured noise ≥ the ledger's multiplier everywhere
    assert ledger.statistic >= ledger.limit and ledger.tests > result.steps, margin(result)
    assert result.ledger_multipliers.tolist() == [0.5] * STEPS, margin(result)
    if scenario == "P3SGD-selection":  # read per step: each step at the multiplier the selection drew
        assert set(result.released_multipliers.tolist()) == {0.5, 1.0}, margin(result)
    else:
        assert result.released_multipliers.tolist() == [0.5] * STEPS, margin(result)


@pytest.mark.parametrize("scenario", list(COUPLING))
def test_correct_callbacks_let_one_unit_move_the_sum_by_its_own_share_only(scenario):
    """Same seed in every world: the noise cancels, and the canary moves the clipped sum by its own clipped share."""
    result = COUPLING[scenario](0).run()
    assert result.passed, margin(result)
    assert max(result.moved) <= 1.0 + 1e-3, margin(result)
    assert max(result.excess) <= 2e-3, margin(result)  # measured ≤ 9e-4 (fp32 round-off of noise-sized releases)


def _cases():
    for mutant in MUTANTS:
        for mechanism in mutant.mechanisms:  # each mechanism's scenario
            # "P3SGD-federated" is the FederatedAudit's scenario: tests/unit/audit/test_federated_audit.py
            if mechanism in SCENARIOS or mechanism in COUPLING:
                yield pytest.param(mutant, mechanism, id=f"{mutant.name}-{mechanism}")


@pytest.mark.parametrize(("mutant", "scenario"), list(_cases()))
def test_every_mutant_is_caught(mutant, scenario):
    with mutant.applied():
        result = {**SCENARIOS, **COUPLING}[scenario](mutant.steps).run()
    assert not result.passed, f"{mutant.name} ({mutant.where}) not caught: " + margin(result)
    assert mutant.check in result.failed, f"{mutant.name} not caught by {mutant.check}: " + margin(result)
    if mutant.check == "ε":  # not a coin flip: μ̂ ≥ 2.33 SE beyond the catch threshold
        assert result.power >= 0.99, f"{mutant.name} caught by a thin margin: " + margin(result)


def test_mutants_restore_the_library():
    before = dpsgd_audit("conv", steps=2)
    for mutant in MUTANTS:
        with mutant.applied():
            pass
    from lightning_dp.sanitization import per_sample, release, rules, updates

    assert per_sample.clip_coefficients.__module__ == "lightning_dp.sanitization.per_sample"
    assert rules._ghost_norms.__module__ == rules.sum_of_squares.__module__ == "lightning_dp.sanitization.rules"
    assert updates.clip_factor.__module__ == "lightning_dp.sanitization.updates"
    assert release.Release._gaussian.__qualname__ == "Release._gaussian"
    assert release.standard_normal.__qualname__ == "standard_normal"
    from lightning_dp.accounting.ledger import PrivacyLedger

    assert PrivacyLedger.record.__qualname__ == "PrivacyLedger.record"
    from lightning_dp.sampling.randomness import UnitStreams
    from lightning_dp.sanitization.per_sample import PerSampleClipper

    assert rules.ProductRule.term_mass.__qualname__ == "ProductRule.term_mass"
    assert rules.KeptInputsTerm.add_clipped.__qualname__ == "KeptInputsTerm.add_clipped"
    assert UnitStreams.unit.__qualname__ == "UnitStreams.unit"
    assert PerSampleClipper.accumulate.__qualname__ == "PerSampleClipper.accumulate"
    assert updates.ModelState.refresh.__qualname__ == "ModelState.refresh"
    assert before.steps == 2


def test_subsampled_runs_and_unfollowable_local_batches_are_refused_with_a_hint():
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 2, (6,))
    with pytest.raises(PrivacyConfigError, match="full batch.*StepAudit"):
        CallbackAudit(
            lambda s: DPSGD(sample_rate=0.5, noise_multiplier=1.0, clip_norm=1.0, delta=1e-5, seed=s),
            model=lambda: torch.nn.Linear(64, 2),
            population=(x, y),
            canary=(x[:1], y[:1]),
        )
    with pytest.raises(PrivacyConfigError, match="local_batch_size >= images per patient"):
        CallbackAudit(
            lambda s: P3SGD(sample_rate=1.0, clip_norm=1.0, local_batch_size=2, delta=1e-5, seed=s),
            model=lambda: torch.nn.Linear(64, 2),
            population=(x, y, torch.tensor([0, 0, 0, 1, 1, 1])),
            canary=(x[:3], y[:3]),
        )


@pytest.mark.parametrize("layer", ["dropout", "batchnorm"])
def test_layers_the_reference_cannot_follow_are_refused_with_a_hint(layer):
    # Measured before the refusal: with a training-mode BatchNorm a P3SGD clip 10× too large passed (ε_lower 151
    # against ε_upper 166): the eval-mode reference subtracted other contributions than the callback released.
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 2, (6,))
    middle = torch.nn.Dropout(0.25) if layer == "dropout" else torch.nn.BatchNorm1d(8)

    def audit():
        return CallbackAudit(
            lambda s: P3SGD(sample_rate=1.0, clip_norm=1.0, local_batch_size=3, delta=1e-5, seed=s),
            model=lambda: torch.nn.Sequential(
                torch.nn.Flatten(), torch.nn.Linear(64, 8), middle, torch.nn.Linear(8, 2)
            ),
            population=(x, y, torch.tensor([0, 0, 0, 1, 1, 1])),
            canary=(x[:3], y[:3]),
        )

    found = r"1 layer\(s\).*2 \((Dropout\(p=0.25\)|BatchNorm1d in training mode)\).*HINT: .*eval mode"
    with pytest.raises(PrivacyConfigError, match=found):
        audit()
    middle.eval()  # frozen statistics, dropout off: the reference follows it
    assert audit().level == "patient"


def test_the_kept_scenario_audits_the_kept_inputs_term_and_the_tapwise_path(monkeypatch):
    from lightning_dp.sanitization import rules

    kept_layers, tapwise_layers = [], []
    kept, live = rules.KeptInputsTerm.__init__, rules._live_taps

    def count_kept(self, rule, module, *args, **kwargs):
        kept_layers.append(tuple(module.weight.shape))
        kept(self, rule, module, *args, **kwargs)

    def count_live(module, *args, **kwargs):
        taps = live(module, *args, **kwargs)
        if taps is not None:
            tapwise_layers.append(tuple(module.weight.shape))
        return taps

    monkeypatch.setattr(rules.KeptInputsTerm, "__init__", count_kept)
    monkeypatch.setattr(rules, "_live_taps", count_live)
    dpsgd_audit("kept", steps=2).fit(with_canary=True)
    # Both 16-channel convolutions keep their inputs for the clipped sum; only the dilated one is read tap by tap.
    assert set(kept_layers) == {(16, 16, 3, 3), (8, 16, 3, 3)} and len(kept_layers) >= 2 * 2 * 4, kept_layers
    assert set(tapwise_layers) == {(8, 16, 3, 3)} and len(tapwise_layers) >= 2 * 4, tapwise_layers


def test_the_vectorized_scenario_audits_the_batched_round():
    callback, _, _ = p3sgd_audit(vectorize="auto", steps=2).fit(with_canary=True)
    assert callback.vectorize_fallback is None and callback.vectorized_rounds == 2


def test_the_stacked_scenario_audits_stacked_local_sgd():
    callback, _, _ = p3sgd_audit(vectorize="auto", local_steps=3, steps=2).fit(with_canary=True)
    assert callback.round_path == "stacked" and callback.vectorized_rounds == 2


def test_the_sensitivity_audit_passes_augmented_samples_and_refuses_a_round_off_it_cannot_resolve():
    """Review of issue 31: with DPSGD's streams keyed by index, a canary alone at index 0 drew other flips than at index
    N (correct code failed, excess 1.0·C): the population now stays at loss weight 0 in the "alone" worlds. And a
    learning rate so small that θ's fp32 round-off, rescaled by n/lr, outweighs the tolerance is refused."""
    from torch import nn

    from lightning_dp.audit.scenarios import _random_flip
    from lightning_dp.audit.sensitivity import SensitivityAudit

    y = torch.randint(0, 2, (16,))

    def audit(lr, clip, width=4):
        return SensitivityAudit(
            lambda s: DPSGD(sample_rate=1.0, noise_multiplier=1.0, clip_norm=clip, delta=1e-5, seed=s),
            model=lambda: nn.Sequential(nn.Linear(width, 64), nn.Tanh(), nn.Linear(64, 2)),
            population=(torch.randn(16, width), y),
            canary=(torch.full((1, width), 5.0), torch.tensor([0])),
            augment=_random_flip,
            lr=lr,
        )

    result = audit(0.05, 0.1).run()
    assert result.passed, margin(result)
    with pytest.raises(PrivacyConfigError, match=r"round-off .* HINT: a larger learning rate"):
        audit(1e-4, 0.01, width=256).run()


def test_the_sensitivity_audit_samples_at_q_below_one_only_where_both_worlds_hold_the_same_others():
    """Samples are Poisson-sampled (the canary, appended last, draws its coin after the others': the worlds sample the
    same others); a run counts only where the canary was sampled, so a dividing-by-the-sample-size bug shows (the
    mutant "normalizer from the private count"). Patients at q < 1 are refused: their sample would differ."""
    from torch import nn

    from lightning_dp.audit.sensitivity import SensitivityAudit

    result = coupling_audit("normalizer", runs=3).run()
    assert result.passed and result.runs == 3 and min(result.moved) > 0.99, margin(result)  # the canary, clipped to C
    with pytest.raises(PrivacyConfigError, match=r"samples patients with q = 0.5.*HINT: .*sample_rate=1.0"):
        SensitivityAudit(
            lambda s: P3SGD(sample_rate=0.5, clip_norm=1.0, seed=s),
            model=lambda: nn.Linear(4, 2),
            population=(torch.randn(6, 4), torch.zeros(6, dtype=torch.long), torch.arange(3).repeat_interleave(2)),
            canary=(torch.randn(2, 4), torch.zeros(2, dtype=torch.long)),
        )
