"""The observer tier's PATE pipeline (issue 43 §1): teachers, the noisy vote, the labels kept with their ledger.

`PatePipeline` runs what a user runs for PATE — ``lightning-dp fit`` of each teacher on its partition, then of the
student (the aggregation through `PATEStudentDataModule`), then the student again in the same folder — on D and on D
plus one adversarial patient, every secret held equal by a `SecretTape`. The release is each public query's noisy mean
code: held to the sensitivity it is charged for, S = √d (one patient is in one teacher's partition; PCA keeps a map in
[0, 1]^d within √d), with at most one teacher changed. Each world's rules: every release charged by the ledger, and a
rerun that releases nothing. The three PATE mutants of `OBSERVER_MUTANTS` are shown to leak here, measured without the
audit; `test_observer.py::test_every_observer_mutant_is_caught_by_its_check` shows each caught by its check.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import lightning_dp.pate as pate
from lightning_dp.audit.observer import ObserverAudit, PatePipeline, SecretTape
from lightning_dp.audit.observer.mutants import OBSERVER_MUTANTS, ObserverMutant
from lightning_dp.cli import main
from lightning_dp.pate import PATEAggregator, PCACompressor, pate_epsilon, pate_noise_multiplier

#: D's training patients (`PatePipeline`): with K = 2 teachers, t01 and t03 are teacher 0's, the rest teacher 1's.
TRAIN = [f"t{i:02d}" for i in range(6)]


def _mutant(name: str) -> ObserverMutant:
    (mutant,) = [m for m in OBSERVER_MUTANTS if m.name == name]
    return mutant


def test_correct_pate_release_passes_with_one_teacher_changed_and_every_vote_within_s() -> None:
    result = ObserverAudit(PatePipeline(), ["huge", "colliding", "nonfinite", "empty", "raising"], master=5).run()
    assert result.passed, result.summary()
    assert result.purposes_drawn == ["noise"]
    # Every query's release (not only the first) moved by far less than S = √d = 16: the one teacher the patient
    # joined (zz_unit, or the colliding id t00: both teacher 1's) changed, and no other.
    assert (result.scope, result.bound) == ("every release", "S")
    assert set(result.moved) == {"huge", "colliding"} and all(0 < m < 0.1 for m in result.moved.values()), result.moved
    assert result.changed == {"huge": ["teacher 1"], "colliding": ["teacher 1"]}
    # A NaN image: the first teacher's `lightning-dp fit` refuses the manifest, naming the file, before anything is
    # released (the data holder's check of its own data).
    assert [(f.check, f.channel) for f in result.declared] == [("D vs D+nonfinite", "outcome")]
    assert "zz_unitu_0.npy" in result.declared[0].right and "finite" in result.declared[0].right
    assert set(result.inapplicable) == {"empty", "raising"}, "a unit a manifest cannot hold is reported, not skipped"
    # What only the data holder sees: the release file's request (digests of the teachers' checkpoints) and checksum,
    # the student's training checkpoint (its resume key is such a digest too; the published copy drops it).
    held = {note.channel.split(":")[0] for note in result.notes}
    assert held == {"file runs/pate_release.pt", "file runs/student/checkpoints/last.ckpt"}, result.summary()


def test_a_partition_that_follows_the_count_changes_both_teachers() -> None:
    def changed() -> tuple[int, int]:
        before = pate.partition_patients(TRAIN, 2)
        after = pate.partition_patients([*TRAIN, "zz_unit"], 2)
        teachers = sum(a != b for a, b in zip(before, after))
        owner = {p: k for k, part in enumerate(before) for p in part}
        moved = sum(p not in after[owner[p]] for p in TRAIN)
        return teachers, moved

    assert changed() == (1, 0)  # correct: the patient joins one teacher, nobody moves
    with _mutant("teacher partition from the count").plant():
        teachers, moved = changed()
    assert changed() == (1, 0), "the mutant restored the library"
    assert teachers == 2 and moved >= 2, (teachers, moved)
    # Both teachers' votes can now change with one patient: Σ codes moves by up to 2·S, noised and charged for S.
    z = pate_noise_multiplier(2.0, 1e-7, 4)
    printed, true = pate_epsilon(z, 1e-7, 4), pate_epsilon(z / teachers, 1e-7, 4)
    assert printed <= 2.0 and true > 2 * printed, (printed, true)  # measured: 2.00 printed, 4.24 true


def test_a_rerun_that_does_not_read_the_release_back_draws_fresh_labels_uncharged(tmp_path: Path) -> None:
    pipeline = PatePipeline()
    with _mutant("a rerun that redraws the labels uncharged").plant(), SecretTape(master=5).held():
        obs = pipeline.run(None, tmp_path / "D")
    assert obs.channels["outcome"].endswith("student: exit 0; student again: exit 0")
    queries = 4
    assert len(obs.releases) == 2 * queries  # the rerun released the labels again
    made, charged = obs.rules["every release charged by the ledger (multipliers, in order)"]
    z = obs.releases[0].multiplier
    assert (made, charged) == (f"{2 * queries} × {z!r}", f"{queries} × {z!r}")
    # Fresh noise: the rerun's labels differ from the first run's (by several S/K: the noise itself, z·S/K per code).
    first, again = obs.releases[:queries], obs.releases[queries:]
    gap = max(float((a.vector - b.vector).norm()) * a.normalizer / a.clip_norm for a, b in zip(first, again))
    assert gap > 1.0, gap
    printed, true = pate_epsilon(z, 1e-7, queries), pate_epsilon(z, 1e-7, 2 * queries)
    assert printed <= 2.0 < 1.3 * printed < true, (printed, true)


def test_a_pca_sensitivity_of_the_code_draws_noise_sqrt_d_over_l_too_small() -> None:
    torch.manual_seed(0)
    masks = (torch.rand(8, 1, 16, 16) > 0.5).float()
    maps = torch.rand(2, 400, 1, 16, 16)  # K = 2 teachers, 400 queries
    pca = PCACompressor(code_dim=2).fit(masks)
    codes = torch.stack([pca.encode(maps[k]) for k in range(2)]).mean(0)

    def noise_std() -> tuple[float, float]:
        aggregator = PATEAggregator(pca, num_teachers=2, delta=1e-7, noise_multiplier=5.0)
        with pytest.warns(Warning):  # the noise drowns the codes: the aggregator says so
            released = aggregator.aggregate(maps)
        return float((released.codes - codes).std()), aggregator.sensitivity

    std, s = noise_std()
    assert s == 16.0 and std == pytest.approx(5.0 * 16 / 2, rel=0.1)  # σ = z·√d/K
    with _mutant("PCA sensitivity of the code").plant():
        small, s_small = noise_std()
    assert s_small == pytest.approx(math.sqrt(2)) and small == pytest.approx(5.0 * math.sqrt(2) / 2, rel=0.1)
    # The noise on the votes is √(d/l) = 11.3 times smaller than one teacher's map can move them: the true multiplier.
    true = pate_epsilon(5.0 * s_small / s, 1e-7, 400)
    assert true > 10 * pate_epsilon(5.0, 1e-7, 400)


def test_the_pate_mutants_restore_the_library() -> None:
    from lightning_dp.pate import aggregator, student

    before = (pate.partition_patients, aggregator.partition_patients, student._read_release, PCACompressor.sensitivity)
    for mutant in OBSERVER_MUTANTS:
        if mutant.pipeline == "pate":
            with mutant.plant():
                pass
    after = (pate.partition_patients, aggregator.partition_patients, student._read_release, PCACompressor.sensitivity)
    assert after == before


def test_the_command_line_offers_the_pate_pipeline_and_names_its_units(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--observer", "pate", "--units", "huge,bogus"]) == 2
    err = capsys.readouterr().err
    assert "not a unit of pate" in err and "colliding" in err and "HINT" in err
