"""Federated P3SGD through Flower's messages: the ``ClientApp`` of `site_app` and the server loop `run_rounds`.

`LocalGrid` hands each message to the same ``ClientApp`` in this process (the deployment runtime's processes are in
tests/integration/federated/). References: the ledger of single-machine P3SGD on the union (the same release, unit
and N); dp-accounting's RDP accountant for the hospital-level ε.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from PIL import Image
from torch import nn

from lightning_dp.accounting import PrivacyLedger, RDPAccountant
from lightning_dp.data import PatientDataModule, PatientImageDataset
from lightning_dp.errors import PrivacyBudgetExceededError, PrivacyConfigError, PrivacyStateError
from lightning_dp.federated import FederatedServer, Site, calibrated_multiplier, share_std
from lightning_dp.federated.flower import (
    FederatedRoundError,
    FederatedStartError,
    LocalGrid,
    round_line,
    run_rounds,
    server_app,
    site_app,
)
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
    round_ = ConfigRecord({"number": 0, "request": 0, "noise_at": "server"})
    content = RecordDict({"theta": ArrayRecord({"theta": Array(theta.numpy())}), "round": round_})
    reply = grid.client_app(Message(content, dst_node_id=1, message_type="train"), grid.contexts[1])
    assert set(reply.content.keys()) == {"clipped_sum", "site"}
    assert dict(reply.content["site"]) == {"name": "a", "noise_std": 0.0}
    got = torch.from_numpy(reply.content["clipped_sum"]["clipped_sum"].numpy().copy())
    assert torch.equal(got, _make_site(grid.contexts[1]).reply(theta, 0)) and float(got.norm()) > 0


def test_a_dropped_a_failing_and_a_malformed_site_contribute_nothing_and_the_round_is_charged() -> None:
    def drop(node: int, message: Message) -> bool:  # site "b" (node 2) misses the second request
        return node == 2 and message.metadata.message_type == "train" and message.metadata.group_id == "1"

    def make(context: Context) -> Site:
        site = _make_site(context)
        if site.name == "c":
            reply = site.reply

            def failing(theta: Any, request: int, bound: Any = None) -> Any:
                if request == 0:
                    raise OSError("disk full at /data/MRN-0042.png")  # private text: it must stay at the site
                return reply(theta, request, bound)

            site.reply = failing  # type: ignore[method-assign]
        return site

    grid = LocalGrid(site_app(make), [{"site": name} for name in SIZES], drop=drop)
    real = grid.client_app

    class _Malformed:  # site c's third reply arrives with the wrong shape
        def __call__(self, message: Message, context: Context) -> Message:
            reply = real(message, context)
            if message.metadata.message_type == "train" and context.node_id == 3 and message.metadata.group_id == "2":
                reply.content["clipped_sum"]["clipped_sum"] = Array(torch.zeros(5).numpy())
            return reply

    grid.client_app = _Malformed()  # type: ignore[assignment]
    server = _server()
    logs = run_rounds(grid, server, rounds=3, sites=3)
    assert logs[0].refused == {"c": "failed (SiteFailure: the site could not answer (its own log says why))"}
    assert "MRN" not in str(logs[0].refused)
    assert logs[1].refused == {"b": "no reply (within the 600 s deadline)"}
    assert logs[2].refused == {"c": "shape (5,), not (74,)"}
    assert [log.sites_replied for log in logs] == [2, 2, 2]
    assert server.ledger.steps == 3


def test_a_restarted_server_continues_the_ledger_exactly(tmp_path: Any) -> None:
    path = tmp_path / "server.pt"
    full = _server()
    run_rounds(_grid(), full, rounds=4, sites=3)
    first = _server()
    run_rounds(_grid(), first, rounds=2, sites=3, checkpoint=path)
    with pytest.raises(PrivacyStateError, match="a checkpoint exists at .* and resume=False"):
        run_rounds(_grid(), _server(), rounds=4, sites=3, checkpoint=path)
    restarted = _server()  # a fresh process: θ₀ as at the start; the checkpoint's θ and ledger win
    logs = run_rounds(_grid(), restarted, rounds=4, sites=3, checkpoint=path, resume=True)
    assert [log.round for log in logs] == [3, 4]
    assert restarted.ledger.state_dict() == full.ledger.state_dict()
    saved = torch.load(path, weights_only=False)
    assert saved["steps"] == 4 and saved["requests"] == 4
    with pytest.raises(PrivacyStateError, match="resume=True without a checkpoint"):
        run_rounds(_grid(), _server(), rounds=4, sites=3, resume=True)
    with pytest.raises(PrivacyStateError, match="resume=True but there is no checkpoint"):
        run_rounds(_grid(), _server(), rounds=4, sites=3, checkpoint=tmp_path / "missing.pt", resume=True)


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
    replace = dp_accounting.rdp.RdpAccountant()  # one hospital's data replaced: the sum moves by up to 2·C_site
    replace.compose(dp_accounting.GaussianDpEvent(1.1 * CLIP / (2 * 4 * CLIP)), 5)
    expected = replace.get_epsilon(server.ledger.delta)
    assert report["hospital_level"]["epsilon_replace_one"] == pytest.approx(expected, rel=0.02)


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
        (["a", "b", "c"], {"c": {"patients": -1}}, {}, "site 'c' failed at start: it could not build its site from"),
        (["a", "b", "b"], {}, {}, "two sites are named 'b'"),
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
    assert "patient ids appear at more than one site" in str(err.value)
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
    assert server.ledger.steps == 0 and len(server.seen_shares) == 3
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


# ------------------------------------------------- what a site's failure, a retry or a misconfigured site can leak
# Found by an independent review of the federated code (each fails on the code before its fix).
def test_a_patient_whose_update_raises_contributes_nothing_and_the_site_still_answers() -> None:
    # A patient whose label is out of range makes the local update raise: before, the whole site dropped out in the
    # rounds that sampled the patient (moving the release by the site's whole sum, 4.4·C) and the server logged
    # "IndexError: Target 7 is out of bounds".
    x, y = _patients(4, seed=5)
    torch.manual_seed(0)
    with_bad = Site("a", _parts(_Net(), torch.cat([x, x[:3]]), torch.cat([y, torch.full((3,), 7)])), 1.0, seed=2)
    without = Site("a", _parts(_Net(), x, y), 1.0, seed=2)
    with_bad.parts.data.keys[:4] = without.parts.data.keys  # the same ids: the same streams for the same patients
    theta = without.parts.state.vector()
    moved = float((with_bad.reply(theta, 0) - without.reply(theta, 0)).norm())
    assert moved < 1e-6


def test_a_site_without_a_share_refuses_to_send_its_sum_when_the_noise_is_at_the_sites() -> None:
    server = _server(noise_at="sites", sites=3, min_shares=2)
    grid = _grid()  # the sites have noise_std = 0
    with pytest.raises(FederatedRoundError):
        run_rounds(grid, server, rounds=1, sites=3)
    assert server.seen_shares == [] and server.ledger.steps == 0  # no sum left any site


def test_a_reply_seen_without_its_share_makes_the_servers_view_unbounded() -> None:
    server = _server(noise_at="sites", sites=3, min_shares=2)
    std = share_std(1.1, CLIP, 3)
    server.round({"a": torch.zeros(74), "b": torch.zeros(74), "c": torch.zeros(74)}, {"a": std, "b": std, "c": 0.0})
    assert server.ledger.steps == 1  # released with the two shares present
    assert server.epsilon_without_secure_aggregation() == float("inf")  # the server saw c's un-noised sum


def test_every_request_draws_fresh_coins_so_a_rerun_round_reads_a_new_sample() -> None:
    site = _make_site(_grid().contexts[1])
    draws = {tuple(site.patients_of_round(request)) for request in range(12)}
    assert len(draws) > 4  # 4 patients at q = 0.5: 16 possible samples
    assert site.patients_of_round(3) == site.patients_of_round(3)


def test_what_the_server_saw_survives_a_restart(tmp_path: Any) -> None:
    path = tmp_path / "server.pt"
    server = _server(noise_at="sites", sites=3, min_shares=3)
    grid = _sites_with_shares(1.1)
    grid.drop = lambda node, message: node == 3 and message.metadata.message_type == "train"
    with pytest.raises(FederatedRoundError):
        run_rounds(grid, server, rounds=1, sites=3, checkpoint=path)
    restarted = _server(noise_at="sites", sites=3, min_shares=3)
    restarted.load_state_dict(torch.load(path, weights_only=False))
    assert len(restarted.seen_shares) == 3 and restarted.requests == 3
    assert restarted.epsilon_without_secure_aggregation() == server.epsilon_without_secure_aggregation() > 0


def test_a_site_that_clips_to_another_bound_is_refused_at_start_and_a_heavy_sum_in_a_round() -> None:
    def make(context: Context) -> Site:
        site = _make_site(context)
        if site.name == "b":
            site.parts.clip_norm = 20 * CLIP
        return site

    with pytest.raises(FederatedStartError, match="site 'b' clips each patient's update to C = 10, the server's"):
        run_rounds(LocalGrid(site_app(make), [{"site": name} for name in SIZES]), _server(), rounds=1, sites=3)
    server = _server(noise=1e-9)
    outcome = server.round({"a": torch.full((74,), 1.0), "b": torch.zeros(74)}, bounds={"a": 4 * CLIP, "b": 3 * CLIP})
    assert outcome.refused == {"a": "its sum weighs more than the bound 2: the site does not clip to C"}


def test_id_digests_differ_between_runs_and_without_the_key_say_nothing() -> None:
    site = _make_site(_grid().contexts[1])
    first, second = site.id_digests(KEY, salt="1"), site.id_digests(KEY, salt="2")
    assert not set(first) & set(second)
    assert site.id_digests(KEY, salt="1") == first and not set(first) & set(site.id_digests(b"other", salt="1"))


def test_with_fewer_shares_allowed_the_calibration_plans_for_them_and_the_run_completes() -> None:
    server = _server(target_epsilon=2.0, rounds=6, noise_at="sites", sites=3, min_shares=2)
    z = calibrated_multiplier(num_patients=12, sample_rate=0.5, rounds=6, target_epsilon=2.0, sites=3, min_shares=2)
    assert server.share_std(0) == share_std(z, CLIP, 3)
    logs = run_rounds(_sites_with_shares(z), server, rounds=6, sites=3)
    assert len(logs) == 6 and server.epsilon() < 2.0  # every share arrived: cheaper than planned


def test_several_noise_scales_are_refused_with_the_reason() -> None:
    with pytest.raises(PrivacyConfigError, match="scores the candidates on the round's sampled patients"):
        _server(noise_scales=[1.0, 1.5])
    assert _server(noise_scales=[1.0]).ledger.steps == 0


def test_a_request_that_went_out_counts_even_if_the_server_crashes_before_its_replies_are_recorded() -> None:
    server = _server(noise_at="sites", sites=3)
    server.new_request()  # the request is on record (and checkpointed) before any site answers
    saved = server.state_dict()
    restarted = _server(noise_at="sites", sites=3)
    restarted.load_state_dict(saved)
    assert restarted.seen_shares == [share_std(1.1, CLIP, 3)] and restarted.requests == 1
    server.round({"a": torch.zeros(74)}, {"a": share_std(1.1, CLIP, 3) / 2})  # the replies replace the entry
    assert server.seen_shares == [share_std(1.1, CLIP, 3) / 2]


# ---------------------------------------------------------------- patient ids from a hospital's manifest (issue 42 §1)
class _TinyClassifier(nn.Module):
    """Reads the library's patient batches, ``(images, labels, patients)``, of 3×4×4 images."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3 * 4 * 4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch[0], batch[1]
        return nn.functional.cross_entropy(self.fc(images.flatten(1)), labels)


def _manifest(folder: Path, ids: list[str], images_per_patient: int = 2) -> Path:
    """A hospital's manifest (``path,label,patient_id``) over tiny PNGs, one folder per hospital."""
    folder.mkdir(parents=True)
    rows = ["path,label,patient_id"]
    rng = np.random.default_rng(len(ids))
    for pid in ids:
        for k in range(images_per_patient):
            name = f"{pid}_{k}.png"
            Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).save(folder / name)
            rows.append(f"{name},{k % 2},{pid}")
    path = folder / "manifest.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def _manifest_grid(tmp_path: Path, ids: dict[str, list[str]]) -> LocalGrid:
    def make(context: Context) -> Site:
        datamodule = PatientDataModule(
            manifest=str(context.node_config["manifest"]),
            batch_size=4,
            val_fraction=0.0,
            test_fraction=0.0,
            augment=False,
        )
        return Site.from_lightning(
            str(context.node_config["site"]), _TinyClassifier(), datamodule, sample_rate=0.5, clip_norm=CLIP, seed=1
        )

    nodes = [{"site": name, "manifest": str(_manifest(tmp_path / name, pids))} for name, pids in ids.items()]
    return LocalGrid(site_app(make, id_key=lambda context: KEY), nodes)


def test_sites_built_from_manifests_compare_their_real_patient_ids(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before the fix, `Site.from_lightning` keyed the patients by the dataset's numbering 0…N−1, which every site
    # has: two hospitals with disjoint ids were refused ("5 patient id(s) appear at more than one site") and two
    # sharing ids were refused by chance of their counts, not their ids.
    caplog.set_level(logging.DEBUG)
    disjoint = {"north": [f"MRN-N{k:03d}" for k in range(5)], "south": [f"MRN-S{k:03d}" for k in range(4)]}
    server = _server(num_patients=9)
    run_rounds(_manifest_grid(tmp_path / "disjoint", disjoint), server, rounds=1, sites=2)
    assert server.ledger.steps == 1
    shared = {"north": [f"MRN-{k:03d}" for k in range(5)], "south": ["MRN-001", "MRN-003", "MRN-004", "MRN-777"]}
    with pytest.raises(FederatedStartError) as err:
        run_rounds(_manifest_grid(tmp_path / "shared", shared), _server(num_patients=9), rounds=1, sites=2)
    assert "patient ids appear at more than one site (neither the ids nor their number are shown)" in str(err.value)
    printed = str(err.value) + caplog.text + "".join(capsys.readouterr())
    assert "MRN" not in printed


def test_a_site_from_a_manifest_keys_its_patients_by_their_ids() -> None:
    dataset = PatientImageDataset.from_arrays(np.zeros((3, 4, 4, 3), np.uint8), [0, 1, 0], ["z-9", "a-1", "z-9"])

    class _DataModule:
        def setup(self, stage: str) -> None:
            pass

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(dataset, batch_size=2)

    site = Site.from_lightning("h", _TinyClassifier(), _DataModule(), sample_rate=1.0, clip_norm=CLIP, seed=0)
    assert site.parts.data.keys == ["a-1", "z-9"] and site.parts.data.groups == [[1], [0, 2]]


# ------------------------------------------------------------- a site that would train nothing (issue 42 §3, §6)
def _dummy_batch(channels: int) -> Any:
    """Zeros of a declared input format, from public settings only: (images, labels), 2 items of ``channels`` × 2."""
    return lambda context: (torch.zeros(2, channels * 2), torch.zeros(2, dtype=torch.long))


def test_a_site_whose_model_cannot_take_the_declared_input_is_refused_at_start_by_its_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The sites' model reads 6 features; the consortium declared 4 (two "channels" of 2). Before, every patient's
    # update failed in every round, each site contributed nothing, and the server printed "3 sites replied".
    caplog.set_level(logging.DEBUG)
    grid = LocalGrid(site_app(_make_site, dummy_batch=_dummy_batch(2)), [{"site": name} for name in SIZES])
    server = _server()
    with pytest.raises(FederatedStartError) as err:
        run_rounds(grid, server, rounds=1, sites=3)
    assert str(err.value).startswith(
        "site 'a' failed at start: its model's training_step failed on a public dummy batch of the declared input"
    )
    assert "mat1 and mat2" not in str(err.value) and "mat1 and mat2" in caplog.text  # the real error: site's log
    assert server.ledger.steps == 0
    ok = _server()
    grid = LocalGrid(site_app(_make_site, dummy_batch=_dummy_batch(3)), [{"site": name} for name in SIZES])
    run_rounds(grid, ok, rounds=1, sites=3)
    assert ok.ledger.steps == 1


def test_the_dummy_batch_leaves_the_model_as_it_was() -> None:
    site = _make_site(_grid().contexts[1])
    before = site.parts.state.vector().clone()
    site.check_training_step(_dummy_batch(3)(None))
    assert torch.equal(site.parts.state.vector(), before)
    assert all(p.grad is None for p in site.parts.module.parameters())


def test_a_node_flower_reports_unavailable_is_reported_as_such_not_as_a_timeout() -> None:
    # Flower answers for a node that stopped sending heartbeats with its own error message, sent by the SuperLink
    # (not by the node): before, the server matched replies by sender and reported "no reply within 600 s".
    from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

    class _KilledNode(LocalGrid):
        def push_messages(self, messages: Any) -> Any:
            ids = []
            for message in messages:
                if message.metadata.dst_node_id == 2 and message.metadata.message_type == "train":
                    self._count += 1
                    message.metadata.__dict__["_message_id"] = f"local-{self._count}"
                    error = create_message_error_unavailable_res_message(message.metadata, "node_unavail")
                    self._outbox[message.metadata.message_id] = error
                    ids.append(message.metadata.message_id)
                else:
                    ids += list(super().push_messages([message]))
            return ids

    grid = _KilledNode(site_app(_make_site), [{"site": name} for name in SIZES])
    logs = run_rounds(grid, _server(), rounds=1, sites=3)
    assert logs[0].refused == {"b": "no reply (Flower: the node stopped sending heartbeats; it is down or cut off)"}
    assert logs[0].sites_replied == 2


def test_each_rounds_line_shows_the_noise_std_per_coordinate_and_the_hospital_level_epsilon() -> None:
    server = _server(site_clip=4 * CLIP)
    logs = run_rounds(_grid(), server, rounds=1, sites=3)
    line = round_line(logs[0], server)
    assert f"noise std {1.1 * CLIP / 6:.4g} per coordinate" in line  # z·C/(q·N), public
    assert f"hospital ε = {server.hospital_epsilon():.4f}" in line and line.endswith("3 sites replied")
    assert "hospital" not in round_line(logs[0], _server())


def _serve(make_server: Any, config: dict[str, Any]) -> None:
    """The ServerApp of `server_app` run once over this module's three sites, as ``flwr run`` would run it."""
    grid = LocalGrid(site_app(_make_site), [{"site": name} for name in SIZES], run_config=config)
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    server_app(make_server)(grid, context)


def test_a_resumed_run_with_nothing_to_do_says_why(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    config = {"rounds": 100, "sites": 3, "checkpoint": str(tmp_path / "server.pt"), "resume": False}
    budgeted = lambda context: _server(noise=2.0, max_epsilon=3.0)  # noqa: E731
    _serve(budgeted, config)
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("stopped: ") and "above the budget 3" in last
    released = int(last.split()[1])
    assert 0 < released < 100 and f"({released} in this run)" in last
    _serve(budgeted, {**config, "resume": True})  # once more: the budget is spent, no round runs, the console says so
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"stopped: {released} of 100 rounds released (0 in this run)")
    _serve(lambda context: _server(), {**config, "resume": True, "rounds": released})  # every round asked for is run
    assert "nothing left to run" in capsys.readouterr().out
