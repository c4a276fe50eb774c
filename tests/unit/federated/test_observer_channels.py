"""What a federated run lets an observer see besides the noised sum (issue 41; ALGORITHMS.md §9, §7).

From the fourth independent review: a site that one patient with many images made miss the server's deadline moved
the release by 14.71·C at a printed ε of 4.73 (and ``sites_replied`` said so); a normalizer q·N with N the sites'
own count made the noise scale of every released θ_t follow that count (δ = 0.886 at patient level, δ = 1.000 at
hospital level for the scale channel alone); an overweight reply's refusal printed that reply's norm. Each test here
fails on the code before those fixes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from flwr.app import Context, Message

from lightning_dp.federated import FederatedServer, Site
from lightning_dp.federated.flower import LocalGrid, RoundLog, run_rounds, site_app
from lightning_dp.sanitization import ModelState
from lightning_dp.training.patient_rounds import LocalSGD, PatientData, RoundParts
from tests.unit.federated.test_federated_round import CLIP, _Images, _Net, _patients

WHALE_IMAGES = 1_000_000  # a whole slide's patches: uncapped, 62,500 local steps (> 10 s); capped, one
DEADLINE = 10.0  # seconds: far above a capped site's round (21 local steps), far below the whale's uncapped one


def _site(name: str, count: int, whale: bool, local: LocalSGD, seed: int) -> Site:
    x, y = _patients(count, seed=sum(map(ord, name)), per_patient=3)
    groups = [list(range(3 * k, 3 * k + 3)) for k in range(count)]
    keys: list[Any] = [f"{name}-{k}" for k in range(count)]
    if whale:  # one more patient, holding WHALE_IMAGES images
        g = torch.Generator().manual_seed(99)
        wx = torch.randn(WHALE_IMAGES, 6, generator=g) * 3
        groups.append(list(range(len(y), len(y) + WHALE_IMAGES)))
        keys.append(f"{name}-whale")
        x, y = torch.cat([x, wx]), torch.cat([y, (wx[:, 1] > 0).long()])
    torch.manual_seed(0)
    net = _Net()
    parts = RoundParts(net, ModelState(net), net.training_step, PatientData(_Images(x, y), groups, keys), local, CLIP)
    return Site(name, parts, sample_rate=1.0, seed=seed)


def _run(whale: bool, local: LocalSGD, rounds: int = 2) -> tuple[list[RoundLog], list[torch.Tensor]]:
    def make(context: Context) -> Site:
        name = str(context.node_config["site"])
        return _site(name, 20, whale and name == "b", local, seed=5 + ord(name[0]))

    torch.manual_seed(0)
    server = FederatedServer(_Net(), num_patients=41, sample_rate=1.0, clip_norm=CLIP, noise=1.0, seed=3)
    thetas: list[torch.Tensor] = []
    grid = LocalGrid(site_app(make), [{"site": "a"}, {"site": "b"}])
    logs = run_rounds(
        grid, server, rounds, sites=2, round_timeout=DEADLINE, on_round=lambda log: thetas.append(server.theta())
    )
    return logs, thetas


def test_a_patient_with_many_images_cannot_silence_its_site_under_a_real_deadline() -> None:
    # A grid that drops a reply that took longer than the deadline, as the deployment's does. With the public cap
    # on a patient's images per round, the whale trains on 16 of its 200,000 images: its site answers in time, the
    # same sites are summed in both worlds, and the release moves by at most C (same noise, same other patients).
    local = LocalSGD(lr=0.2, batch_size=16, max_images=16)
    with_whale, thetas_with = _run(True, local, rounds=1)
    without, thetas_without = _run(False, local, rounds=1)
    assert [log.sites_replied for log in with_whale] == [log.sites_replied for log in without] == [2]
    assert with_whale[0].refused == without[0].refused == {}
    moved = float((thetas_with[0] - thetas_without[0]).norm()) * 1.0 * 41 / 1.0  # back to the sum: × q·N / lr
    assert moved <= CLIP * (1 + 1e-4)


def test_a_site_bounds_every_patients_work_by_default() -> None:
    # A Site given a local SGD without max_images still bounds a patient's work (SITE_MAX_IMAGES), never unbounded.
    site = _site("a", 2, False, LocalSGD(lr=0.2, batch_size=16), seed=1)
    assert site.parts.local.max_images == 256 and site.parts.local.max_steps == 16


def test_the_cap_draws_a_fresh_subset_of_a_large_patient_from_its_own_stream_and_leaves_small_ones_alone() -> None:
    local = LocalSGD(batch_size=4, max_images=5)
    draws = [local.images(range(100), torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    assert all(len(d) == 5 and len(set(d)) == 5 for d in draws) and draws[0] != draws[1]
    assert local.images(range(5), torch.Generator().manual_seed(0)).tolist() == list(range(5))
    assert local.max_steps == 2


@pytest.mark.parametrize(("hospitals", "patients"), [(4, 20), (3, 20)])
def test_the_noise_scale_of_every_release_is_the_declared_normalizers_whatever_the_sites_hold(
    hospitals: int, patients: int
) -> None:
    # The review: with N the sites' own count, 4 hospitals (N = 80) and 3 (N = 60) released θ_t with noise std
    # 0.10017 and 0.13357 per coordinate. N is now the consortium's declaration, the same in both worlds, and the
    # server neither asks the sites for their counts nor refuses a run whose real counts do not add up to it.
    names = "abcd"[:hospitals]

    def make(context: Context) -> Site:
        name = str(context.node_config["site"])
        return _site(name, patients, False, LocalSGD(lr=0.2, batch_size=8), seed=ord(name))

    sent: list[Message] = []
    grid = LocalGrid(site_app(make), [{"site": n} for n in names])
    real = grid.client_app

    def recording(message: Message, context: Context) -> Message:
        reply = real(message, context)
        sent.append(reply)
        return reply

    grid.client_app = recording  # type: ignore[assignment]
    torch.manual_seed(0)
    server = FederatedServer(_Net(), num_patients=80, sample_rate=1.0, clip_norm=CLIP, noise=1.0, seed=3)
    logs = run_rounds(grid, server, 2, sites=hospitals)
    assert [log.noise_std for log in logs] == [pytest.approx(1.0 * CLIP / 80, rel=1e-12)] * 2
    hello = [m for m in sent if "site" in m.content and "sample_rate" in m.content["site"]]
    assert hello and all("num_patients" not in m.content["site"] for m in hello)


def test_a_site_projects_its_sum_onto_the_public_bound_and_so_is_never_refused_for_its_count() -> None:
    # A site with more patients than the consortium declared in all could send a sum heavier than N·C: it is
    # projected onto that ball (a projection moves two sums no further apart: one patient still moves it ≤ C).
    site = _site("a", 12, False, LocalSGD(lr=5.0, batch_size=8), seed=2)
    theta = site.parts.state.vector()
    full = site.reply(theta, 0)
    assert float(full.norm()) > 2 * CLIP
    projected = site.reply(theta, 0, bound=2 * CLIP)
    assert float(projected.norm()) == pytest.approx(2 * CLIP, rel=1e-5)
    assert torch.allclose(projected / projected.norm(), full / full.norm(), atol=1e-6)


def test_an_overweight_reply_is_refused_naming_the_bound_not_the_replys_norm() -> None:
    server = FederatedServer(_Net(), num_patients=4, sample_rate=0.5, clip_norm=CLIP, noise=1e-9, seed=0)
    outcome = server.round({"a": torch.full((74,), 1.0)}, bounds={"a": server.reply_bound})
    assert outcome.refused == {"a": "its sum weighs more than the bound 2: the site does not clip to C"}
    assert "8.6" not in outcome.refused["a"]  # the reply's norm, a private number, is not printed


def test_a_failing_patient_costs_its_own_work_only_never_a_second_pass_over_the_others() -> None:
    # The fifth review: a patient whose update raised made the site re-run its whole round patient by patient, so the
    # site's time doubled and one patient could make it miss a deadline set from the public worst case. Now the loop
    # is one pass with each patient's failure isolated: the others' local steps are counted once.
    def steps_taken(failing: bool) -> int:
        site = _site("a", 6, False, LocalSGD(lr=0.2, batch_size=8), seed=4)
        calls = [0]
        step = site.parts.step

        def counted(batch: Any, batch_idx: int) -> Any:
            calls[0] += 1
            if failing and bool((batch[0] == site.parts.data.dataset.x[15]).all(dim=1).any()):
                raise RuntimeError("patient a-5's scan is corrupt")  # the last patient's update raises
            return step(batch, batch_idx)

        site.parts.step = counted
        site.reply(site.parts.state.vector(), 0)
        return calls[0]

    assert steps_taken(failing=True) == steps_taken(failing=False) == 6  # q = 1: six patients, one step each


def test_the_id_digests_number_the_declared_patients_not_the_sites_count() -> None:
    # The review of issue 41's fixes: one digest a patient told the server each site's count (4 vs 5 patients).
    # Padded with random digests to the site's declared count, their number is that public number.
    four, five = (_site("b", n, False, LocalSGD(lr=0.2, batch_size=8), seed=1) for n in (4, 5))
    for site in (four, five):
        site.declared_patients = 6
    digests = [site.id_digests(b"consortium key", salt="run-1") for site in (four, five)]
    assert [len(d) for d in digests] == [6, 6]
    assert set(digests[0]) & set(digests[1]) == set(four.id_digests(b"consortium key", salt="run-1")) & set(
        five.id_digests(b"consortium key", salt="run-1")
    )  # the four shared patients' digests match; the padding never does
