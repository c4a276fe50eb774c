"""The observer tier's PATE pipeline (issue 43 §1): teachers, the noisy vote, the labels kept with their ledger.

`PatePipeline` runs what a user runs for PATE — ``lightning-dp fit`` of each teacher on its partition, then of the
student (the aggregation through `PATEStudentDataModule`), then the student again in the same folder — on D and on D
plus one adversarial patient, every secret held equal by a `SecretTape`. The release is each public query's noisy mean
code: held to the sensitivity it is charged for, S = √d (one patient is in one teacher's partition; PCA keeps a map in
[0, 1]^d within √d), with at most one teacher changed. Each world's rules: every release charged by the ledger, and a
rerun that releases nothing.
"""

from __future__ import annotations

import pytest

from lightning_dp.audit.observer import ObserverAudit, PatePipeline
from lightning_dp.cli import main


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


def test_the_command_line_offers_the_pate_pipeline_and_names_its_units(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--observer", "pate", "--units", "huge,bogus"]) == 2
    err = capsys.readouterr().err
    assert "not a unit of pate" in err and "colliding" in err and "HINT" in err
