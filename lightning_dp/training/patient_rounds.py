"""The patient round: Σ_i clip_{C_u}(Δ_i) over a round's sampled patients, runnable without a Trainer.

P3SGD's round trains each sampled patient's copy of the model from θ_t on that patient's images alone (local SGD),
clips each change Δ_i to C_u, and sums the clipped changes; the callback then adds the noise, charges the ledger and
applies the update. This module is the part before the noise, as objects a caller holds:

* `PatientData`: the training images grouped by patient (the k-th patient's images and its id, which keys its own
  random streams), and how a list of images becomes a batch on the model's device.
* `LocalSGD`: one patient's local training (rate, batch size, epochs, momentum, weight decay), validated on creation.
* `RoundParts`: what every round implementation works on: the model's `ModelState`, its ``training_step``, the
  data, the local SGD and C_u.
* `PatientRound` and its three implementations, which agree up to float round-off (the contract test in
  ``tests/unit/training/test_patient_rounds.py`` runs each against the loop):

  - `LoopRound`: patient by patient; runs any model.
  - `BatchedRound`: one plain local step per patient (Δ_i = −γ·g_i), every g_i from one batched pass of the
    per-sample engine, a patient being a group of its images.
  - `StackedRound`: several local steps, chunks of equal-sized patients trained at once with ``torch.func``
    (`StackedLocalSGD`).

  Each ``build`` returns the round, or the reason it cannot run (a fixed text: it never quotes private values);
  `choose_round` picks the fastest that applies. The clip is applied at one site, `clip_changes`.

The callers: `lightning_dp.callbacks.P3SGD` (one round per optimizer step) and anyone who runs a round on patients
they hold (a hospital's site in training across hospitals). A round never adds noise and never charges anything:
its output is un-sanitized and must go to a release (`lightning_dp.training.PrivateStep`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import default_collate

from lightning_dp.errors import UnsupportedModelError, check_count, check_finite_positive, check_in_interval
from lightning_dp.sampling.randomness import UnitStreams, draws_random_numbers, training_dropout
from lightning_dp.sanitization import ModelState, updates
from lightning_dp.sanitization.buffers import BufferSnapshot
from lightning_dp.sanitization.per_sample import ClipStats, PerSampleClipper
from lightning_dp.training.batches import loss_of
from lightning_dp.training.checks import Failure, diverse_indices, eval_mode, independence
from lightning_dp.training.stacked import StackedLocalSGD, free_memory_bytes

__all__ = [
    "BatchedRound",
    "LocalSGD",
    "LoopRound",
    "PatientData",
    "PatientRound",
    "RoundParts",
    "StackedRound",
    "choose_round",
    "clip_changes",
    "images_loss",
    "model_reason",
    "patient_groups",
]

#: Why the start-up check refused the batched pass (`checks.independence`'s failures).
_REASONS: dict[Failure, str] = {
    "collate": "the training collate_fn mixes the images of a batch",
    "reduction": "training_step's loss is not the mean of the images' losses",
    "coupled": "the loss or a layer couples the images of a batch (a class-weighted mean, batch statistics)",
    "not_per_sample": "part of the gradient is not computed per image (a parameter used outside its own layer)",
    "buffers": "training_step changes buffers or frozen parameters of the model",
    "unchecked": "the start-up check could not read two training images with finite losses",
}
#: Why the other start-up checks keep the loop when they cannot read the images they need (a fixed text: the read's
#: error is never shown).
_UNREADABLE = "the start-up check could not read the training images it needs"

#: θ_t and the other buffers a round starts every patient from (``state.vector()``, ``state.snapshot_other_buffers()``).
Start = tuple[Tensor, list[Tensor]]


#: Nothing seen yet (ClipStats is immutable: one instance serves as every default).
NO_STATS = ClipStats()


# ---------------------------------------------------------------------- what a round works on
@dataclass
class PatientData:
    """The training images grouped by patient.

    Attributes:
        dataset: the images (``dataset[i]`` is image i).
        groups: ``groups[k]``: the dataset indices of the k-th patient's images (a sampler draws positions k).
        keys: ``keys[k]``: the k-th patient's id; it keys the patient's own random streams.
        collate: makes a batch of a list of images.
        to_device: moves a collated batch to the model's device (Lightning's ``transfer_batch_to_device``).
    """

    dataset: Any
    groups: list[list[int]]
    keys: list[Any]
    collate: Callable[[list[Any]], Any] = default_collate
    to_device: Callable[[Any], Any] = lambda batch: batch  # noqa: E731 - a default that keeps the batch as it is

    def __post_init__(self) -> None:
        if len(self.groups) != len(self.keys):
            raise ValueError(f"PatientData: {len(self.groups)} groups of images for {len(self.keys)} patient ids")

    def size(self, patient: int) -> int:
        """How many images the k-th patient has."""
        return len(self.groups[patient])

    def collated(self, items: list[Any]) -> Any:
        return self.to_device(self.collate(items))

    def batch(self, indices: Sequence[int] | Tensor) -> Any:
        """The images ``indices``, fetched from the global generators (or a unit's stream, inside ``streams.unit``)."""
        return self.collated([self.dataset[int(i)] for i in indices])

    def fetch(self, streams: UnitStreams, patient: int) -> list[Any]:
        """The k-th patient's images, each drawing its randomness (augmentation) from the patient's own stream."""
        return streams.fetch(self.dataset, self.groups[patient], self.keys[patient])


def patient_groups(dataset: Any) -> tuple[list[list[int]], list[Any]]:
    """The images of the k-th patient of ``dataset.patient_to_indices`` and its id, for k = 0..N-1.

    Patients may be keyed by any hashable id (a hospital's "MRN-0042" as well as 0..N-1): position k is the k-th id
    in sorted order (insertion order when the ids do not sort, e.g. a mix of types). Sorted order makes the
    positions independent of how the dict was built; for the ids 0..N-1 position k is patient k, and its id is
    ``dataset.patient_ids[k]`` when the dataset names its patients (the library's patient datasets do).

    Example:
        >>> patient_groups(type("D", (), {"patient_to_indices": {"b": [2], "a": [0, 1]}})())
        ([[0, 1], [2]], ['a', 'b'])
    """
    groups = dataset.patient_to_indices
    try:
        keys = sorted(groups)
    except TypeError:
        keys = list(groups)
    indices = [[int(i) for i in groups[key]] for key in keys]
    ids = getattr(dataset, "patient_ids", None)
    if ids is not None and keys == list(range(len(ids))):
        # The library's datasets number their patients 0…N−1 and name them in ``patient_ids``: a patient's key (its
        # random streams, a site's id digests) is its name, so adding a patient whose name sorts first does not move
        # every other patient's randomness (a fixed-seed neighbouring test would see them all shift).
        keys = [str(pid) for pid in ids]
    return indices, keys


@dataclass(frozen=True)
class LocalSGD:
    """One patient's local training: SGD over its images from θ_t, ``epochs`` passes of ``batch_size`` images.

    ``max_images`` bounds one patient's work in a round, a public setting fixed before the data are seen: a patient
    with more images trains on ``max_images`` of them, drawn afresh each round from the patient's own secret stream
    (so a round's work is at most ``max_steps`` local steps per patient, whatever a patient holds). Its change is
    clipped to C as any other's: the cap changes what one patient's update is made of, never its sensitivity. Across
    hospitals it is what lets a deadline be set from public numbers (docs/federated.md, "Deadlines"); None (default):
    every image, every round.

    Validated on creation (the errors name the argument as P3SGD spells it).
    """

    lr: float = 0.05
    batch_size: int = 16
    epochs: int = 1
    momentum: float = 0.0
    weight_decay: float = 0.0
    max_images: int | None = None

    def __post_init__(self) -> None:
        owner = "P3SGD"
        check_finite_positive(owner, "local_lr", self.lr, "e.g. 0.05.")
        check_count(owner, "local_batch_size", self.batch_size, "e.g. 16.", minimum=1)
        check_count(owner, "local_epochs", self.epochs, "e.g. 1.", minimum=1)
        check_in_interval(
            owner, "local_momentum", self.momentum, 0.0, 1.0, low_closed=True, high_closed=False, hint="e.g. 0.0."
        )
        check_in_interval(
            owner, "local_weight_decay", self.weight_decay, 0.0, 1.0, low_closed=True, high_closed=False, hint="1e-4."
        )
        if self.max_images is not None:
            check_count(owner, "local_max_images", self.max_images, "e.g. 64 images per patient per round.", minimum=1)

    @property
    def max_steps(self) -> int | None:
        """The most local steps one patient takes in a round (public: from the settings alone); None if unbounded."""
        if self.max_images is None:
            return None
        return self.epochs * -(-self.max_images // self.batch_size)

    def size(self, images: int) -> int:
        """How many of a patient's ``images`` it trains on in a round (``max_images`` at most)."""
        return images if self.max_images is None else min(images, self.max_images)

    def images(self, indices: Sequence[int], generator: torch.Generator) -> Tensor:
        """The patient's images of this round: all of them, or ``max_images`` drawn from the patient's generator.

        Nothing is drawn when the patient has at most ``max_images`` (the image orders then are the uncapped ones).
        """
        if self.max_images is not None and len(indices) > self.max_images:
            picked = torch.randperm(len(indices), generator=generator)[: self.max_images].tolist()
            return torch.as_tensor([indices[i] for i in picked])  # never the whole list: the work stays bounded
        return torch.as_tensor(list(indices))

    def one_step_reason(self) -> str | None:
        """Why a patient's update is more than one plain SGD step (None if it is not, for a patient that fits a batch).

        A patient with more images than ``batch_size`` takes several local steps: the batched round trains it by the
        loop. Deciding the path from the largest patient would make it (and a message) depend on the data.
        """
        if self.epochs != 1:
            return f"local_epochs={self.epochs} makes several local steps per patient"
        if self.momentum != 0:
            return f"local_momentum={self.momentum} (only plain SGD is one gradient)"
        if self.weight_decay != 0:
            return f"local_weight_decay={self.weight_decay} (the clip of Δ_i = −γ(g_i + wd·θ) is not vectorized)"
        return None

    def orders(self, units: Sequence[Sequence[int]], generators: Sequence[torch.Generator]) -> list[list[Tensor]]:
        """Each unit's image order of each epoch, drawn from its own generator exactly as `train` draws them."""
        orders = []
        for indices, generator in zip(units, generators):
            ix = self.images(indices, generator)
            orders.append([ix[torch.randperm(len(ix), generator=generator)] for _ in range(self.epochs)])
        return orders

    def train(
        self,
        params: Sequence[Tensor],
        step: Callable[[Any, int], Any],
        batch: Callable[[Tensor], Any],
        images: Sequence[int],
        generator: torch.Generator,
    ) -> None:
        """Local SGD over ``images`` (dataset indices) in ``params`` themselves; ``batch`` makes a batch of indices."""
        optimizer = torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        indices = self.images(images, generator)
        number = 0
        for _ in range(self.epochs):
            order = indices[torch.randperm(len(indices), generator=generator)]
            for start in range(0, len(order), self.batch_size):
                optimizer.zero_grad(set_to_none=True)
                loss_of(step(batch(order[start : start + self.batch_size]), number)).backward()
                optimizer.step()
                number += 1
        optimizer.zero_grad(set_to_none=True)


@dataclass
class RoundParts:
    """What every round implementation works on.

    Attributes:
        module: the model (a LightningModule, or any module ``training_step`` belongs to).
        state: the model's trainable parameters and released buffers (`ModelState`): θ_t is loaded into it.
        step: the module's own ``training_step(batch, batch_idx)``, returning a loss (or ``{"loss": ...}``).
        data: the patients' images.
        local: the local SGD.
        clip_norm: C_u, the bound on one patient's change (parameters and released buffers together).
    """

    module: nn.Module
    state: ModelState
    step: Callable[[Any, int], Any]
    data: PatientData
    local: LocalSGD
    clip_norm: float

    @property
    def device(self) -> torch.device:
        device = getattr(self.module, "device", None)
        if isinstance(device, torch.device):
            return device
        first = next(self.module.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    def streams(self, secret: int, purpose: str = "patient") -> UnitStreams:
        """Fresh streams of the round's patients, seeded from the round's secret."""
        return UnitStreams(secret, purpose, self.device)

    def train_patient(self, patient: int, streams: UnitStreams) -> None:
        """Local SGD of the k-th patient in the model's parameters, drawing from the patient's own stream."""
        key = self.data.keys[patient]
        with streams.unit(key):  # the patient's augmentation and dropout: its own stream
            self.local.train(
                self.state.params, self.step, self.data.batch, self.data.groups[patient], streams.generator(key)
            )


def clip_changes(
    changes: list[Tensor | None], clip_norm: float, stats: ClipStats = NO_STATS
) -> tuple[Tensor, ClipStats]:
    """Clip factors of a chunk's changes (``changes[j]``: one parameter's change for every unit, or None: no change).

    The norm of unit k is over all its parameters' changes; factor min(1, C/‖Δ_k‖), 0 for a non-finite change, as
    `ModelState.add_clipped_change` clips the loop's. Returns the factors and ``stats`` plus what clipping saw.
    """
    units = next(c.shape[0] for c in changes if c is not None)
    squares = torch.zeros(units, dtype=torch.float64, device=next(c for c in changes if c is not None).device)
    for c in changes:
        if c is not None:
            squares += c.double().pow(2).flatten(1).sum(1)
    factors = torch.zeros(units, dtype=torch.float32, device=squares.device)
    for k, norm in enumerate(squares.sqrt().tolist()):
        # Through the module, as ModelState does: the audit's mutants patch updates.clip_factor.
        factor, clipped, finite = updates.clip_factor(norm, clip_norm)
        factors[k] = factor
        stats += ClipStats.of_unit(norm, clipped, finite)
    return factors, stats


# ---------------------------------------------------------------------- the round implementations
class PatientRound(abc.ABC):
    """Adds Σ_i clip_{C_u}(Δ_i) over a round's patients to a sum; every implementation gives the loop's up to round-off.

    Δ_i is the change of the parameters (and released buffers) that patient i's local training makes from θ_t. The
    round's randomness (image orders, augmentation, dropout) comes from streams seeded by the round's ``secret`` and
    each patient's id: a patient draws the same numbers whichever other patients are sampled.
    """

    #: "loop", "batched" or "stacked": the name ``P3SGD.round_path`` reports.
    path: ClassVar[Literal["loop", "batched", "stacked"]]

    def __init__(self, parts: RoundParts) -> None:
        self.parts = parts

    @abc.abstractmethod
    def add_clipped(self, patients: Sequence[int], clipped_sum: Tensor, secret: int, start: Start) -> ClipStats | None:
        """Adds the clipped changes of ``patients`` (positions k) to ``clipped_sum``.

        Args:
            patients: the positions of this round's patients in ``parts.data``.
            clipped_sum: a flat vector the size of ``parts.state.vector()``.
            secret: the round's secret seed (never derived from data).
            start: θ_t and the other buffers (``state.vector()``, ``state.snapshot_other_buffers()``).

        Returns:
            What clipping saw (private: not for logging by default); None if the round could not be computed this way
            (nothing added): the loop must run it. Whether that happens can depend on the patients sampled: a caller
            says nothing about it. Either way the model is back at ``start``.
        """

    def close(self) -> None:  # noqa: B027 - most rounds hold nothing to free
        """Frees what the round holds (hooks, engines)."""


class LoopRound(PatientRound):
    """Patient by patient: each trained from ``start``, clipped by `ModelState.add_clipped_change`. Runs any model."""

    path = "loop"

    def add_clipped(
        self, patients: Sequence[int], clipped_sum: Tensor, secret: int, start: Start, stats: ClipStats = NO_STATS
    ) -> ClipStats:
        """As `PatientRound.add_clipped`; ``stats``: what the round saw before these patients (added to)."""
        parts = self.parts
        state, streams = parts.state, parts.streams(secret)
        for patient in patients:
            state.load(*start)
            parts.train_patient(patient, streams)
            norm, clipped, finite = state.add_clipped_change(start[0], clipped_sum, parts.clip_norm)
            stats += ClipStats.of_unit(norm, clipped, finite)
        if patients:
            state.load(*start)  # no patient's local model stays in the module
        return stats


class _VectorizedRound(PatientRound):
    """A round that trains many patients at once: ``params`` are the ids of the parameters it trains."""

    def __init__(self, parts: RoundParts) -> None:
        super().__init__(parts)
        self.params = frozenset(id(p) for p in parts.state.params)


class _DrewRandomNumbers(Exception):
    """The batched pass's training_step drew random numbers: the loop re-does the round (nothing is said)."""


class BatchedRound(_VectorizedRound):
    """One plain local step per patient: Δ_i = −γ·g_i, every g_i from batched passes of the per-sample engine.

    clip_{C_u}(Δ_i) = −γ·clip_{C_u/γ}(g_i), g_i the gradient of the mean loss over patient i's images; the engine takes
    a patient's images as one group of rows. Patients with more images than the local batch take several local steps:
    the loop trains them within the round. Nothing is written to the model (the engine detaches the parameters).
    """

    path = "batched"

    def __init__(self, parts: RoundParts, clipper: PerSampleClipper, images_per_pass: int) -> None:
        super().__init__(parts)
        self.clipper = clipper
        self.images_per_pass = images_per_pass

    @classmethod
    def build(cls, parts: RoundParts, images_per_pass: int, share: Sequence[Any] = ()) -> BatchedRound | str:
        """The batched round if one batched pass is exactly the loop for this model; else why not.

        Args:
            parts: the round's parts.
            images_per_pass: the most images in one batched pass (whole patients).
            share: objects the start-up check's float64 copy of the model shares rather than copies (the Trainer).
        """
        reason = parts.local.one_step_reason()
        if reason is not None:
            return reason
        try:
            clipper = PerSampleClipper(parts.module, parts.clip_norm / parts.local.lr, "mean")
        except UnsupportedModelError as err:
            return f"no per-sample gradient rule: {str(err).split('. HINT')[0]}"
        trained = frozenset(id(p) for p in parts.state.params)
        if frozenset(id(p) for p in clipper.params) != trained:
            reason = "some trainable parameters are outside the layers the per-sample engine covers"
        else:
            reason = independence_reason(parts, share)
        if reason is not None:
            clipper.remove()
            return reason
        return cls(parts, clipper, images_per_pass)

    def close(self) -> None:
        self.clipper.remove()

    def reset(self) -> None:
        """Wipes the engine's un-noised sum (after every round)."""
        self.clipper.reset()

    def add_clipped(self, patients: Sequence[int], clipped_sum: Tensor, secret: int, start: Start) -> ClipStats | None:
        parts = self.parts
        # A patient above max_images trains on a subset drawn from its generator: the loop draws it.
        one_step_size = parts.local.size(parts.local.batch_size)  # min(batch_size, max_images)
        one_step = [p for p in patients if parts.data.size(p) <= one_step_size]
        try:
            stats = self.add_one_step(one_step, clipped_sum, parts.streams(secret))
        except _DrewRandomNumbers:
            self.clipper.reset()
            parts.state.load(*start)
            clipped_sum.zero_()
            return None
        several = [p for p in patients if parts.data.size(p) > one_step_size]
        return LoopRound(parts).add_clipped(several, clipped_sum, secret, start, stats)

    def add_one_step(self, patients: Sequence[int], clipped_sum: Tensor, streams: UnitStreams) -> ClipStats:
        """Adds Σ_i clip_{C_u}(Δ_i) of ``patients`` (each one local step) to ``clipped_sum``, in batched passes."""
        parts, clipper = self.parts, self.clipper
        stats = ClipStats()
        data, step = parts.data, parts.step
        chunks: list[list[int]] = []
        rows = 0
        for patient in patients:
            count = data.size(patient)
            if not chunks or rows + count > self.images_per_pass:
                chunks.append([])
                rows = 0
            chunks[-1].append(patient)
            rows += count
        clipper.reset()
        for chunk in chunks:
            if not chunk:
                continue
            batch = data.collated([item for p in chunk for item in data.fetch(streams, p)])
            sizes = [data.size(p) for p in chunk]

            def loss(batch: Any = batch) -> Tensor:
                return loss_of(step(batch, 0))

            results: list[Any] = []

            def run(
                loss: Any = loss, chunk: list[int] = chunk, sizes: list[int] = sizes, results: list[Any] = results
            ) -> None:
                results.append(clipper.accumulate(loss, len(chunk), group_size=sizes))

            # The pass's own randomness would be drawn per position in the batch, not per patient: a training_step
            # that draws any (the start-up check saw none, but a schedule can switch it on) sends the round to the
            # loop, and the secret stream it drew from is thrown away.
            with streams.unit("batched pass"):
                if draws_random_numbers(run, parts.device):
                    raise _DrewRandomNumbers
            found = results[0]
            stats += ClipStats(len(chunk), found.clipped, found.norm_sum * parts.local.lr, found.nonfinite)
        by_param = {id(p): view for p, view in clipper.views(clipper.flat_sum)}
        offset = 0
        with torch.no_grad():
            for p in parts.state.params:
                n = p.numel()
                clipped_sum[offset : offset + n].add_(by_param[id(p)].reshape(-1), alpha=-parts.local.lr)
                offset += n
        return stats


class StackedRound(_VectorizedRound):
    """Several local steps: the copies of a chunk of equal-sized patients trained at once (`StackedLocalSGD`).

    Each patient's image orders come from its own generator and its images from its own stream, as in the loop, so each
    patient sees the loop's mini-batches; its change is clipped by `clip_changes`, the loop's clip. The model goes back
    to ``start`` before every chunk, as it does before every patient in the loop.
    """

    path = "stacked"

    def __init__(self, parts: RoundParts, stacked: StackedLocalSGD, images_per_step: int) -> None:
        super().__init__(parts)
        self.stacked = stacked
        self.images_per_step = images_per_step

    @classmethod
    def build(cls, parts: RoundParts, images_per_step: int) -> StackedRound | str:
        """Stacked local SGD if the model runs under torch.func and matches the loop; else why not.

        The start-up check trains two pseudo-patients (images picked in a public order, `diverse_indices`) both ways
        from the current weights and compares their updates, and requires the stacked run to leave every buffer as it
        was (a ``training_step`` that re-assigns a buffer would carry one chunk's data into the next). Only pass or
        fail comes out of it (the reasons are fixed texts), and the model is restored afterwards.
        """
        reason = dropout_reason(parts.module)
        if reason is not None:
            return reason
        state, data = parts.state, parts.data
        picked = diverse_indices(data.dataset)  # readable images only
        if len(picked) < min(2, len(data.dataset)):  # one image would make two identical pseudo-patients
            return _UNREADABLE
        half = max(1, len(picked) // 2)
        pseudo = [picked[:half], picked[half : 2 * half]] if len(picked) >= 2 else [picked, picked]
        theta, other = state.vector(), state.snapshot_other_buffers()
        try:
            with torch.enable_grad():
                used = used_parameters(parts, pseudo[0])
                looped = []
                check = UnitStreams(0, "patient", parts.device)  # public streams: the check's pseudo-patients
                for k, indices in enumerate(pseudo):
                    state.load(theta, other)
                    with check.unit(k):
                        parts.local.train(state.params, parts.step, data.batch, indices, check.generator(k))
                    looped.append(state.vector() - theta)
                state.load(theta, other)
                local = parts.local
                stacked = StackedLocalSGD(
                    parts.module, parts.step, loss_of, used, local.lr, local.momentum, local.weight_decay
                )
                before = BufferSnapshot(parts.module, parameters=True)  # buffers and frozen parameters, by value
                check = UnitStreams(0, "patient", parts.device)
                orders = local.orders(pseudo, [check.generator(k) for k in range(len(pseudo))])
                built = cls(parts, stacked, images_per_step)
                final = stacked.run(built.steps(orders, check, list(range(len(pseudo)))))
                changed = before.changed()
        except Exception as err:  # noqa: BLE001 - whatever torch.func refuses, the loop still runs the model
            # The exception's type only: its message could quote values computed from the training images.
            return f"torch.func cannot run training_step on stacked batches ({type(err).__name__})"
        finally:
            state.load(theta, other)
        if changed:
            listed = f"{', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}"
            return f"training_step changes buffers or frozen parameters ({listed})"
        by_id = {id(p): s for p, s in zip(used, final)}
        with torch.no_grad():
            for k, change in enumerate(looped):
                pieces = [
                    (by_id[id(p)][k].float() - p.detach().float()).reshape(-1)
                    if id(p) in by_id
                    else torch.zeros(p.numel(), device=change.device)
                    for p in state.params
                ]
                gap = float((torch.cat(pieces) - change).norm())
                if not gap <= 1e-3 * float(change.norm()) + 1e-6:
                    return (
                        "stacked local SGD differs from the loop on start-up (by more than 1e-3 of the update's norm)"
                    )
        return built

    def steps(self, orders: list[list[Tensor]], streams: UnitStreams, keys: Sequence[object]) -> Iterator[list[Any]]:
        """The local mini-batches of equal-sized units, step by step.

        Each unit's are fetched from its own stream and collated on their own: a unit draws what it draws in the loop.
        """
        data, local = self.parts.data, self.parts.local
        size = len(orders[0][0])
        for epoch in range(local.epochs):
            for start in range(0, size, local.batch_size):
                yield [
                    data.collated(
                        streams.fetch(data.dataset, order[epoch][start : start + local.batch_size].tolist(), key)
                    )
                    for order, key in zip(orders, keys)
                ]

    def chunk_size(self, images_per_step: int) -> int:
        """Patients per stacked chunk.

        At most ``images_per_step`` (the round's bound) images per local step, and a quarter of the free memory for ~6
        copies of the trainable parameters per patient (its copy, gradient, momentum and temporaries).
        """
        param_bytes = sum(p.numel() * p.element_size() for p in self.parts.state.params)
        by_memory = free_memory_bytes(self.parts.device) // 4 // max(1, 6 * param_bytes)
        return max(1, min(by_memory, self.images_per_step // max(1, images_per_step)))

    def add_clipped(self, patients: Sequence[int], clipped_sum: Tensor, secret: int, start: Start) -> ClipStats | None:
        """Stacked local SGD of ``patients``; None (and nothing added) if it failed and the loop must run.

        A batch that cannot be stacked (images of different sizes in one chunk, a field that is not a tensor) shows
        only in a round, and only for some samples of patients: the caller re-does the round by the loop from fresh
        streams, so it trains exactly what the loop would have, and says nothing.
        """
        try:
            return self.add_stacked(patients, clipped_sum, self.parts.streams(secret), start)
        except Exception:  # noqa: BLE001 - the loop runs any model; KeyboardInterrupt and the like propagate
            self.parts.state.load(*start)
            clipped_sum.zero_()
            return None

    def add_stacked(
        self, patients: Sequence[int], clipped_sum: Tensor, streams: UnitStreams, start: Start
    ) -> ClipStats:
        """Adds Σ_i clip_{C_u}(Δ_i) of ``patients`` to ``clipped_sum``, chunks of equal-sized patients at once."""
        parts = self.parts
        stats = ClipStats()
        data, local, state = parts.data, parts.local, parts.state
        generators = [streams.generator(data.keys[p]) for p in patients]
        orders = dict(zip(patients, local.orders([data.groups[p] for p in patients], generators)))
        by_size: dict[int, list[int]] = {}
        for patient in patients:  # the images each trains on this round (max_images at most)
            by_size.setdefault(len(orders[patient][0]), []).append(patient)
        params = state.params
        for size, members in by_size.items():
            per_chunk = self.chunk_size(min(size, local.batch_size))
            for first in range(0, len(members), per_chunk):
                chunk = members[first : first + per_chunk]
                state.load(*start)
                steps = self.steps([orders[p] for p in chunk], streams, [data.keys[p] for p in chunk])
                final = dict(zip(map(id, self.stacked.params), self.stacked.run(steps)))
                with torch.no_grad():
                    # A parameter no gradient reaches does not move (torch.optim.SGD skips it): its change is zero.
                    changes = [
                        final[id(p)].float() - p.detach().float().unsqueeze(0) if id(p) in final else None
                        for p in params
                    ]
                    del final
                    factors, stats = clip_changes(changes, parts.clip_norm, stats)
                    kept = factors > 0
                    offset = 0
                    for p, change in zip(params, changes):
                        n = p.numel()
                        if change is not None and bool(kept.any()):
                            scaled = change[kept].reshape(int(kept.sum()), -1) * factors[kept].unsqueeze(1)
                            clipped_sum[offset : offset + n].add_(scaled.sum(0))
                        offset += n
        state.load(*start)
        return stats


# ---------------------------------------------------------------------- which round runs
def dropout_reason(module: nn.Module) -> str | None:
    """Why the model's Dropout keeps the loop: its masks are drawn per patient only one by one (None: no Dropout)."""
    names = [name for name, _ in training_dropout(module)]
    if not names:
        return None
    return (
        f"Dropout layers in training mode ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) draw each "
        "patient's masks from that patient's own random stream only when patients are trained one by one"
    )


def model_reason(parts: RoundParts, current: PatientRound | None = None) -> str | None:
    """Why the model's update is not its parameters' gradient steps alone (None if it is); cheap, every round.

    ``current``: the vectorized round in use, if any (Dropout and changed trainable parameters end it).
    """
    module, state = parts.module, parts.state
    norms = [n for n, m in module.named_modules() if isinstance(m, _BatchNorm) and m.training]
    if norms:
        return (
            f"BatchNorm layers in training mode ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}) "
            "normalize with each patient's batch statistics and release running statistics"
        )
    vectorized = isinstance(current, (BatchedRound, StackedRound))
    if vectorized:
        dropout = dropout_reason(module)
        if dropout is not None:
            return dropout
    released = state.float_buffer_names
    if released:
        return f"buffers released with the update ({', '.join(released[:3])})"
    if vectorized and frozenset(id(p) for p in state.params) != current.params:  # type: ignore[union-attr]
        return "the trainable parameters changed since training started"
    return None


def random_step_reason(parts: RoundParts) -> str | None:
    """Why training_step cannot run on several patients' images at once: it draws random numbers (None if not).

    Checked on two images picked in a public order: a step that draws from torch's, NumPy's or Python's global
    generators (a random augmentation inside training_step) would draw one patient's numbers at a position that
    depends on the other patients of its batch; one by one, each patient draws from its own stream. An image that
    cannot be read is skipped; with none readable, the loop runs.
    """
    state, step = parts.state, parts.step
    picked = diverse_indices(parts.data.dataset)[:2]  # readable images only
    try:
        batch = parts.data.batch(picked) if picked else None
    except Exception:  # noqa: BLE001 - a read that failed this time: the loop, and the error is not shown
        batch = None
    if batch is None:
        return _UNREADABLE
    theta, other = state.vector(), state.snapshot_other_buffers()
    try:
        with torch.no_grad():
            drew = draws_random_numbers(lambda: step(batch, 0), parts.device)
    finally:
        state.load(theta, other)
    if drew:
        return "training_step draws random numbers, which each patient draws from its own stream only one by one"
    return None


def used_parameters(parts: RoundParts, images: Sequence[int]) -> list[Tensor]:
    """The trainable parameters a backward pass of ``training_step`` reaches (torch.optim.SGD skips the others).

    torch.func's gradient of an unused parameter is zero, not None: weight decay and momentum would move it where the
    loop leaves it.
    """
    params = parts.state.params
    for p in params:
        p.grad = None
    batch = parts.data.batch(list(images)[: parts.local.batch_size])
    loss_of(parts.step(batch, 0)).backward()
    used: list[Tensor] = [p for p in params if p.grad is not None]
    for p in params:
        p.grad = None
    return used


def independence_reason(parts: RoundParts, share: Sequence[Any] = ()) -> str | None:
    """Whether one batch's loss is the mean of its images' own losses (`checks.independence`, DPSGD's start-up check).

    In the batched pass a patient's gradient is read from a batch that holds other patients' images: a loss or layer
    coupling the images of a batch (a class-weighted mean, a batch Dice, batch statistics) or a collate_fn that mixes
    them would leak one patient into another's clipped update. The check runs on a float64 copy, on batches chosen
    without looking at private values; only pass or fail comes out of it. Unlike DPSGD's, the loss must show that it
    is the mean (the batched pass is an optimization the loop can always replace).
    """
    data = parts.data
    try:
        found = independence(
            parts.module,
            list(share),
            parts.step,
            loss_of,
            "mean",
            data.dataset,
            data.collate,
            data.to_device,
            rolled_targets=False,
            trust_declared=False,
        )
    except UnsupportedModelError as err:
        return f"no per-sample gradient rule: {str(err).split('. HINT')[0]}"
    if found.check is not None:
        found.check.close()
    return None if found.failure is None else _REASONS[found.failure]


@dataclass
class Choice:
    """What `choose_round` chose: the round, why the batched round does not run (None if it does), a note for users."""

    round: PatientRound
    reason: str | None
    note: str | None = None

    @property
    def path(self) -> Literal["loop", "batched", "stacked"]:
        return self.round.path


def choose_round(
    parts: RoundParts, vectorize: Literal["auto", False], images_per_pass: int, share: Sequence[Any] = ()
) -> Choice:
    """The fastest round that is exactly the loop for this model and these settings.

    One plain local step and a model the per-sample engine covers: `BatchedRound`. Otherwise (several local steps, or
    a model the engine does not cover): `StackedRound`, if the model runs under ``torch.func`` and matches the loop on
    start-up. Else `LoopRound`. ``vectorize=False`` always gives the loop.
    """
    parts.state.refresh()
    if vectorize is False:
        return Choice(LoopRound(parts), "vectorize=False")
    reason = model_reason(parts) or dropout_reason(parts.module) or random_step_reason(parts)
    if reason is not None:
        return Choice(LoopRound(parts), reason)
    batched = BatchedRound.build(parts, images_per_pass, share)
    if isinstance(batched, BatchedRound):
        return Choice(batched, None)
    reason = batched
    stacked = StackedRound.build(parts, images_per_pass)
    if isinstance(stacked, str):
        return Choice(LoopRound(parts), f"{reason}; and stacked local SGD: {stacked}")
    note = f"{reason}: each local step is one torch.func pass over stacked copies"
    convolutions = [
        n
        for n, m in parts.module.named_modules()
        if isinstance(m, nn.modules.conv._ConvNd) and any(p.requires_grad for p in m.parameters())
    ]
    if convolutions and parts.device.type == "cpu":
        note += (
            f" (on CPU, trained convolutions such as {convolutions[0]} run as grouped convolutions: "
            "measured 0.4-1.0x the loop's speed, docs/results/speed.md; vectorize=False may be faster)"
        )
    return Choice(stacked, reason, note)


# ---------------------------------------------------------------------- losses over patients' images
@torch.no_grad()
def images_loss(parts: RoundParts, patients: Sequence[int], chunk_size: int, streams: UnitStreams) -> float:
    """Σ of the per-image losses of ``patients``' images at the current weights (eval mode), ``chunk_size`` a pass.

    Each patient's images are fetched drawing from its own stream; the forward passes draw from a stream of the round's
    own (eval mode rarely draws any).
    """
    data, step = parts.data, parts.step
    total = 0.0
    pending: list[Any] = []

    def evaluate(items: list[Any]) -> float:
        with streams.unit("forward"):
            out = step(data.collated(items), 0)
        return float(loss_of(out)) * len(items)

    with eval_mode(parts.module):  # each module's own mode comes back (a frozen backbone stays in eval mode)
        for patient in patients:
            pending += data.fetch(streams, patient)
            while len(pending) >= chunk_size:
                total += evaluate(pending[:chunk_size])
                pending = pending[chunk_size:]
        if pending:
            total += evaluate(pending)
    return total
