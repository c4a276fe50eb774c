"""Federated P3SGD's core without a transport: sites reply clipped sums, the server noises once and keeps one ledger.

Checked against single-machine P3SGD on the union of the patients: the same ledger events, ε and noise std; at q = 1
(every patient in every round) and one full-batch local step, the same clipped sum up to float round-off (1e-6).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_dp.accounting import PrivacyLedger, RDPAccountant
from lightning_dp.errors import PrivacyStateError
from lightning_dp.federated import FederatedServer, Site
from lightning_dp.sanitization import GaussianRelease, ModelState
from lightning_dp.training.patient_rounds import LocalSGD, LoopRound, PatientData, RoundParts

CLIP = 0.5
LOCAL = LocalSGD(lr=0.2, batch_size=8)  # one full-batch step per patient: the image order does not matter


class _Images(Dataset):  # type: ignore[type-arg]
    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


def _patients(count: int, seed: int, per_patient: int = 3) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count * per_patient, 6, generator=g)
    return x, (x[:, 0] > 0).long()


def _parts(net: _Net, x: Tensor, y: Tensor, per_patient: int = 3) -> RoundParts:
    groups = [list(range(k * per_patient, (k + 1) * per_patient)) for k in range(len(y) // per_patient)]
    data = PatientData(_Images(x, y), groups, [f"p{k}" for k in range(len(groups))])
    return RoundParts(net, ModelState(net), net.training_step, data, LOCAL, CLIP)


def _site(name: str, x: Tensor, y: Tensor, sample_rate: float, seed: int) -> Site:
    torch.manual_seed(0)
    return Site(name, _parts(_Net(), x, y), sample_rate=sample_rate, seed=seed)


def test_the_sites_sums_add_up_to_the_single_machine_round_on_the_union() -> None:
    a, b = _patients(4, seed=1), _patients(3, seed=2)
    sites = [_site("a", *a, sample_rate=1.0, seed=10), _site("b", *b, sample_rate=1.0, seed=11)]
    torch.manual_seed(0)
    pooled_net = _Net()
    union = _parts(pooled_net, torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]))
    state = union.state
    theta = state.vector()
    start = (theta, state.snapshot_other_buffers())
    pooled = torch.zeros_like(theta)
    with torch.enable_grad():
        LoopRound(union).add_clipped(list(range(7)), pooled, secret=3, start=start)
    federated = sum(site.reply(theta, round_number=0) for site in sites)
    assert isinstance(federated, Tensor)
    assert float(pooled.norm()) > 0.1 * CLIP
    assert torch.allclose(federated, pooled, rtol=0, atol=1e-6), float((federated - pooled).abs().max())


def test_one_ledger_equal_to_single_machine_p3sgd() -> None:
    # N = 7 over two sites, q = 0.3, z = 1.2, 5 rounds: the events, ε and the noise std are P3SGD's on N = 7.
    torch.manual_seed(0)
    server = FederatedServer(_Net(), num_patients=7, sample_rate=0.3, clip_norm=CLIP, noise=1.2, seed=0)
    sites = [_site("a", *_patients(4, seed=1), sample_rate=0.3, seed=5), _site("b", *_patients(3, seed=2), 0.3, 6)]
    stds = []
    for t in range(5):
        theta = server.theta()
        outcome = server.round({site.name: site.reply(theta, t) for site in sites})
        assert outcome.refused == {}
        stds.append(outcome.result.released.noise_std)
    single = PrivacyLedger("patient", server.ledger.delta)
    release = GaussianRelease(single, clip_norm=CLIP, sample_rate=0.3, schedule=1.2, seed=0)
    for t in range(5):
        release.release(t, torch.zeros(3), normalizer=0.3 * 7)
    assert server.ledger.state_dict() == single.state_dict() and server.ledger.steps == 5
    assert RDPAccountant().epsilon(server.ledger) == RDPAccountant().epsilon(single)
    assert stds == [pytest.approx(1.2 * CLIP / (0.3 * 7), rel=1e-12)] * 5


def test_one_patient_moves_a_sites_reply_by_at_most_the_clip_norm() -> None:
    x, y = _patients(4, seed=3)
    x[:3] *= 1e4  # patient 0: images 1e4 times larger, labels its model finds least likely
    with torch.no_grad():
        torch.manual_seed(0)
        y[:3] = _Net().net(x[:3]).argmax(1) ^ 1
    with_it = _site("a", x, y, sample_rate=1.0, seed=1)
    without = _site("a", x[3:], y[3:], sample_rate=1.0, seed=1)
    theta = with_it.parts.state.vector()
    moved = float((with_it.reply(theta, 0) - without.reply(theta, 0)).norm())
    assert moved == pytest.approx(CLIP, rel=1e-4)


@pytest.mark.parametrize(
    ("reply", "problem"),
    [
        (None, "no reply"),
        (torch.zeros(3), "shape (3,), not (74,)"),
        (torch.zeros(74, dtype=torch.float64), "dtype torch.float64, not torch.float32"),
        (torch.full((74,), float("nan")), "non-finite values"),
        ([0.0] * 74, "a list, not a tensor"),
    ],
)
def test_a_malformed_reply_is_refused_and_the_round_still_charged(reply: Any, problem: str) -> None:
    torch.manual_seed(0)
    server = FederatedServer(_Net(), num_patients=10, sample_rate=0.5, clip_norm=CLIP, noise=1.0, seed=0)
    before = server.theta()
    outcome = server.round({"good": torch.zeros(74), "bad": reply})
    assert outcome.refused == {"bad": problem}
    assert server.ledger.steps == 1
    assert not torch.equal(server.theta(), before), "the noised update is applied"


def test_the_server_resumes_its_ledger_exactly_with_fresh_noise() -> None:
    def run(rounds: int, saved: dict[str, Any] | None = None, delta: float | None = None) -> FederatedServer:
        torch.manual_seed(0)
        server = FederatedServer(
            _Net(), num_patients=10, sample_rate=0.5, clip_norm=CLIP, noise=1.0, seed=4, delta=delta
        )
        if saved is not None:
            server.load_state_dict(saved)
        for _ in range(rounds):
            server.round({"a": torch.zeros(74)})
        return server

    full = run(4)
    saved = run(2).state_dict()
    assert "release" not in saved  # the noise generator's state would let a checkpoint's holder remove the noise
    resumed = run(2, saved)
    assert full.ledger.state_dict() == resumed.ledger.state_dict() and resumed.steps == 4
    assert not torch.equal(full.theta(), resumed.theta()), "a resumed server draws fresh noise"
    with pytest.raises(PrivacyStateError, match="fresh ledger"):
        run(0, {"theta": full.theta()})
    with pytest.raises(PrivacyStateError, match="δ=1e-05; this server's is unit='patient', δ=1e-09"):
        run(0, saved, delta=1e-9)


def test_a_site_without_patients_takes_part_with_zero_sums() -> None:
    # Run or no run must not depend on one patient: a site whose only patient was removed still answers (the
    # review of issue 41's fixes: a 1-patient site ran, the same site emptied refused the whole consortium's start).
    net = _Net()
    empty = RoundParts(net, ModelState(net), net.training_step, PatientData([], [], []), LOCAL, CLIP)
    site = Site("empty", empty, sample_rate=0.1, seed=0)
    reply = site.reply(ModelState(net).vector(), round_number=0)
    assert site.patients_of_round(0) == [] and torch.equal(reply, torch.zeros_like(reply))
