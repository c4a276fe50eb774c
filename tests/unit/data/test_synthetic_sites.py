"""Sites of the synthetic pathology generator: a hospital's systematic shift of every patient it renders."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from lightning_dp.data import SITES, SiteStyle, SyntheticPathologyDataModule, generate_synthetic_pathology, site_style
from lightning_dp.data import render_synthetic_patient as render
from lightning_dp.errors import PrivacyConfigError

SMALL = {"num_patients": 3, "patches_per_patient": 4, "image_size": 32}
# sha256 of render_synthetic_patient(default_rng([0, 1]), 6, 32, 0.5) by the generator of commit 9bdff5a (no sites).
PRE_SITE_DIGEST = "8aed355d6e40584e01cdac235b720a1e23ffdb07c95f699ed7a8d64969bb72d3"


def test_the_reference_site_renders_the_same_bytes_as_no_site(tmp_path: Path) -> None:
    for site in (None, "reference", SiteStyle(), {}):
        images, labels = render(np.random.default_rng([0, 1]), 6, 32, 0.5, site)
        base_images, base_labels = render(np.random.default_rng([0, 1]), 6, 32, 0.5)
        assert np.array_equal(images, base_images) and np.array_equal(labels, base_labels)
    # ... and the same bytes as the generator had before sites existed (digest computed with that version).
    images, labels = render(np.random.default_rng([0, 1]), 6, 32, 0.5, "reference")
    assert hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest() == PRE_SITE_DIGEST
    # The cached data set of a reference site keeps the parameters it had before sites existed.
    generate_synthetic_pathology(tmp_path, site="reference", **SMALL)
    assert "site" not in json.loads((tmp_path / "synthetic.json").read_text())


def _colour_statistics(site: object, patients: int = 12) -> np.ndarray:
    means = [render(np.random.default_rng([7, p]), 8, 32, 0.5, site)[0].reshape(-1, 3).mean(0) for p in range(patients)]
    return np.array(means)


def test_a_site_shifts_every_patient_the_same_way_beyond_the_spread_between_patients() -> None:
    reference = _colour_statistics("reference")
    shifted = _colour_statistics("hospital_b")
    # The same patients (same generator states) seen at another hospital: their mean colours move together.
    difference = shifted - reference
    channel = int(np.abs(difference.mean(0)).argmax())  # on the most shifted channel, every patient moves alike
    assert np.all(np.sign(difference[:, channel]) == np.sign(difference[:, channel].mean()))
    # The shift of the site means exceeds twice the standard error of the patients' means.
    standard_error = reference.std(0) / np.sqrt(len(reference))
    assert np.abs(difference.mean(0)).max() > 2.0 * standard_error.max()


def test_lower_magnification_shows_smaller_glomeruli() -> None:
    def dark_fraction(magnification: float) -> float:
        # Positive-only patients: the dark (nuclear) area of a glomerulus shrinks with the magnification squared.
        images = np.concatenate(
            [render(np.random.default_rng([3, p]), 8, 64, 1.0, {"magnification": magnification})[0] for p in range(6)]
        )
        return float((images.mean(-1) < 120).mean())

    assert dark_fraction(0.6) < 0.8 * dark_fraction(1.0)


def test_sites_are_part_of_the_cached_parameters(tmp_path: Path) -> None:
    generate_synthetic_pathology(tmp_path, site="hospital_b", **SMALL)
    stored = json.loads((tmp_path / "synthetic.json").read_text())
    assert stored["site"] == SITES["hospital_b"].as_dict()
    first = (tmp_path / "images/P0000/P0000_00.png").read_bytes()
    generate_synthetic_pathology(tmp_path, site={"magnification": 0.9}, **SMALL)  # other site: regenerated
    assert json.loads((tmp_path / "synthetic.json").read_text())["site"]["magnification"] == 0.9
    assert (tmp_path / "images/P0000/P0000_00.png").read_bytes() != first


def test_the_datamodule_takes_a_site_by_name_or_fields(tmp_path: Path) -> None:
    data = SyntheticPathologyDataModule(root=str(tmp_path), site={"eosin_strength": 1.4}, augment=False, **SMALL)
    data.prepare_data()
    assert json.loads((tmp_path / "synthetic.json").read_text())["site"]["eosin_strength"] == 1.4
    assert data.hparams["site"] == {"eosin_strength": 1.4}


@pytest.mark.parametrize(
    ("site", "match"),
    [
        ("hospital_z", r"unknown site.*hospital_b"),
        ({"zoom": 2.0}, r"unknown field\(s\) \['zoom'\]"),
        ({"magnification": 0.0}, r"magnification.*0"),
        ({"white_balance": (1.0, 1.0)}, r"3 gains.*found 2"),
        ({"noise": float("nan")}, r"noise"),
        (3, r"found int"),
    ],
)
def test_bad_sites_are_refused_with_the_value_and_a_hint(site: object, match: str) -> None:
    with pytest.raises(PrivacyConfigError, match=match) as info:
        site_style(site)  # type: ignore[arg-type]
    assert "HINT" in str(info.value)
