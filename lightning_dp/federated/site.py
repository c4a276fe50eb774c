"""A hospital's side of a federated P3SGD round: its own Poisson coins, its patients' round, the sum it replies."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import math
import secrets
import warnings
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.data import default_collate

from lightning_dp.errors import PrivacyConfigError, check_count, check_sample_rate
from lightning_dp.sampling.patients import PoissonPatientSampler, secure_seed
from lightning_dp.sampling.randomness import unit_seed
from lightning_dp.sanitization import ModelState
from lightning_dp.sanitization.release import standard_normal
from lightning_dp.training.batches import loss_of
from lightning_dp.training.patient_rounds import (
    LocalSGD,
    LoopRound,
    PatientData,
    PatientRound,
    RoundParts,
    choose_round,
    patient_groups,
)

__all__ = ["SITE_MAX_IMAGES", "Site", "SiteStartError"]

_log = logging.getLogger(__name__)

#: The most images one patient trains on in a round at a site whose local SGD sets no ``max_images``: a site's work
#: per round must have a public bound, or one patient with many images could make it miss the server's deadline.
SITE_MAX_IMAGES = 256


class SiteStartError(PrivacyConfigError):
    """A site cannot start; its text is fixed (it is what the server is told), the real error is in the site's log."""


#: What a site whose model fails on the declared input tells the server (a fixed text: the batch is public anyway).
DUMMY_BATCH_FAILED = (
    "its model's training_step failed on a public dummy batch of the declared input format (zeros of the declared "
    "shape; its own log says why)"
)


def _first_tensor(item: Any) -> Tensor | None:
    """The first tensor in a dataset item or a batch (the images, in ``(images, labels, …)``), or None."""
    if isinstance(item, Tensor):
        return item
    if isinstance(item, (tuple, list)) and item:
        return _first_tensor(item[0])
    return None


class Site:
    """One hospital: runs the patient round on its own patients from the server's θ_t and replies with the clipped sum.

    Args:
        name: the site's public name (it names the site in the server's messages).
        parts: the round's parts over this site's patients (`RoundParts`: the model, its `ModelState`, its
            ``training_step``, the site's `PatientData`, the local SGD and C). A local SGD without ``max_images``
            gets `SITE_MAX_IMAGES` (256): a patient's work in a round is always bounded by public numbers, so whether
            the site answers before the server's deadline never depends on how many images one patient has.
        sample_rate: q, the probability that each of the site's patients joins a round (the same at every site).
        seed: the seed of the site's patient sampler and of its patients' random streams; ``None`` (default) draws
            one from the OS CSPRNG. It never leaves the site. A patient's random streams (image order, the images
            drawn under ``max_images``, augmentation) are keyed by the secret and the patient's **id**
            (``parts.data.keys``), not by its position: adding or removing another patient leaves them as they were.
        vectorize: ``"auto"`` runs the round batched or stacked where that is exactly the loop (`choose_round`).
            Its round is re-done patient by patient when a patient's update raises, so a site's worst-case time is
            the vectorized attempt plus the loop: set the deadline for that. ``False`` (default): the loop, one pass,
            each patient's failure isolated.
        images_per_pass: the most images in one batched pass or stacked local step.
        noise_std: with the noise at the sites (`FederatedServer(noise_at="sites")`), the std of this site's share,
            z·C/√m (`lightning_dp.federated.share_std`, from the consortium's public settings, never from the
            server's messages); drawn from the OS CSPRNG afresh for every reply. 0 (default): the server adds the
            noise.
        declared_patients: the number of patients this site declared to the consortium (the consortium's N is the
            sum of such declarations, fixed before the data are counted). Only compared with the site's own count,
            with a warning in the site's log when they differ: the count never leaves the site and no run is refused
            for it. None (default): nothing is compared.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from lightning_dp.sanitization import ModelState
        >>> from lightning_dp.training.patient_rounds import LocalSGD, PatientData, RoundParts
        >>> net = nn.Linear(2, 2)
        >>> net.training_step = lambda batch, i: nn.functional.cross_entropy(net(batch[0]), batch[1])
        >>> data = PatientData([(torch.ones(2), torch.tensor(0))] * 4, [[0, 1], [2, 3]], ["a", "b"])
        >>> site = Site("hospital-a", RoundParts(net, ModelState(net), net.training_step, data, LocalSGD(), 1.0),
        ...             sample_rate=1.0, seed=0)
        >>> reply = site.reply(ModelState(net).vector(), round_number=0)
        >>> reply.shape, bool(reply.norm() <= 2.0 + 1e-6)
        (torch.Size([6]), True)
    """

    def __init__(
        self,
        name: str,
        parts: RoundParts,
        sample_rate: float,
        seed: int | None = None,
        vectorize: Literal["auto", False] = False,
        images_per_pass: int = 256,
        noise_std: float = 0.0,
        declared_patients: int | None = None,
    ) -> None:
        owner = f"Site({name!r})"
        if not parts.data.groups:
            # Run or no run must not depend on one patient: a site whose last patient left still takes part, with
            # zero sums (a refusal here would stop the consortium's start, and tell everyone).
            _log.warning("Site %r has no training patients: it replies zeros (this note is for its operator)", name)
            vectorize = False
        if declared_patients is not None:
            check_count(owner, "declared_patients", declared_patients, "this site's share of N.", minimum=1)
            if declared_patients != len(parts.data.groups):
                # For the hospital's own operator: the count stays here, and the consortium trains as declared.
                _log.warning(
                    "Site %r holds another number of training patients than the %d it declared; the consortium's "
                    "normalizer uses the declared N (this note is for the hospital's operator only)",
                    name,
                    declared_patients,
                )
        self.name = name
        self.declared_patients = declared_patients
        if parts.local.max_images is None:
            parts = dataclasses.replace(parts, local=dataclasses.replace(parts.local, max_images=SITE_MAX_IMAGES))
        self.parts = parts
        self.sample_rate = check_sample_rate(owner, sample_rate)
        self.noise_std = float(noise_std)
        if not (self.noise_std >= 0.0 and math.isfinite(self.noise_std)):
            raise PrivacyConfigError(f"`{owner}`: noise_std must be a finite number >= 0, found {noise_std!r}.")
        self._secret = secure_seed("site") if seed is None else int(seed)
        self._units_seed = unit_seed(self._secret, "site-streams", name)
        choice = choose_round(parts, vectorize, images_per_pass)
        self.round: PatientRound = choice.round

    @classmethod
    def from_lightning(
        cls,
        name: str,
        module: Any,
        datamodule: Any,
        sample_rate: float,
        clip_norm: float,
        local: LocalSGD | None = None,
        seed: int | None = None,
        vectorize: Literal["auto", False] = False,
        noise_std: float = 0.0,
        declared_patients: int | None = None,
    ) -> Site:
        """A site from the user's LightningModule and the hospital's patient DataModule, as `P3SGD` reads them.

        The DataModule's training set must say which images are whose (``patient_to_indices``, as the library's
        patient datasets do); its training loader's ``collate_fn`` makes the batches. The module's own
        ``training_step`` is the local loss.

        Each patient is keyed by its **real id**: with the library's patient datasets (`lightning_dp.data`), whose
        ``patient_to_indices`` numbers the patients 0…N−1, the id is ``dataset.patient_ids[k]`` (the manifest's
        ``patient_id``), never the number k, which every site has. The key is what `id_digests` hashes (so the
        start-up check compares the patients' real ids across sites) and what keys each patient's random streams.
        A training set without ``patient_ids`` keys the patients by ``patient_to_indices``' own keys.

        Example:
            >>> import tempfile
            >>> from lightning_dp.data import SyntheticPathologyDataModule
            >>> from lightning_dp.models import ImageClassifier
            >>> dm = SyntheticPathologyDataModule(root=tempfile.mkdtemp(), num_patients=6, patches_per_patient=3,
            ...                                   image_size=16, augment=False, val_fraction=0.0, test_fraction=0.34)
            >>> site = Site.from_lightning("hospital-a", ImageClassifier(arch="small_cnn", norm="group"), dm,
            ...                            sample_rate=0.5, clip_norm=1.0, seed=0)
            >>> site.num_patients, site.reply(site.parts.state.vector(), round_number=0).dtype
            (4, torch.float32)
        """
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
        dataset = loader.dataset
        if not hasattr(dataset, "patient_to_indices"):
            raise PrivacyConfigError(
                f"`Site({name!r})`: the training set ({type(dataset).__name__}) does not say which images are whose "
                "(no `patient_to_indices`), so no patient can be the unit. HINT: use a patient dataset "
                "(lightning_dp.data), or add a dict patient id → image indices as `patient_to_indices`."
            )
        groups, keys = patient_groups(dataset)  # keyed by the patients' real ids (patient_ids) where the data name them
        collate = loader.collate_fn or default_collate
        data = PatientData(dataset, groups, keys, collate)
        parts = RoundParts(module, ModelState(module), module.training_step, data, local or LocalSGD(), clip_norm)
        if declared_patients is None:
            declared_patients = getattr(datamodule, "declared_num_patients", None)
        return cls(
            name,
            parts,
            sample_rate,
            seed=seed,
            vectorize=vectorize,
            noise_std=noise_std,
            declared_patients=declared_patients,
        )

    @property
    def num_patients(self) -> int:
        """N_s, the site's own number of patients: private (one patient changes it), it never leaves the site."""
        return len(self.parts.data.groups)

    def patients_of_round(self, round_number: int) -> list[int]:
        """The round's patients: an independent Bernoulli(q) coin per patient, from the site's secret and the round.

        The coins are a function of (secret, request), not of a generator's position: with a fixed secret, a site
        whose process restarts between rounds (Flower starts a fresh ``ClientApp`` process per message) still draws
        independent coins for every request. The server numbers each request anew (a re-run round is a new request),
        so no two releases read the same sample; with ``seed=None`` every process draws a fresh secret anyway. The
        coins never leave the site.
        """
        if not self.num_patients:
            return []
        seed = unit_seed(self._secret, "patient-coins", round_number)
        return PoissonPatientSampler(self.num_patients, self.sample_rate, seed=seed).sample().tolist()

    def id_digests(self, key: bytes, salt: str = "") -> list[str]:
        """HMAC-SHA-256 of each patient id under the consortium's ``key`` and a per-run ``salt``: finds shared ids.

        The ids are the patients' real ids (``parts.data.keys``; `from_lightning` takes the dataset's
        ``patient_ids``), never their positions, which every site shares.

        Sites that share a key the server does not hold let the server compare digests; without the key the server
        cannot test a guessed id. The key must come from each site's own settings (its node config or a file), never
        from the run config, which whoever starts the run sets. The salt (the run's id) makes two runs' digests
        unlinkable: a patient added between runs is not one new digest the server can follow. The list is padded
        with random digests to ``declared_patients`` (when the site declared it and holds no more), so its length is
        that public number, not the site's count.
        """
        digests = [hmac.new(key, f"{salt}/{pid}".encode(), hashlib.sha256).hexdigest() for pid in self.parts.data.keys]
        # One digest a patient would tell the server the site's count: padded with random digests (the same format,
        # never equal to a real one but with probability 2⁻²⁵⁶) to the public count the site declared.
        padding = max(0, (self.declared_patients or 0) - len(digests))
        return sorted(digests + [secrets.token_hex(32) for _ in range(padding)])

    def check_training_step(self, dummy_batch: Any) -> None:
        """Runs the model's ``training_step`` forward and backward once on a public dummy batch; raises if it fails.

        ``dummy_batch`` is a batch of the consortium's **declared** input format built from public settings alone
        (e.g. zeros of the declared image shape and dtype, as the example app's ``dummy_batch`` does), never from the
        site's data: whether the check passes is then the same whatever patients the site holds, and the server may
        be told. A model that cannot take the declared input would make every patient's update fail in every round:
        the site would contribute nothing while the run looks normal. The parameters, buffers and gradients are
        restored afterwards.

        Then, for the site's own operator only, the first image of the site's first patient (in the sorted order of
        ids) is compared with the dummy batch's images: a warning in the site's log if its shape or dtype differs
        (e.g. grayscale images beside a declared 3-channel input). That comparison reads the site's data, so its
        outcome stays in the site's log and never changes what the site answers.

        Raises:
            SiteStartError: ``training_step`` raised, or returned no finite loss; the fixed text
                (`DUMMY_BATCH_FAILED`) names no value, the real error goes to the site's log.
        """
        state = self.parts.state
        state.refresh()
        start = (state.vector(), state.snapshot_other_buffers())
        try:
            with torch.enable_grad(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"You are trying to `self.log\(\)`")
                loss = loss_of(self.parts.step(self.parts.data.to_device(dummy_batch), 0))
                if loss.numel() != 1 or not bool(torch.isfinite(loss.detach()).all()):
                    raise PrivacyConfigError(
                        f"training_step returned a loss of shape {tuple(loss.shape)} with values {loss.detach()}: "
                        "not one finite number"
                    )
                loss.backward()
        except Exception:  # noqa: BLE001 - the real error stays in this site's log
            _log.exception("Site %r: the model's training_step failed on the declared input's dummy batch", self.name)
            raise SiteStartError(f"Site {self.name!r}: {DUMMY_BATCH_FAILED}.") from None
        finally:
            for param in self.parts.module.parameters():
                param.grad = None
            state.load(*start)
        self._note_input_format(dummy_batch)

    def _note_input_format(self, dummy_batch: Any) -> None:
        """A warning in this site's log if its first image is unlike the declared input (`check_training_step`)."""
        declared = _first_tensor(dummy_batch)
        try:
            image = _first_tensor(self.parts.data.dataset[self.parts.data.groups[0][0]])
        except Exception:  # noqa: BLE001 - a note for the operator; the round reports unreadable images itself
            _log.exception("Site %r: its first image could not be read", self.name)
            return
        if declared is None or image is None or declared.dim() < 1:
            return
        if tuple(image.shape) != tuple(declared.shape[1:]) or image.dtype != declared.dtype:
            _log.warning(
                "Site %r: its first training image has shape %s and dtype %s; the consortium's declared input is %s "
                "and %s. Every patient whose images the model cannot take contributes nothing (a note for this "
                "hospital's operator only; the server is not told). HINT: convert the images to the declared format "
                "in the datamodule, or ask the consortium to declare the format its data have.",
                self.name,
                tuple(image.shape),
                image.dtype,
                tuple(declared.shape[1:]),
                declared.dtype,
            )

    def reply(self, theta: Tensor, round_number: int, bound: float | None = None) -> Tensor:
        """What the site sends: `clipped_sum`, plus its `noise_share` when the noise is at the sites (``noise_std``).

        Args:
            theta: θ_t from the server.
            round_number: the request's serial number.
            bound: the server's public N·C (see `clipped_sum`); the share is added after the projection.

        Returns:
            A float32 vector the size of ``theta``. Nothing else leaves the site.
        """
        clipped_sum = self.clipped_sum(theta, round_number, bound)
        if self.noise_std > 0:
            share = self.noise_share(clipped_sum.numel(), round_number)
            clipped_sum.add_(share.view_as(clipped_sum).to(clipped_sum))
        return clipped_sum

    def noise_share(self, numel: int, round_number: int) -> Tensor:
        """This reply's noise share: ``numel`` independent N(0, noise_std²) draws, fresh for every reply.

        The generator is seeded from the OS CSPRNG at every call, never from the round number, the site's seed or
        name, or torch's global generator: the share is the mechanism's secret randomness, and one that an observer
        could regenerate (a public seed), that repeats across rounds, or that another site's share cancels would
        remove the noise the ledger charges for (`lightning_dp.audit.FederatedAudit` checks all three).
        ``round_number`` is not used by the draw; it is passed so that the draw's contract can be audited.
        """
        return standard_normal(numel, torch.Generator().manual_seed(secure_seed("share"))).mul_(self.noise_std)

    def clipped_sum(self, theta: Tensor, round_number: int, bound: float | None = None) -> Tensor:
        """Σ over this round's included patients of clip_C(Δ_i), each Δ_i trained from ``theta`` on its own images.

        With the noise at the sites this sum never leaves the site alone: `reply` adds the share to it.

        Args:
            theta: θ_t from the server (the model's released tensors, as `ModelState.vector` lays them out).
            round_number: the request's serial number (with the site's secret it keys the patients' coins and random
                streams; the server numbers every request anew, so a re-run round samples afresh).
            bound: the most a reply may weigh (the server's public N·C): the sum is projected onto the ball of this
                radius before any noise share. A projection onto a ball moves two sums no further apart than they
                were, so one patient still moves the reply by at most C, and the server never refuses a site whose
                own count happens to be large (that refusal would follow the data). None: no projection.

        Returns:
            The clipped sum, a float32 vector the size of ``theta`` (without any noise share).
        """
        state = self.parts.state
        state.refresh()
        expected = state.vector().numel()
        if theta.shape != (expected,):
            raise PrivacyConfigError(
                f"`Site({self.name!r})`: θ from the server has {theta.numel()} values; this site's model has "
                f"{expected}. HINT: every site must build the same model as the server."
            )
        state.load(theta.to(dtype=torch.float32))
        start = (state.vector(), state.snapshot_other_buffers())
        patients = self.patients_of_round(round_number)
        secret = unit_seed(self._units_seed, "round", round_number)
        clipped_sum = torch.zeros_like(start[0])
        with torch.enable_grad(), warnings.catch_warnings():
            # A LightningModule's `self.log` in training_step has no Trainer here: what it would log is private
            # and stays unlogged (Lightning warns about it at every call).
            warnings.filterwarnings("ignore", message=r"You are trying to `self.log\(\)`")
            if isinstance(self.round, LoopRound):
                # One pass, each patient on its own: a patient whose update raises costs its own time only. (Re-doing
                # the round after a failure would double the site's time, and one failing patient could then make
                # the site miss the deadline: its silence would depend on that patient.)
                self._one_by_one(patients, clipped_sum, secret, start)
            else:
                try:
                    stats = self.round.add_clipped(patients, clipped_sum, secret, start)
                    if stats is None:  # the vectorized round could not run this round: the loop re-does it
                        LoopRound(self.parts).add_clipped(patients, clipped_sum, secret, start)
                except Exception:  # noqa: BLE001 - one patient's data must not drop the site (see _one_by_one)
                    clipped_sum.zero_()
                    self._one_by_one(patients, clipped_sum, secret, start)
        state.load(*start)
        if bound is not None:
            norm = float(clipped_sum.double().norm())
            if not norm <= bound:  # a non-finite sum cannot happen (each term is clipped), but would be zeroed
                clipped_sum.mul_(bound / norm if math.isfinite(norm) else 0.0)
        return clipped_sum

    def _one_by_one(self, patients: list[int], clipped_sum: Tensor, secret: int, start: Any) -> None:
        """The round patient by patient; a patient whose update raises contributes nothing (as a non-finite one).

        If one patient's data could make the whole reply fail, that patient would move the release by the site's whole
        sum, not by at most C, and the failure (and its message) would tell the server when the patient was sampled.
        Each patient starts from θ_t with its own streams, so the others' contributions are those of the full round.
        The error stays in this site's log.
        """
        loop = LoopRound(self.parts)
        one = torch.zeros_like(clipped_sum)
        failed = 0
        for patient in patients:
            one.zero_()
            try:
                loop.add_clipped([patient], one, secret, start)
            except Exception:  # noqa: BLE001 - see above
                failed += 1
                self.parts.state.load(*start)
                _log.exception("Site %r: a patient's local update failed; it contributes nothing", self.name)
                continue
            clipped_sum.add_(one)
        if failed:
            _log.warning(
                "Site %r: %d of this round's patients contributed nothing (their updates failed)", self.name, failed
            )

    def close(self) -> None:
        """Frees the round's hooks."""
        self.round.close()
