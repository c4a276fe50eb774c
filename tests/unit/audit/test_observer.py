"""The observer tier (issue 43 §1, §2, §5): neighbouring worlds replayed end to end, every channel compared.

Each pipeline runs what a user runs (``lightning-dp fit`` on written PNG patients; the federated ServerApp and
ClientApps over Flower's messages with a deadline) on D and on D plus an adversarial unit, with every secret draw held
equal by a `SecretTape`. Correct code passes with the first release moved by exactly C (a unit above the clip) or 0 (a
unit that contributes nothing); each planted bug of `OBSERVER_MUTANTS` is caught by the check the table names. The
tolerance on the move is `verdict.TOLERANCE` (0.02·C of fp32 round-off); everything else is compared exactly after
normalization (durations, the world's folder, event-file names).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import lightning_dp.secret as secret
from lightning_dp.audit.observer import FederatedPipeline, FitPipeline, ObserverAudit, SecretTape, TunePipeline
from lightning_dp.audit.observer.channels import normalize
from lightning_dp.audit.observer.mutants import OBSERVER_MUTANTS, ObserverMutant

SMALL = {"patients": 6, "steps": 2}


def test_the_default_path_draws_every_secret_afresh_from_the_os(tmp_path: Path) -> None:
    # Two runs of one public config (same seed_everything, data and settings), no tape: the releases differ.
    pipeline = FitPipeline("dpsgd", **SMALL)
    first, second = pipeline.run(None, tmp_path / "a"), pipeline.run(None, tmp_path / "b")
    assert first.channels["outcome"] == second.channels["outcome"] == "exit 0"
    assert len(first.releases) == len(second.releases) == 2
    assert not torch.equal(first.releases[0].vector, second.releases[0].vector), "noise from a public value"
    assert secret._held is None and secret.secure_bits(64, "noise") != secret.secure_bits(64, "noise")


def test_a_tape_replays_draws_by_purpose_and_refuses_to_nest() -> None:
    tape = SecretTape(master=1)
    with tape.held():
        a = [secret.secure_seed("coins"), secret.secure_seed("noise"), secret.secure_seed("coins")]
        with pytest.raises(RuntimeError, match="already held"), SecretTape().held():
            pass
    with tape.held():  # another order of purposes: each purpose's k-th draw is the same
        b = [secret.secure_seed("noise"), secret.secure_seed("coins"), secret.secure_seed("coins")]
    assert a[0] == b[1] and a[1] == b[0] and a[2] == b[2] and a[0] != a[2]
    assert secret._held is None


@pytest.mark.parametrize("engine", ["p3sgd", "dpsgd"])
def test_correct_training_passes_with_the_first_release_moved_by_c(engine: str) -> None:
    units = ["huge", "one_image"] if engine == "p3sgd" else ["huge"]
    result = ObserverAudit(FitPipeline(engine, **SMALL), units).run()
    assert result.passed, result.summary()
    assert all(m == pytest.approx(1.0, abs=1e-4) for m in result.moved.values()), result.moved
    assert {"noise", "coins"} <= set(result.purposes_drawn)
    # What only the data holder sees is reported: its console warns that the data do not hold the declared N.
    assert any("does not hold the declared N" in note.left + note.right for note in result.notes)


def test_correct_federated_training_passes_for_every_adversarial_patient() -> None:
    units = ["huge", "whale", "one_image", "nonfinite", "raising", "empty", "colliding"]
    result = ObserverAudit(FederatedPipeline(whale_images=20_000), units).run()
    assert result.passed, result.summary()
    # A patient id two sites share refuses the start: one bit the consortium declares public (docs/federated.md).
    assert [(f.check, f.channel) for f in result.declared] == [("D vs D+colliding", "outcome")]
    assert "patient ids appear at more than one site" in result.declared[0].right
    assert result.moved["huge"] == pytest.approx(1.0, abs=1e-4) and result.moved["whale"] == pytest.approx(1, abs=1e-4)
    assert all(result.moved[u] == 0 for u in ("nonfinite", "raising", "empty")), result.moved
    assert [n.channel for n in result.notes] == ["console.site_logs"], "a failing patient: in its site's log only"


@pytest.mark.parametrize("mutant", OBSERVER_MUTANTS, ids=[m.name for m in OBSERVER_MUTANTS])
def test_every_observer_mutant_is_caught_by_its_check(mutant: ObserverMutant) -> None:
    # A fixed master secret: reproducible runs (the audit varies K until two variations change what runs).
    with mutant.plant():
        result = mutant.audit(master=5).run()
    assert [f for f in result.findings if f.check.startswith(mutant.check)], result.summary()


def test_the_mutants_restore_the_library() -> None:
    from lightning_dp.callbacks import base
    from lightning_dp.callbacks.p3sgd import P3SGD

    before = (P3SGD._normalizer, base.secure_seed)
    for mutant in OBSERVER_MUTANTS:
        with mutant.plant():
            pass
    assert (P3SGD._normalizer, base.secure_seed) == before


def test_normalization_strips_only_what_varies_whatever_the_data() -> None:
    assert normalize("ε = 1.5000 after 12 steps in 0.25 s", ()) == "ε = 1.5000 after 12 steps in <t>"
    events = normalize("/w/D/runs/events.out.tfevents.1795.vm.14876.0", ("/w/D",))
    assert events == "<world>/runs/events.out.tfevents.<run>"
    assert math.isfinite(float(normalize("3.0", ())))


@pytest.mark.parametrize("secure", [False, True], ids=["shares", "secagg"])
def test_correct_federated_training_with_the_noise_at_the_sites_passes(secure: bool) -> None:
    pytest.importorskip("cryptography")
    result = ObserverAudit(FederatedPipeline(noise_at="sites", secure=secure), ["huge", "raising"]).run()
    assert result.passed, result.summary()
    assert result.moved["huge"] == pytest.approx(1.0, abs=1e-3) and result.moved["raising"] == pytest.approx(
        0, abs=1e-3
    )
    assert {"share", "site"} <= set(result.purposes_drawn)


def test_a_correct_search_publishes_nothing_that_follows_k_or_a_patient() -> None:
    # best/: the release (the best trial's model, hyperparameters, scores) may differ; the reports' other fields,
    # the published files' names and the outcome may not, neither with a huge patient added nor with K varied.
    result = ObserverAudit(TunePipeline(), ["huge"], master=5).run()
    assert result.passed, result.summary()
    assert "trials" in result.purposes_drawn
