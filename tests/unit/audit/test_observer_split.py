"""The observer's audit of the default split: a manifest without a ``split`` column, the config's fractions.

The pipelines of `test_observer.py` write each patient's split into the manifest, so the split of a user's manifest
without one (``val_fraction`` in the config) was never replayed: the stratified split, then the only one, re-dealt
every patient when one was added, and the audit did not see it. Here D has 10 patients and no split column; D′ adds
one. The per-patient split (the default) passes with the release moved by C; the stratified one fails on the release
(the split channel: other patients left or joined the training set). The secret purposes are varied by
`test_observer.py` already: here only D twice and D′ (three worlds each).
"""

from __future__ import annotations

import pytest

from lightning_dp.audit.observer import FitPipeline, ObserverAudit, PatePipeline

SPLITS = "splits (patients of each split, less the added unit)"


def test_the_per_patient_split_of_a_manifest_without_a_split_column_passes() -> None:
    result = ObserverAudit(FitPipeline("p3sgd", patients=6, steps=2, split="per_patient"), ["huge"], vary=()).run()
    assert result.passed, result.summary()
    assert result.pipeline == "fit-p3sgd-split"
    assert result.moved["huge"] == pytest.approx(1.0, abs=1e-4)  # the added patient trains, and no other moved


def test_the_stratified_split_fails_the_audit_on_the_split_channel() -> None:
    pipeline = FitPipeline("p3sgd", patients=6, steps=2, split="stratified")
    result = ObserverAudit(pipeline, ["huge"], vary=(), master=5).run()
    assert not result.passed
    # p01 and p06 left the training set for p08 and p09. Their clipped updates are close to those of the patients of
    # the same label, so the first release moves by about C (within the round-off tolerance or just beyond it,
    # depending on the secrets); the split channel shows the move whatever the release hides.
    assert {f.channel for f in result.findings} <= {SPLITS, "first release"}, result.summary()
    [finding] = [f for f in result.findings if f.channel == SPLITS]
    assert finding.check == "D vs D+huge" and "train: p00 p01 p02 p03 p05 p06 p07" in finding.left, finding
    assert "train: p00 p02 p03 p05 p07 p08 p09" in finding.right, finding


def test_pate_on_a_manifest_without_a_split_column_passes() -> None:
    # The teachers' and the student's data split by the configs' fractions, the public queries included: the added
    # patient joins one teacher's partition, and no other patient moves (the teachers' partitions are channels).
    pipeline = PatePipeline(split="per_patient", name="pate-split")
    result = ObserverAudit(pipeline, ["huge"], vary=(), master=5).run()
    assert result.passed, result.summary()
    assert len(result.changed["huge"]) == 1 and 0 < result.moved["huge"] < 0.1, result.summary()
