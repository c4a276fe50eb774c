"""The things a user runs, each as a pipeline that plays one world and returns what an observer sees.

* `FitPipeline`: ``lightning-dp fit --config`` in this process (the command's LightningCLI run), on a manifest of
  PNG images the pipeline writes (P3SGD: the unit is a patient; DP-SGD: an image), in a folder of its own that it
  makes the working folder, so that the two worlds' configs, paths and outputs are the same text. The manifest
  declares each patient's split in a ``split`` column, or (``split="per_patient"``, ``"stratified"``) has none and
  the config's fractions split the patients: the default path of a user's data.
* `TunePipeline`: ``lightning-dp tune``'s search (`lightning_dp.tuning.tune`) of `FitPipeline`'s config: the
  release is the best trial (its model, hyperparameters and scores); K, the other trials and the index stay in
  ``private/`` (the data holder's).
* `FederatedPipeline`: federated P3SGD as deployed — each hospital a `Site` behind the ``ClientApp`` of `site_app`,
  the ``ServerApp`` of `server_app` over `LocalGrid` (Flower's messages, in one process), which drops a reply that
  arrives after the deadline as the deployment's grid does.

A pipeline declares what is public before any data are seen (N, the steps or rounds, C, q, the multiplier, the
deadline) and which secret purposes its guarantee rests on (``purposes``).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_dp.audit.observer.channels import (
    Observation,
    normalize,
    observe_console,
    observe_releases,
    observe_splits,
    scan_files,
    splits_channel,
)
from lightning_dp.audit.observer.units import Unit, unit_images

__all__ = ["BUILTIN", "FederatedPipeline", "FitPipeline", "PatePipeline", "TunePipeline", "builtin_pipeline"]


@contextlib.contextmanager
def _inside(folder: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def _outcome(err: BaseException | None, roots: tuple[str, ...]) -> str:
    if err is None:
        return "ran"
    return normalize(f"{type(err).__name__}: {err}", roots)


def _png(path: Path, image: np.ndarray) -> None:
    from PIL import Image

    Image.fromarray((np.clip(image, 0, 1) * 255).astype(np.uint8), mode="L").save(path)


@dataclass
class FitPipeline:
    """``lightning-dp fit`` of a small config (``engine``: ``"p3sgd"`` or ``"dpsgd"``) on written PNG patients.

    D holds ``patients`` training patients of ``images`` images each (a bright square marks label 1) and 4
    validation patients; N is declared as ``patients + 1`` (the protocol's number, fixed before the data are
    counted: D′'s count). ``overrides`` replace keys of the config's callback (e.g. a mutant's setting).

    ``split`` says how D's patients are split. ``"column"`` (default): the manifest's ``split`` column, the data
    holder's split declared before the data are counted. ``"per_patient"`` or ``"stratified"``: no column (what a
    user's manifest usually is); the config's ``val_fraction`` (test 0) and ``split_method`` split all ``patients + 4``
    patients, and the added unit is one more patient of the manifest. With ``split_seed`` 0 and ``val_fraction`` 0.3
    the per-patient split trains 6 of the 10 patients of ``patients=6`` and puts the unit (``zz_unit``) in training.
    The stratified split re-deals every patient when one is added, which the audit sees as a release moved by more
    than C (the split channel).
    """

    engine: str = "p3sgd"
    patients: int = 8
    images: int = 3
    size: int = 16
    steps: int = 3
    sample_rate: float = 1.0
    clip_norm: float = 0.05
    noise_multiplier: float = 1.0
    purposes: tuple[str, ...] = ("noise", "coins")
    overrides: dict[str, Any] = field(default_factory=dict)
    augment: bool = True
    split: str = "column"
    val_fraction: float = 0.3

    @property
    def name(self) -> str:
        return f"fit-{self.engine}" + {"column": "", "per_patient": "-split"}.get(self.split, f"-{self.split}-split")

    @property
    def units_declared(self) -> int:
        return self.patients + 1 if self.engine == "p3sgd" else self.patients * self.images + 1

    def _config(self) -> dict[str, Any]:
        dp: dict[str, Any]
        if self.engine == "p3sgd":
            dp = {
                "class_path": "lightning_dp.callbacks.P3SGD",
                "init_args": {
                    "num_patients": self.units_declared,
                    "sample_rate": self.sample_rate,
                    "clip_norm": self.clip_norm,
                    "noise_scales": [self.noise_multiplier],
                    "local_lr": 0.5,
                    "local_batch_size": 4,
                    "delta": 1e-5,
                },
            }
        elif self.engine == "dpsgd":
            dp = {
                "class_path": "lightning_dp.callbacks.DPSGD",
                "init_args": {
                    "num_samples": self.units_declared,
                    "sample_rate": self.sample_rate,
                    "clip_norm": self.clip_norm,
                    "noise_multiplier": self.noise_multiplier,
                    "delta": 1e-5,
                },
            }
        else:
            raise ValueError(f"FitPipeline(engine={self.engine!r}): 'p3sgd' or 'dpsgd'.")
        dp["init_args"].update(self.overrides)
        return {
            "seed_everything": 0,
            "trainer": {
                "accelerator": "cpu",
                "devices": 1,
                "max_steps": self.steps,
                "default_root_dir": "runs",
                "enable_progress_bar": False,
                "enable_model_summary": False,
                "limit_val_batches": 1,
                "num_sanity_val_steps": 0,
                "callbacks": [
                    dp,
                    {
                        "class_path": "pytorch_lightning.callbacks.ModelCheckpoint",
                        "init_args": {
                            "dirpath": "runs/checkpoints",
                            "filename": "last",
                            "enable_version_counter": False,
                        },
                    },
                ],
            },
            "model": {
                "class_path": "lightning_dp.models.ImageClassifier",
                "init_args": {
                    "arch": "small_cnn",
                    "num_classes": 2,
                    "in_channels": 1,
                    "trainable": ["norm", "head"],
                    "lr": 1.0,
                    "optimizer": "sgd",
                },
            },
            "data": {
                "class_path": "lightning_dp.data.PatientDataModule",
                "init_args": {
                    "manifest": "data/manifest.csv",
                    "image_size": self.size,
                    "batch_size": 8,
                    "augment": self.augment,
                    **self._split_args(),
                },
            },
        }

    def _split_args(self) -> dict[str, Any]:
        """The config's split of a manifest without a ``split`` column (nothing with one: the column decides)."""
        if self.split == "column":
            return {}
        if self.split not in ("per_patient", "stratified"):
            raise ValueError(f"FitPipeline(split={self.split!r}): 'column', 'per_patient' or 'stratified'.")
        return {"val_fraction": self.val_fraction, "test_fraction": 0.0, "split_seed": 0, "split_method": self.split}

    def _write_data(self, folder: Path, unit: Unit | None) -> None:
        data = folder / "data"
        data.mkdir(parents=True)
        column = self.split == "column"
        rows = ["path,label,patient_id" + (",split" if column else "")]
        g = np.random.default_rng(0)  # public and fixed: D is the same in every world

        def patient(pid: str, label: int, split: str, images: list[np.ndarray]) -> None:
            for k, image in enumerate(images):
                name = f"{pid}_{k}.png"
                _png(data / name, image)
                rows.append(f"{name},{label},{pid}" + (f",{split}" if column else ""))

        for i in range(self.patients + 4):
            label, split = i % 2, ("train" if i < self.patients else "val")
            images = []
            for _ in range(self.images):
                image = 0.3 * g.random((self.size, self.size), dtype=np.float32)
                if label:
                    image[2:6, 2:6] += 0.6
                images.append(image)
            patient(f"p{i:02d}", label, split, images)
        if unit is not None:  # appended last: the other units keep their order and keys
            if self.engine == "dpsgd" and unit.images is not None:
                unit = Unit(unit.name, unit.images[:1], unit.label, unit.kind)  # one image: DP-SGD's unit
            if unit.images is None:
                (data / "zz_unit_0.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
                rows.append(f"zz_unit_0.png,{unit.label},zz_unit" + (",train" if column else ""))
            else:
                patient("zz_unit", unit.label, "train", unit.images)
        (data / "manifest.csv").write_text("\n".join(rows) + "\n")

    def run(self, unit: str | None, folder: Path) -> Observation:
        """One world (D, or D plus the adversarial ``unit``) in ``folder``; what an observer sees of it."""
        import yaml  # type: ignore[import-untyped]

        from lightning_dp._cli_lightning import run_lightning  # what `lightning-dp fit` runs

        folder.mkdir(parents=True, exist_ok=True)
        self._write_data(folder, None if unit is None else unit_images(unit, self.size))
        (folder / "config.yaml").write_text(yaml.safe_dump(self._config()))
        roots = (str(folder.resolve()), str(folder))
        obs = Observation()
        err: BaseException | None = None
        code: Any = None
        with (
            _inside(folder),
            observe_releases() as releases,
            observe_splits() as splits,
            observe_console(roots) as console,
        ):
            try:
                code = run_lightning(["fit", "--config", "config.yaml"], "fit")
            except BaseException as caught:  # noqa: BLE001 — a refusal, an error or an exit is a channel
                if isinstance(caught, KeyboardInterrupt):
                    raise
                err = caught
        obs.releases = releases
        obs.channels["outcome"] = _outcome(err, roots) if err is not None else f"exit {code}"
        obs.channels["splits (patients of each split, less the added unit)"] = splits_channel(splits, ("zz_unit",))
        # The console and the training checkpoint are the data holder's (the config says the checkpoint is as
        # private as the data); what is published is the model without the privacy state, the logs and reports.
        obs.holder.update({f"console.{k}": v for k, v in console.items()})
        trained = folder / "runs" / "checkpoints" / "last.ckpt"
        if trained.is_file():
            from lightning_dp.checkpoints import publishable_checkpoint

            (folder / "published").mkdir()
            publishable_checkpoint(trained, folder / "published" / "model.ckpt")
        files, derived = scan_files(folder, ("data/", "config.yaml"), roots)
        for key, value in files.items():
            (obs.holder if key.startswith("runs/checkpoints/") else obs.channels)[f"file {key}"] = value
        obs.derived.update(derived)
        return obs


@dataclass
class FederatedPipeline:
    """Federated P3SGD through Flower's messages: ``sites`` hospitals of ``patients`` patients, the unit at site b.

    The server's app runs with run config ``rounds``, ``sites``, a ``round-timeout`` of ``deadline`` seconds and a
    report; each site caps a patient's work at ``max_images`` images per round (public, declared). N is declared as
    the consortium's patients plus one. ``noise_at="sites"`` adds the noise as the sites' shares (z·C/√m each);
    ``secure=True`` sums them with SecAgg+ (the server sees the sum only).
    """

    sites: int = 2
    patients: int = 6
    images: int = 3
    rounds: int = 2
    sample_rate: float = 1.0
    clip_norm: float = 0.05
    noise_multiplier: float = 1.0
    deadline: float = 30.0
    max_images: int = 8
    whale_images: int = 200_000
    noise_at: str = "server"
    secure: bool = False
    purposes: tuple[str, ...] = ()
    check_ids: bool = True
    #: Public by the consortium's agreement: a shared patient id refuses the start (one bit, before any training).
    declared_refusals: tuple[str, ...] = ("patient ids appear at more than one site",)

    def __post_init__(self) -> None:
        if self.secure and self.noise_at != "sites":
            raise ValueError("FederatedPipeline(secure=True): SecAgg+ sums the sites' shares; set noise_at='sites'.")
        if not self.purposes:  # what the guarantee rests on: the server's noise, or the sites' shares
            self.purposes = ("noise", "site") if self.noise_at == "server" else ("share", "site")

    @property
    def name(self) -> str:
        return "federated" + ("" if self.noise_at == "server" else "-secagg" if self.secure else "-sites")

    @property
    def replay_tolerance(self) -> float:
        """How far (·C) one world's release may move when replayed under equal secrets (0 but with SecAgg+).

        SecAgg+ rounds each coordinate stochastically with randomness of its own (≤ 2·range/levels per site and
        coordinate: far below 1e-3·C here).
        """
        return 1e-3 if self.secure else 0.0

    @property
    def units_declared(self) -> int:
        return self.sites * self.patients + 1

    def _site_data(self, name: str, unit: Unit | None) -> tuple[Any, list[list[int]], list[str]]:
        from lightning_dp.audit.observer.datasets import UnitImages

        g = np.random.default_rng(sum(map(ord, name)))  # public and fixed: D is the same in every world
        images: list[np.ndarray | None] = []
        labels: list[int] = []
        groups: list[list[int]] = []
        keys: list[str] = []
        for p in range(self.patients):
            label = p % 2
            start = len(images)
            for _ in range(self.images):
                image = 0.3 * g.random((6,), dtype=np.float32)
                image[label] += 0.6
                images.append(image)
                labels.append(label)
            groups.append(list(range(start, len(images))))
            keys.append(f"{name}-{p}")
        if unit is not None:
            start = len(images)
            if unit.images is None:  # reading it raises
                images.append(None)
                labels.append(unit.label)
            else:
                for image in unit.images:
                    images.append(image.reshape(-1)[:6].astype(np.float32))
                    labels.append(unit.label)
            groups.append(list(range(start, len(images))))
            keys.append("a-0" if unit.name == "colliding" else f"{name}-unit")  # a-0: site a's first patient
        return UnitImages(images, labels), groups, keys

    def run(self, unit: str | None, folder: Path) -> Observation:
        """One world: the consortium, with the adversarial ``unit`` added at site b (or not)."""
        from flwr.app import Context, RecordDict

        from lightning_dp.federated import FederatedServer, Site, share_std
        from lightning_dp.federated.flower import LocalGrid, server_app, site_app
        from lightning_dp.sanitization import ModelState
        from lightning_dp.training.patient_rounds import LocalSGD, PatientData, RoundParts

        folder.mkdir(parents=True, exist_ok=True)
        added = None if unit is None else unit_images(unit, 6, whale_images=self.whale_images)
        names = [chr(ord("a") + k) for k in range(self.sites)]

        def model() -> torch.nn.Module:
            torch.manual_seed(0)  # θ₀ is public
            return torch.nn.Linear(6, 2)

        def make_site(context: Context) -> Site:
            name = str(context.node_config["site"])
            dataset, groups, keys = self._site_data(name, added if name == "b" else None)
            net = model()

            def step(batch: Any, batch_idx: int) -> torch.Tensor:
                return torch.nn.functional.cross_entropy(net(batch[0]), batch[1])

            local = LocalSGD(lr=0.5, batch_size=4, max_images=self.max_images)
            parts = RoundParts(net, ModelState(net), step, PatientData(dataset, groups, keys), local, self.clip_norm)
            shares = self.noise_at == "sites"
            std = share_std(self.noise_multiplier, self.clip_norm, self.sites) if shares else 0.0
            return Site(name, parts, sample_rate=self.sample_rate, noise_std=std)

        def make_server(context: Context) -> FederatedServer:
            return FederatedServer(
                model(),
                num_patients=self.units_declared,
                sample_rate=self.sample_rate,
                clip_norm=self.clip_norm,
                noise=self.noise_multiplier,
                noise_at="sites" if self.noise_at == "sites" else "server",
                sites=self.sites if self.noise_at == "sites" else None,
            )

        config: dict[str, bool | float | int | str] = {
            "rounds": self.rounds,
            "sites": self.sites,
            "round-timeout": self.deadline,
            "start-timeout": 10.0,
            "report": "report.json",
            "model": "model.pt",
            "secure-aggregation": self.secure,
            "check-patient-ids": self.check_ids,
        }
        key = (lambda context: b"the consortium's id key, shared") if self.check_ids else None
        grid = LocalGrid(site_app(make_site, id_key=key), [{"site": n} for n in names], run_config=config)
        roots = (str(folder.resolve()), str(folder))
        obs = Observation()
        err: BaseException | None = None
        site_logs = ("lightning_dp.federated.site",)  # a hospital's own log: its operator reads it, not the server
        with _inside(folder), observe_releases() as releases, observe_console(roots, site_logs) as console:
            try:
                context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config=config)
                server_app(make_server)(grid, context)
            except Exception as caught:  # noqa: BLE001 — a refusal or an error is a channel
                err = caught
        obs.releases = releases
        obs.channels["outcome"] = _outcome(err, roots)
        holder = console.pop("holder_log")
        obs.channels.update({f"console.{k}": v for k, v in console.items()})
        obs.holder["console.site_logs"] = holder
        files, derived = scan_files(folder, (), roots, released=("model.pt",))
        obs.channels.update({f"file {k}": v for k, v in files.items()})
        obs.derived.update(derived)
        return obs


#: A search file's published report fields that are the best trial's release (its hyperparameters and scores).
_RELEASED_REPORT = ("best",)


@dataclass
class TunePipeline:
    """``lightning-dp tune`` over `FitPipeline`'s config (P3SGD) with E[K] = ``mean_trials`` and a learning-rate space.

    What is published is ``best/``: its config, scores and model are the release (derived here), and every other
    field of its reports must be equal across worlds; ``private/`` and the console are the data holder's. Each trial
    is a ``fit`` whose releases `FitPipeline` audits; here the releases are the best model's weights (``derived``).
    Varying the ``trials`` secret (K and the trials' draws) need not change the best (``hidden``): it must change
    nothing else.
    """

    patients: int = 6
    steps: int = 2
    mean_trials: float = 2.0
    total_epsilon: float = 8.0
    clip_norm: float = 0.05
    purposes: tuple[str, ...] = ("noise",)
    hidden: tuple[str, ...] = ("trials",)
    name: str = "tune"

    def run(self, unit: str | None, folder: Path) -> Observation:
        """One world: the search of D (or D plus ``unit``) in ``folder``; what an observer sees of ``best/``."""
        import yaml

        from lightning_dp.tuning import tune  # what `lightning-dp tune` runs (the command adds its console lines)

        fit = FitPipeline("p3sgd", patients=self.patients, steps=self.steps, clip_norm=self.clip_norm)
        folder.mkdir(parents=True, exist_ok=True)
        fit._write_data(folder, None if unit is None else unit_images(unit, fit.size))
        config = fit._config()
        args = config["trainer"]["callbacks"][0]["init_args"]
        args.pop("noise_scales")
        args["target_epsilon"] = self.total_epsilon  # tune replaces it with the trial's calibrated noise
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        search = {
            "total_epsilon": self.total_epsilon,
            "trials": {"mean": self.mean_trials, "distribution": "geometric"},
            "score": {"metric": "val/acc", "mode": "max", "validation": "public"},
            "space": {"model.init_args.lr": [0.5, 1.0], "trainer.callbacks.P3SGD.init_args.local_lr": [0.2, 0.5]},
        }
        (folder / "search.yaml").write_text(yaml.safe_dump(search))
        roots = (str(folder.resolve()), str(folder))
        obs = Observation()
        err: BaseException | None = None
        code: Any = None
        with _inside(folder), observe_console(roots) as console:
            try:
                tune("config.yaml", "search.yaml", "search")
                code = 0
            except Exception as caught:  # noqa: BLE001 — a refusal or an error is a channel
                err = caught
        obs.channels["outcome"] = _outcome(err, roots) if err is not None else f"exit {code}"
        obs.holder.update({f"console.{k}": v for k, v in console.items()})
        best = folder / "search" / "best"
        report = best / "search_report.json"
        if report.is_file():
            import json

            fields = json.loads(report.read_text())
            for key in _RELEASED_REPORT:
                obs.derived[f"report.{key}"] = fields.pop(key, None)
            text = json.dumps(fields, sort_keys=True, indent=1)
            obs.channels["file search/best/search_report.json"] = text.splitlines()
        files, derived = scan_files(folder / "search", ("private/",), roots, released=("best/model.ckpt",))
        for key, value in files.items():
            if key in ("best/search_report.json",):
                continue
            if key == "best/privacy_report.txt":  # the report as text: its best line is the release
                obs.channels[f"file search/{key}"] = [x for x in value if not x.startswith("  best ")]
                obs.derived[key] = [x for x in value if x.startswith("  best ")]
            elif key in ("best/config.yaml", "best/scores.json"):
                obs.derived[key] = value  # the best trial's hyperparameters and scores
            else:
                obs.channels[f"file search/{key}"] = value
        obs.derived.update(derived)
        private = folder / "search" / "private"
        obs.holder["files private/"] = sorted(
            normalize(p.relative_to(private).as_posix(), roots) for p in private.rglob("*")
        )
        return obs


def _runs(values: list[float]) -> str:
    """``values`` run-length encoded, exactly: ``"4 × 5.19790291391601"``; ``"none"`` when empty."""
    out: list[list[Any]] = []
    for v in values:
        if out and out[-1][1] == v:
            out[-1][0] += 1
        else:
            out.append([1, v])
    return ", ".join(f"{n} × {v!r}" for n, v in out) or "none"


@dataclass
class PatePipeline:
    """PATE's release as a user runs it: K teachers by ``lightning-dp fit``, then the student, then the student again.

    D is a segmentation manifest of PNG images and masks with a ``split`` column (the data holder's split, declared
    before the data are counted): ``patients`` private training patients, one validation patient and ``public`` public
    patients, ``images`` images of ``size × size`` each. Teacher k of K = ``teachers`` is ``lightning-dp fit`` of the
    teacher config (``configs/segmentation_pate_teacher.yaml`` at tiny size) with ``--data.init_args.teacher=k``: an
    ordinary run on its partition of the training patients (a keyed hash of each patient's id). Then ``lightning-dp
    fit`` of the student config (``configs/segmentation_pate_student.yaml``): `PATEStudentDataModule` predicts the
    public queries with the K teachers, fits PCA on the atlas masks, releases the noisy mean codes through
    `PATEAggregator` (one `GaussianRelease` per query, σ = z·S/K, z calibrated to ``target_epsilon``), keeps them with
    their ledger in the release file, and the student trains on them. Then the same command again, in the same folder:
    the release is made once, so the rerun must reuse the labels and their ledger (two rules of each world: every
    release charged by the ledger, and no release by the rerun).

    The release of query n is its noisy mean code, with sensitivity S = √d: one patient is in one teacher's partition,
    and PCA keeps one teacher's map in [0, 1]^d within √d of any other (ALGORITHMS.md §5); the release must be charged
    for that S (``clip_norm``). Every query is answered by the same teachers, so every release, not only the first,
    may move by at most S (``every_release``), and at most one teacher's weights may change (``contributors``). The
    teachers, their files and the release file's requests (digests of the teachers' checkpoints) are the data holder's;
    so is the student's training checkpoint (the published model is `publishable_checkpoint`'s copy). The student's
    training metrics are post-processing (public images, released labels).

    ``split``: ``"column"`` (default) is the manifest's ``split`` column above; ``"per_patient"`` or ``"stratified"``
    writes no column, and the configs' ``val_fraction`` (0.1), ``public_fraction`` (0.4) and ``split_method`` split
    the same patients (their ids keep their letters, which then mean nothing): the default path of a user's
    manifest. With ``split_seed`` 1 the per-patient split trains 8 of the 11 patients, makes 2 public and 1 a
    validation patient, and trains the added unit (``zz_unit``). Which patients each split of every datamodule holds
    (the teachers' partitions included), less the added unit, is a channel.
    """

    teachers: int = 2
    patients: int = 6
    public: int = 4
    images: int = 2
    size: int = 16
    code_dim: int = 2
    target_epsilon: float = 2.0
    teacher_steps: int = 2
    student_steps: int = 2
    whale_images: int = 64
    purposes: tuple[str, ...] = ("noise",)
    name: str = "pate"
    #: Every query's release reads the same public queries and the same teachers: each is held to S, not the first.
    every_release: bool = True
    #: One patient is in one teacher's partition: at most one teacher may change between D and D′.
    max_changed_contributors: int = 1
    #: Refusals by the data holder's own check of its data, before anything is released (one teacher's ``fit`` reads
    #: every image of the manifest and refuses one it cannot decode or whose values are not finite, naming the file).
    declared_refusals: tuple[str, ...] = ("the image must be a readable file", "must have finite values")
    split: str = "column"
    split_seed: int = 1

    @property
    def inapplicable(self) -> dict[str, str]:
        """The adversarial units a segmentation manifest cannot hold, and why."""
        return {
            "empty": "a manifest lists images: a patient with none is not in it",
            "raising": "a manifest's image that fails to read is the unit `unreadable`",
        }

    @property
    def clip_norm(self) -> float:
        """S = √d, the sensitivity of Σ_k codes under PCA (d = the mask's pixels; ALGORITHMS.md §5)."""
        return float(self.size)

    def _model(self) -> dict[str, Any]:
        return {
            "class_path": "lightning_dp.models.SegmentationModule",
            "init_args": {
                "arch": "monai_unet",
                "in_channels": 1,
                "monai_channels": [4, 8],
                "monai_res_units": 0,
                "loss": "bce_dice",
                "lr": 0.003,
            },
        }

    def _data(self, teacher: int | None) -> dict[str, Any]:
        args: dict[str, Any] = {"manifest": "data/manifest.csv", "batch_size": 4}
        if self.split != "column":  # no split column: the config's fractions split the manifest's patients
            if self.split not in ("per_patient", "stratified"):
                raise ValueError(f"PatePipeline(split={self.split!r}): 'column', 'per_patient' or 'stratified'.")
            args.update(
                {
                    "val_fraction": 0.1,
                    "test_fraction": 0.0,
                    "public_fraction": 0.4,
                    "split_seed": self.split_seed,
                    "split_method": self.split,
                }
            )
        if teacher is not None:
            args.update({"num_teachers": self.teachers, "teacher": teacher})
        return {"class_path": "lightning_dp.data.SegmentationDataModule", "init_args": args}

    def _trainer(self, steps: int, root: str, val: int, dirpath: str | None) -> dict[str, Any]:
        return {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": steps,
            "max_epochs": 1,
            "default_root_dir": root,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "limit_val_batches": val,
            "num_sanity_val_steps": 0,
            "callbacks": [
                {
                    "class_path": "pytorch_lightning.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": dirpath, "filename": "last", "enable_version_counter": False},
                }
            ],
        }

    def _teacher_config(self) -> dict[str, Any]:
        trainer = self._trainer(self.teacher_steps, "teachers/teacher_0", 0, None)
        trainer["logger"] = False
        return {"seed_everything": 0, "trainer": trainer, "model": self._model(), "data": self._data(0)}

    def _student_config(self) -> dict[str, Any]:
        checkpoints = [f"teachers/teacher_{k}/checkpoints/last.ckpt" for k in range(self.teachers)]
        data = {
            "class_path": "lightning_dp.pate.PATEStudentDataModule",
            "init_args": {
                "data": self._data(None),
                "teacher_checkpoints": checkpoints,
                "compressor": {
                    "class_path": "lightning_dp.pate.PCACompressor",
                    "init_args": {"code_dim": self.code_dim},
                },
                "target_epsilon": self.target_epsilon,
                "delta": 1e-7,
                "batch_size": 4,
                "report_path": "runs/pate_privacy_report.txt",
                "release_path": "runs/pate_release.pt",
            },
        }
        trainer = self._trainer(self.student_steps, "runs/student", 1, "runs/student/checkpoints")
        trainer["log_every_n_steps"] = 1  # the student's training loss in TensorBoard, as a user would see it
        return {"seed_everything": 0, "trainer": trainer, "model": self._model(), "data": data}

    def _write_data(self, folder: Path, unit: Unit | None) -> None:
        data = folder / "data"
        data.mkdir(parents=True)
        column = self.split == "column"
        rows = ["image,mask,patient_id" + (",split" if column else "")]
        g = np.random.default_rng(0)  # public and fixed: D is the same in every world
        size = self.size

        def patient(pid: str, split: str, images: list[np.ndarray], masks: list[np.ndarray], tag: str = "") -> None:
            for k, (image, mask) in enumerate(zip(images, masks)):
                stem = f"{pid}{tag}_{k}"
                if np.isfinite(image).all():
                    _png(data / f"{stem}.png", image)
                    name = f"{stem}.png"
                else:  # a float array: what a manifest of .npy images can hold
                    np.save(data / f"{stem}.npy", image.astype(np.float32))
                    name = f"{stem}.npy"
                _png(data / f"{stem}_mask.png", mask.astype(np.float32))
                rows.append(f"{name},{stem}_mask.png,{pid}" + (f",{split}" if column else ""))

        splits = ["train"] * self.patients + ["val"] + ["public"] * self.public
        for i, split in enumerate(splits):
            images, masks = [], []
            for _ in range(self.images):
                mask = np.zeros((size, size), np.float32)
                top, left = (int(v) for v in g.integers(0, size // 2, 2))
                mask[top : top + size // 3, left : left + size // 3] = 1.0
                images.append(np.clip(0.3 * g.random((size, size), dtype=np.float32) + 0.6 * mask, 0, 1))
                masks.append(mask)
            patient(f"{split[0]}{i:02d}", split, images, masks)
        if unit is not None:  # appended last: the other patients keep their rows
            pid = "t00" if unit.name == "colliding" else "zz_unit"  # t00: a training patient of D
            if unit.images is None:
                (data / "zz_unit_0.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
                _png(data / "zz_unit_0_mask.png", np.zeros((size, size), np.float32))
                rows.append(f"zz_unit_0.png,zz_unit_0_mask.png,{pid}" + (",train" if column else ""))
            else:
                masks = [(np.nan_to_num(image) > 0.5).astype(np.float32) for image in unit.images]
                patient(pid, "train", list(unit.images), masks, tag="u")
        (data / "manifest.csv").write_text("\n".join(rows) + "\n")

    @staticmethod
    def _fit(argv: list[str], roots: tuple[str, ...]) -> str:
        """``lightning-dp fit ARGV``'s outcome: its exit status, with its one-line error when it refused."""
        from lightning_dp._cli_lightning import run_lightning  # what `lightning-dp fit` runs

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                code = run_lightning(argv, "fit")
        except BaseException as caught:  # noqa: BLE001 — a refusal, an error or an exit is a channel
            if isinstance(caught, KeyboardInterrupt):
                raise
            return _outcome(caught, roots)
        finally:
            sys.stderr.write(err.getvalue())  # the console still sees it
        said = [line for line in err.getvalue().splitlines() if "error:" in line]
        return f"exit {code}" + (f" ({normalize(said[-1], roots)})" if code and said else "")

    def run(self, unit: str | None, folder: Path) -> Observation:
        """One world (D, or D plus the adversarial ``unit``) in ``folder``; what an observer sees of it."""
        import yaml

        from lightning_dp.checkpoints import publishable_checkpoint
        from lightning_dp.training.privacy import state_digest

        folder.mkdir(parents=True, exist_ok=True)
        added = None if unit is None else unit_images(unit, self.size, whale_images=self.whale_images)
        self._write_data(folder, added)
        (folder / "teacher.yaml").write_text(yaml.safe_dump(self._teacher_config()))
        (folder / "student.yaml").write_text(yaml.safe_dump(self._student_config()))
        roots = (str(folder.resolve()), str(folder))
        obs = Observation()
        outcomes: list[str] = []
        first = 0
        with (
            _inside(folder),
            observe_releases() as releases,
            observe_splits() as splits,
            observe_console(roots) as console,
        ):
            for k in range(self.teachers):
                argv = ["fit", "--config", "teacher.yaml", f"--data.init_args.teacher={k}"]
                argv.append(f"--trainer.default_root_dir=teachers/teacher_{k}")
                outcomes.append(f"teacher {k}: " + self._fit(argv, roots))
                if not outcomes[-1].endswith("exit 0"):
                    break
            else:
                outcomes.append("student: " + self._fit(["fit", "--config", "student.yaml"], roots))
                first = len(releases)
                outcomes.append("student again: " + self._fit(["fit", "--config", "student.yaml"], roots))
        obs.releases = releases
        obs.channels["outcome"] = "; ".join(outcomes)
        # The colliding unit's rows are t00's (a patient of D): its split must not change either.
        obs.channels["splits (patients of each split, less the added unit)"] = splits_channel(splits, ("zz_unit",))
        obs.holder.update({f"console.{k}": v for k, v in console.items()})
        for k in range(self.teachers):  # what each teacher contributes: its weights (the teachers are never released)
            path = folder / "teachers" / f"teacher_{k}" / "checkpoints" / "last.ckpt"
            if path.is_file():
                weights = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
                obs.contributors[f"teacher {k}"] = state_digest(dict(weights))
        obs.holder["files teachers/"] = sorted(
            normalize(p.relative_to(folder).as_posix(), roots) for p in (folder / "teachers").rglob("*")
        )
        charged: list[float] = []
        release_file = folder / "runs" / "pate_release.pt"
        if release_file.is_file():
            stored = torch.load(release_file, map_location="cpu", weights_only=True)
            ledger = stored["ledger"]
            for event, count in zip(ledger["events"], ledger["counts"]):
                charged += [float(event.get("noise_multiplier", math.nan))] * int(count)
            obs.channels["file runs/pate_release.pt:ledger"] = normalize(repr(ledger), roots)
            obs.channels["file runs/pate_release.pt:private_data"] = normalize(repr(stored["private_data"]), roots)
            obs.channels["file runs/pate_release.pt:format_version"] = stored["format_version"]
            for i, entry in enumerate(stored["releases"]):
                obs.channels[f"file runs/pate_release.pt:releases[{i}].report"] = normalize(
                    repr(entry["report"]), roots
                )
                obs.derived[f"runs/pate_release.pt:releases[{i}].codes"] = entry["codes"].double()
                obs.derived[f"runs/pate_release.pt:releases[{i}].maps"] = entry["maps"].double()
                # the teachers' checkpoint digests: a function of the private data beyond the release
                obs.holder[f"file runs/pate_release.pt:releases[{i}].request"] = normalize(
                    repr(entry["request"]), roots
                )
            obs.holder["file runs/pate_release.pt:checksum"] = stored["checksum"]
        obs.rules["every release charged by the ledger (multipliers, in order)"] = (
            _runs([r.multiplier for r in releases]),
            _runs(charged),
        )
        obs.rules["the rerun releases nothing (the labels are made once)"] = (0, len(releases) - first)
        trained = folder / "runs" / "student" / "checkpoints" / "last.ckpt"
        if trained.is_file():
            (folder / "published").mkdir()
            publishable_checkpoint(trained, folder / "published" / "model.ckpt")
        files, derived = scan_files(folder, ("data/", "teacher.yaml", "student.yaml", "teachers/"), roots)
        for key, value in files.items():
            if key.split(":")[0] == "runs/pate_release.pt":
                continue  # read above: its ledger, settings and reports compared, its labels the release
            if key.startswith("runs/student/checkpoints/"):
                obs.holder[f"file {key}"] = value
            elif "tfevents" in key and ":train/" in key:
                # the student's training metrics: on public images and the released labels (post-processing)
                obs.derived[key] = value
            else:
                obs.channels[f"file {key}"] = value
        obs.derived.update(derived)
        return obs


#: The built-in pipelines at small size (`lightning-dp audit --observer`, the tests, examples/observer_audit.py).
BUILTIN = (
    "fit-p3sgd",
    "fit-dpsgd",
    "fit-p3sgd-split",
    "tune",
    "federated",
    "federated-sites",
    "federated-secagg",
    "pate",
    "federated-deadline",
)


def builtin_pipeline(name: str) -> tuple[Any, list[str]]:
    """The built-in pipeline ``name`` (one of `BUILTIN`) and the adversarial units it can hold.

    ``fit-p3sgd-split`` is ``fit-p3sgd`` on a manifest without a ``split`` column, split by the config's fractions
    (the default per-patient split). ``federated-deadline`` is the federated one with a 0.5 s deadline and a whale of
    40,000 images: an uncapped whale's round takes seconds there, a capped round milliseconds.
    """
    from lightning_dp.audit.observer.units import FILE_UNITS, MEMORY_UNITS

    if name == "fit-p3sgd":
        return FitPipeline("p3sgd", patients=6, steps=2), list(FILE_UNITS)
    if name == "fit-dpsgd":
        return FitPipeline("dpsgd", patients=6, steps=2), ["huge", "one_image"]
    if name == "fit-p3sgd-split":
        return FitPipeline("p3sgd", patients=6, steps=2, split="per_patient"), list(FILE_UNITS)
    if name == "tune":
        return TunePipeline(), ["huge"]
    if name == "federated":
        return FederatedPipeline(), list(MEMORY_UNITS)
    if name == "federated-sites":
        return FederatedPipeline(noise_at="sites"), list(MEMORY_UNITS)
    if name == "federated-secagg":
        return FederatedPipeline(noise_at="sites", secure=True), list(MEMORY_UNITS)
    if name == "pate":
        return PatePipeline(), [
            "huge",
            "whale",
            "one_image",
            "colliding",
            "nonfinite",
            "unreadable",
            "empty",
            "raising",
        ]
    if name == "federated-deadline":
        return FederatedPipeline(rounds=1, deadline=0.5, whale_images=40_000), ["whale"]
    raise ValueError(f"no built-in pipeline {name!r}; the pipelines are {', '.join(BUILTIN)}.")
