"""Federated P3SGD through Flower's messages: the ``ClientApp`` of `site_app` and the server loop `run_rounds`.

`LocalGrid` hands each message to the same ``ClientApp`` in this process (the deployment runtime's processes are in
tests/integration/federated/). References: the ledger of single-machine P3SGD on the union (the same release, unit
and N); dp-accounting's RDP accountant for the hospital-level ε.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from lightning_dp.accounting import PrivacyLedger, RDPAccountant
from lightning_dp.errors import PrivacyBudgetExceededError, PrivacyConfigError
from lightning_dp.federated import FederatedServer, Site, calibrated_multiplier, share_std
from lightning_dp.federated.flower import FederatedRoundError, FederatedStartError, LocalGrid, run_rounds, site_app
from lightning_dp.sanitization import GaussianRelease
from tests.unit.federated.test_federated_round import CLIP, _Net, _parts, _patients

SIZES = {"a": 4, "b": 3, "c": 5}  # N = 12 over three hospitals
KEY = b"consortium id key"


def _make_site(context: Context) -> Site:
    name = str(context.node_config["site"])
    count = int(context.node_config.get("patients", SIZES.get(name, 3)))  # type: ignore[arg-type]
    x, y = _patients(count, seed=sum(map(ord, name)))
    torch.manual_seed(0)
    parts = _parts(_Net(), x, y)
    if "id-prefix" in context.node_config:
        parts.data.keys[:] = [f"{context.node_config['id-prefix']}{k}" for k in range(count)]
    else:
        parts.data.keys[:] = [f"{name}-{k}" for k in range(count)]
    return Site(name, parts, sample_rate=0.5, seed=int(context.node_config.get("seed", 7)))  # type: ignore[arg-type]


def _grid(names: list[str] | None = None, drop: Any = None, id_key: bool = False, **extra: Any) -> LocalGrid:
    app = site_app(_make_site, id_key=(lambda context: KEY) if id_key else None)
    configs = [{"site": name, **extra.get(name, {})} for name in names or list(SIZES)]
    return LocalGrid(app, configs, drop=drop)


def _server(**kwargs: Any) -> FederatedServer:
    torch.manual_seed(0)
    settings: dict[str, Any] = {"num_patients": 12, "sample_rate": 0.5, "clip_norm": CLIP, "noise": 1.1, "seed": 3}
    settings.update(kwargs)
    return FederatedServer(_Net(), **settings)


def test_rounds_through_flower_messages_keep_p3sgds_ledger_on_the_union() -> None:
    server = _server()
    logs = run_rounds(_grid(), server, rounds=3, sites=3)
    assert [log.round for log in logs] == [1, 2, 3] and all(log.refused == {} for log in logs)
    single = PrivacyLedger("patient", server.ledger.delta)
    release = GaussianRelease(single, clip_norm=CLIP, sample_rate=0.5, schedule=1.1, seed=0)
    for t in range(3):
        release.release(t, torch.zeros(3), normalizer=0.5 * 12)
    assert server.ledger.state_dict() == single.state_dict()
    assert [log.noise_std for log in logs] == [pytest.approx(1.1 * CLIP / 6, rel=1e-12)] * 3
    assert logs[-1].epsilon == RDPAccountant().epsilon(single)


def test_the_messages_carry_theta_in_and_only_the_clipped_sum_out() -> None:
    # Through Flower's records, the reply equals the site's own `reply` bit for bit, and holds nothing else private.
    grid = _grid(["a"])
    theta = _server(num_patients=4).theta()
    content = RecordDict({"theta": ArrayRecord({"theta": Array(theta.numpy())}), "round": ConfigRecord({"number": 0})})
    reply = grid.client_app(Message(content, dst_node_id=1, message_type="train"), grid.contexts[1])
    assert set(reply.content.keys()) == {"clipped_sum", "site"}
    assert dict(reply.content["site"]) == {"name": "a", "noise_std": 0.0}
    got = torch.from_numpy(reply.content["clipped_sum"]["clipped_sum"].numpy().copy())
    assert torch.equal(got, _make_site(grid.contexts[1]).reply(theta, 0)) and float(got.norm()) > 0


def test_a_dropped_a_failing_and_a_malformed_site_contribute_nothing_and_the_round_is_charged() -> None:
    def drop(node: int, message: Message) -> bool:  # site "b" (node 2) misses round 2's message
        return node == 2 and message.metadata.message_type == "train" and message.metadata.group_id == "1"

    grid = _grid(drop=drop)
    real = grid.client_app

    class _Faulty:
        def __call__(self, message: Message, context: Context) -> Message:
            reply = real(message, context)
            if message.metadata.message_type == "train" and context.node_id == 3:
                number = int(message.content["round"]["number"])  # type: ignore[arg-type]
                if number == 0:
                    raise RuntimeError("disk full")
                if number == 2:
                    reply.content["clipped_sum"]["clipped_sum"] = reply.content["clipped_sum"]["clipped_sum"].__class__(
                        torch.zeros(5).numpy()
                    )
            return reply

    grid.client_app = _Faulty()  # type: ignore[assignment]
    server = _server()
    logs = run_rounds(grid, server, rounds=3, sites=3)
    assert logs[0].refused == {"c": "failed: RuntimeError: disk full"}
    assert logs[1].refused == {"b": "no reply within 600 s"}
    assert logs[2].refused == {"c": "shape (5,), not (74,)"}
    assert [log.sites_replied for log in logs] == [2, 2, 2]
    assert server.ledger.steps == 3


def test_a_restarted_server_continues_the_ledger_and_theta_exactly(tmp_path: Any) -> None:
    path = tmp_path / "server.pt"
    full = _server()
    run_rounds(_grid(), full, rounds=4, sites=3)
    first = _server()
    run_rounds(_grid(), first, rounds=2, sites=3, checkpoint=path)
    restarted = _server()  # a fresh process: θ₀ and the noise seed as at the start; the checkpoint wins
    logs = run_rounds(_grid(), restarted, rounds=4, sites=3, checkpoint=path)
    assert [log.round for log in logs] == [3, 4]
    assert torch.equal(restarted.theta(), full.theta())
    assert restarted.ledger.state_dict() == full.ledger.state_dict()
    assert torch.load(path, weights_only=False)["steps"] == 4


def test_the_budget_stops_before_the_round_that_would_exceed_it() -> None:
    server = _server(noise=2.0, max_epsilon=3.0)
    logs = run_rounds(_grid(), server, rounds=100, sites=3)
    assert 0 < len(logs) < 100 and server.epsilon() <= 3.0
    assert server.stop_reason is not None and "above the budget 3" in server.stop_reason
    with pytest.raises(PrivacyBudgetExceededError, match="allows_next_round"):
        server.round({})
    assert server.ledger.steps == len(logs)


def test_target_epsilon_calibrates_the_noise_so_the_planned_rounds_end_at_it() -> None:
    server = _server(target_epsilon=2.0, rounds=6)
    run_rounds(_grid(), server, rounds=6, sites=3)
    assert server.epsilon() == pytest.approx(2.0, rel=0.01) and server.epsilon() <= 2.0


def test_the_hospital_level_epsilon_equals_dp_accountings_gaussian_composition() -> None:
    dp_accounting = pytest.importorskip("dp_accounting")
    server = _server(site_clip=4 * CLIP)
    run_rounds(_grid(), server, rounds=5, sites=3)
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(1.1 * CLIP / (4 * CLIP)), 5)
    reference = accountant.get_epsilon(server.ledger.delta)
    assert server.hospital_epsilon() == pytest.approx(reference, rel=0.02)
    report = server.report()
    assert report["hospital_level"]["epsilon"] == server.hospital_epsilon() and report["epsilon"] < reference


def test_a_site_clip_bounds_what_one_hospital_moves_the_sum_by() -> None:
    server = _server(site_clip=0.3, noise=1e-9)
    before = server.theta()
    server.round({"a": torch.full((74,), 10.0)})
    moved = float((server.theta() - before).norm()) * server.normalizer
    assert moved == pytest.approx(0.3, rel=1e-4)


@pytest.mark.parametrize(
    ("names", "extra", "server", "message"),
    [
        (["a", "b"], {}, {}, "only 2 of the 3 expected sites connected"),
        (["a", "b", "c"], {"c": {"patients": 0}}, {}, "failed at start: PrivacyConfigError"),
        (["a", "b", "b"], {}, {}, "two sites are named 'b'"),
        (["a", "b", "c"], {}, {"num_patients": 20}, "the sites hold 12 patients (a: 4, b: 3, c: 5)"),
        (["a", "b", "c"], {}, {"sample_rate": 0.25}, "site 'a' samples its patients at q = 0.5, the server's"),
    ],
)
def test_a_consortium_the_server_cannot_run_is_refused_at_start(
    names: list[str], extra: dict[str, Any], server: dict[str, Any], message: str
) -> None:
    with pytest.raises(FederatedStartError) as err:
        run_rounds(_grid(names, **extra), _server(**server), rounds=1, sites=3, start_timeout=0.5)
    assert message in str(err.value)


def test_patient_ids_two_sites_share_are_refused_without_showing_them() -> None:
    grid = _grid(["a", "b", "c"], id_key=True, b={"id-prefix": "a-"})  # b's first 3 ids are a's
    with pytest.raises(FederatedStartError) as err:
        run_rounds(grid, _server(), rounds=1, sites=3)
    assert "3 patient id(s) appear at more than one site" in str(err.value)
    assert "a-0" not in str(err.value) and "a-1" not in str(err.value)
    server = _server()
    run_rounds(_grid(id_key=True), server, rounds=1, sites=3)  # distinct ids: it runs
    assert server.ledger.steps == 1


# ---------------------------------------------------------------------------------------------- noise at the sites
def _sites_with_shares(z: float, count: int = 3) -> LocalGrid:
    std = share_std(z, CLIP, count)

    def make(context: Context) -> Site:
        site = _make_site(context)
        site.noise_std = std
        return site

    return LocalGrid(site_app(make), [{"site": name} for name in list(SIZES)[:count]])


def test_shares_from_every_site_are_charged_as_the_central_noise_and_sum_to_it() -> None:
    server = _server(noise_at="sites", sites=3)
    run_rounds(_sites_with_shares(1.1), server, rounds=2, sites=3)
    central = _server()
    run_rounds(_grid(), central, rounds=2, sites=3)
    assert server.ledger.state_dict() == central.ledger.state_dict()
    # The share itself: two replies to the same round differ only by two independent shares, N(0, 2·(zC/√3)²).
    grid = _sites_with_shares(1.1)
    one = _make_site(grid.contexts[1])
    one.noise_std = share_std(1.1, CLIP, 3)
    theta = server.theta()
    diffs = torch.cat([one.reply(theta, 0) - one.reply(theta, 0) for _ in range(20)])  # 1,480 values
    measured = float(diffs.std()) / 2**0.5
    # 1,480 normal values: the std estimate's relative sd is ~1.8 %; 8 % is over 4 sd.
    assert measured == pytest.approx(1.1 * CLIP / 3**0.5, rel=0.08)


def test_a_missing_share_is_charged_the_noise_that_is_present() -> None:
    def drop(node: int, message: Message) -> bool:
        return node == 3 and message.metadata.message_type == "train"

    server = _server(noise_at="sites", sites=3, min_shares=2)
    grid = _sites_with_shares(1.1)
    grid.drop = drop
    logs = run_rounds(grid, server, rounds=2, sites=3)
    event = server.ledger.entries[-1][0]
    assert event.event.noise_multiplier == pytest.approx(1.1 * (2 / 3) ** 0.5, rel=1e-12)  # type: ignore[attr-defined]
    assert logs[-1].noise_std == pytest.approx(1.1 * (2 / 3) ** 0.5 * CLIP / 6, rel=1e-12)
    central = _server()
    run_rounds(_grid(), central, rounds=2, sites=3)
    assert server.epsilon() > central.epsilon()
    assert server.epsilon_without_secure_aggregation() > server.epsilon()


def test_a_round_without_any_share_releases_and_charges_nothing_then_stops() -> None:
    server = _server(noise_at="sites", sites=3)
    before = server.theta()
    assert server.round({"a": None}).result is None
    assert server.ledger.steps == 0 and torch.equal(server.theta(), before)
    grid = _sites_with_shares(1.1)
    grid.drop = lambda node, message: message.metadata.message_type == "train"
    with pytest.raises(FederatedRoundError, match="too few noise shares arrived in 3 attempts"):
        run_rounds(grid, server, rounds=2, sites=3)
    assert server.ledger.steps == 0


def test_fewer_shares_than_the_threshold_release_and_charge_nothing() -> None:
    server = _server(noise_at="sites", sites=3, min_shares=3)
    grid = _sites_with_shares(1.1)
    grid.drop = lambda node, message: node == 3 and message.metadata.message_type == "train"
    with pytest.raises(FederatedRoundError, match="in 3 attempts"):
        run_rounds(grid, server, rounds=1, sites=3)
    assert server.ledger.steps == 0 and server.rounds_seen == 3
    assert server.epsilon_without_secure_aggregation() > 0  # the server did see those sums


def test_the_budget_with_shares_assumes_the_fewest_shares() -> None:
    # One share may be all there is (min_shares=1): z/√3. The budget stops before a round that could cost that much.
    server = _server(noise_at="sites", sites=3, min_shares=1, noise=3.0, max_epsilon=2.0)
    worst = _server(noise=3.0 / 3**0.5, max_epsilon=2.0)
    run_rounds(_sites_with_shares(3.0), server, rounds=200, sites=3)
    run_rounds(_grid(), worst, rounds=200, sites=3)
    assert server.ledger.steps == worst.ledger.steps and server.epsilon() <= 2.0


def test_shares_and_a_site_clip_are_refused_together() -> None:
    with pytest.raises(PrivacyConfigError, match="hospital-level ε would not hold"):
        _server(noise_at="sites", sites=3, site_clip=1.0)
    with pytest.raises(PrivacyConfigError, match="needs the number of sites"):
        _server(noise_at="sites")


def test_sites_compute_the_servers_calibrated_multiplier_from_the_public_settings() -> None:
    server = _server(target_epsilon=2.0, rounds=6, noise_at="sites", sites=3)
    z = calibrated_multiplier(num_patients=12, sample_rate=0.5, rounds=6, target_epsilon=2.0)
    assert server.share_std(0) == share_std(z, CLIP, 3) == pytest.approx(z * CLIP / 3**0.5, rel=1e-12)
    run_rounds(_sites_with_shares(z), server, rounds=6, sites=3)
    assert server.epsilon() == pytest.approx(2.0, rel=0.01) and server.epsilon() <= 2.0
