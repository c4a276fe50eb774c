"""Issue 34, item 5: every renamed module's old import path gives the very same objects as the new one.

The old paths are kept for one release (each a thin re-exporting module); a config or a user's import that names
the old path must keep building the same classes until then.
"""

from __future__ import annotations

import importlib
import pickle
from types import ModuleType

import jsonargparse
import pytest

#: (old module, new module, names the old one must give).
ALIASES = [
    (
        "lightning_dp.selection",
        "lightning_dp.acceptance",
        ["AlwaysAccept", "AnnealedAcceptance", "EnergySource", "StepAcceptance", "ThresholdAcceptance"],
    ),
    (
        "lightning_dp.selection.acceptance",
        "lightning_dp.acceptance.rules",
        [
            "FORMAT_VERSION",
            "AlwaysAccept",
            "AnnealedAcceptance",
            "EnergySource",
            "StepAcceptance",
            "ThresholdAcceptance",
        ],
    ),
    (
        "lightning_dp.audit.engine",
        "lightning_dp.audit.callback_audit",
        [
            "NOISE_CHECK_SIGNIFICANCE",
            "POWER",
            "VERDICT_RULE",
            "CallbackAudit",
            "CallbackAuditResult",
            "check_units",
            "fit_world",
            "gdp_mu_lower",
        ],
    ),
    (
        "lightning_dp.segmentation",
        "lightning_dp.pate",
        [
            "AutoencoderCompressor",
            "Compressor",
            "PATEAggregator",
            "PATEReport",
            "PATEResult",
            "PATEStudentDataModule",
            "PCACompressor",
            "check_maps",
            "check_partitions",
            "encoded_maps",
            "partition_patients",
            "pate_epsilon",
            "pate_noise_multiplier",
            "teacher_of",
            "thesis_epsilon",
            "thesis_epsilon_of_ledger",
            "thesis_noise_multiplier",
        ],
    ),
    (
        "lightning_dp.segmentation.compression",
        "lightning_dp.pate.compression",
        ["AutoencoderCompressor", "Compressor", "PCACompressor", "check_maps"],
    ),
    (
        "lightning_dp.segmentation.pate",
        "lightning_dp.pate.aggregator",
        [
            "PATEAggregator",
            "PATEReport",
            "PATEResult",
            "check_partitions",
            "encoded_maps",
            "partition_patients",
            "pate_epsilon",
            "pate_noise_multiplier",
            "teacher_of",
            "thesis_epsilon",
            "thesis_epsilon_of_ledger",
            "thesis_noise_multiplier",
        ],
    ),
    ("lightning_dp.segmentation.student", "lightning_dp.pate.student", ["PATEStudentDataModule"]),
    *[
        ("lightning_dp.training.trainer", f"lightning_dp.training.{new}", names)
        for new, names in {
            "trainer_checks": [
                "check_loader_in_use",
                "check_public_energy",
                "map_style_training_data",
                "refuse_averaging_before_conversion",
                "refuse_batch_norm_reset",
                "refuse_budget_conflicts",
                "refuse_unsupported_trainer",
                "resolve_delta",
            ],
            "run_length": ["planned_length", "planned_steps", "warn_calibrated_debug_run"],
            "logged_metrics": ["install_log_filter", "log_every_step", "nonfinite_losses"],
            "manual_optimization": ["public_loss", "step_optimizers", "step_schedulers"],
        }.items()
    ],
]


def _module(path: str) -> ModuleType:
    return importlib.import_module(path)


IDS = [f"{old}->{new}" for old, new, _ in ALIASES]


@pytest.mark.parametrize(("old", "new", "names"), ALIASES, ids=IDS)
def test_the_old_path_gives_the_same_objects(old: str, new: str, names: list[str]) -> None:
    old_module, new_module = _module(old), _module(new)
    missing = [name for name in names if not hasattr(old_module, name)]
    assert not missing, f"{old} lost {missing}"
    different = [name for name in names if getattr(old_module, name) is not getattr(new_module, name)]
    assert not different, f"{old} and {new} give different objects for {different}"
    assert old_module.__doc__ and new in old_module.__doc__.replace("`", ""), f"{old}'s docstring must name {new}"


@pytest.mark.parametrize(("old", "new", "names"), ALIASES, ids=IDS)
def test_a_pickle_that_names_the_old_module_loads_the_same_class(old: str, new: str, names: list[str]) -> None:
    # A pickle names a class by its module then (Lightning's hyper-parameters may pickle objects of these classes).
    classes = [name for name in names if isinstance(getattr(_module(new), name), type)]
    for name in classes:
        assert pickle.loads(f"c{old}\n{name}\n.".encode()) is getattr(_module(new), name)


@pytest.mark.parametrize(
    ("base", "class_path", "init_args", "new"),
    [
        (
            "lightning_dp.acceptance.StepAcceptance",
            "lightning_dp.selection.AnnealedAcceptance",
            {"q0": 5.0, "mu0": 3},
            "lightning_dp.acceptance.AnnealedAcceptance",
        ),
        (
            "lightning_dp.pate.Compressor",
            "lightning_dp.segmentation.PCACompressor",
            {"code_dim": 3},
            "lightning_dp.pate.PCACompressor",
        ),
    ],
)
def test_an_old_class_path_in_a_config_builds_the_same_class(
    base: str, class_path: str, init_args: dict[str, object], new: str
) -> None:
    # As LightningCLI reads `class_path` / `init_args` (through jsonargparse) from a config written before the rename.
    def resolve(path: str) -> type:
        module, _, name = path.rpartition(".")
        return getattr(_module(module), name)

    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--built", type=resolve(base))
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    built = instantiate(parser.parse_object({"built": {"class_path": class_path, "init_args": init_args}})).built
    assert type(built) is resolve(new)
    assert {key: getattr(built, key) for key in init_args} == init_args


def test_the_split_trainer_module_still_gives_every_name_it_had() -> None:
    # training/trainer.py was split by subject into four modules: the old module re-exports all 17 functions.
    from lightning_dp.training import trainer

    split = {name for old, _, names in ALIASES if old == "lightning_dp.training.trainer" for name in names}
    assert set(trainer.__all__) == split and len(split) == 17


def test_selection_is_the_old_name_of_noise_selection() -> None:
    import lightning_dp.sanitization as sanitization
    from lightning_dp.sanitization import release

    assert sanitization.Selection is release.Selection is release.NoiseSelection is sanitization.NoiseSelection
    assert "Selection" in sanitization.__all__ and "Selection" in release.__all__
    assert pickle.loads(b"clightning_dp.sanitization.release\nSelection\n.") is release.NoiseSelection
    assert release.Selection(0.316, 3.0) == release.NoiseSelection(epsilon=0.316, loss_bound=3.0)
