"""Noise at the sites summed by Flower's SecAgg+ (`lightning_dp.federated.secure`), through `LocalGrid`.

References: the plain sum of the same sites' clipped sums (the protocol clips coordinates and quantizes at the site:
the server's sum may differ by at most m·clipping_range/quantization_range per coordinate, 3·8/2²² ≈ 6e-6 here), and
the ledger of the plain noise-at-the-sites path.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from flwr.app import Context, Message
from flwr.common import FitIns, ndarrays_to_parameters
from flwr.compat.common import recorddict_compat as compat

from lightning_dp.errors import PrivacyConfigError
from lightning_dp.federated import Site, share_std
from lightning_dp.federated.flower import FederatedRoundError, LocalGrid, SiteFailure, run_rounds, site_app
from lightning_dp.federated.secure import SecureSum
from tests.unit.federated.test_flower_apps import CLIP, SIZES, _make_site, _server

pytest.importorskip("cryptography")


def _grid(std: float, without_share: str | None = None) -> LocalGrid:
    def make(context: Context) -> Site:
        site = _make_site(context)
        site.noise_std = 0.0 if site.name == without_share else std
        return site

    return LocalGrid(site_app(make), [{"site": name} for name in SIZES])


def test_the_secure_sum_is_the_sum_of_the_sites_noised_sums_and_is_charged_as_the_central_noise() -> None:
    z = 1e-7  # shares this small leave the sum of the clipped sums to compare with the plain path
    server = _server(noise_at="sites", sites=3, noise=z)
    grid = _grid(share_std(z, CLIP, 3))
    theta = server.theta()
    run_rounds(grid, server, rounds=1, sites=3, secure=SecureSum(clipping_range=8.0))
    released = (server.theta() - theta) * server.normalizer
    plain = sum(_make_site(grid.contexts[node]).reply(theta, 0) for node in grid.contexts)
    assert isinstance(plain, torch.Tensor) and float(plain.norm()) > 0.1
    assert float((released - plain).abs().max()) < 1e-4  # quantization (≤ 6e-6) plus fp32 round-off of θ
    reference = _server(noise_at="sites", sites=3, noise=z)
    reference.round({n: torch.zeros(74) for n in SIZES}, {n: share_std(z, CLIP, 3) for n in SIZES})
    assert server.ledger.state_dict() == reference.ledger.state_dict()
    assert server.seen_shares == []  # the server saw no site's sum


def test_a_site_that_drops_out_of_the_protocol_leaves_the_others_sum_charged_for_the_shares_present() -> None:
    server = _server(noise_at="sites", sites=3, min_shares=2)
    logs = run_rounds(_grid(share_std(1.1, CLIP, 3), without_share="c"), server, rounds=1, sites=3, secure=SecureSum())
    event: Any = server.ledger.entries[-1][0]
    assert event.event.noise_multiplier == pytest.approx(1.1 * (2 / 3) ** 0.5, rel=1e-12)
    assert logs[0].noise_std == pytest.approx(1.1 * (2 / 3) ** 0.5 * CLIP / 6, rel=1e-12)


def test_secure_aggregation_needs_the_noise_at_the_sites() -> None:
    with pytest.raises(PrivacyConfigError, match="noise_at='sites'"):
        run_rounds(_grid(1.0), _server(), rounds=1, sites=3, secure=SecureSum())


def test_a_clipping_range_that_would_clip_a_sites_noise_is_refused() -> None:
    server = _server(noise_at="sites", sites=3)
    with pytest.raises(PrivacyConfigError, match="would clip a site's noised sum"):
        run_rounds(_grid(share_std(1.1, CLIP, 3)), server, rounds=1, sites=3, secure=SecureSum(clipping_range=1.0))
    least = SecureSum().least_range(server, {1: 4 * CLIP, 2: 3 * CLIP, 3: 5 * CLIP})
    assert least == pytest.approx(5 * CLIP + 12 * share_std(1.1, CLIP, 3))


def test_a_revealed_sum_is_charged_at_the_noise_present_even_below_the_plan() -> None:
    server = _server(noise_at="sites", sites=3)
    planned = share_std(1.1, CLIP, 3)
    outcome = server.secure_round(torch.zeros(74), [planned, planned, planned / 2])
    assert outcome.result is not None and server.ledger.steps == 1
    event: Any = server.ledger.entries[-1][0]
    assert event.event.noise_multiplier == pytest.approx(1.1 * (2.25 / 3) ** 0.5, rel=1e-12)


def test_sites_refuse_a_share_below_the_plan_so_nothing_is_revealed() -> None:
    server = _server(noise_at="sites", sites=3, min_shares=2)
    grid = _grid(share_std(1.1, CLIP, 3) / 2)
    with pytest.raises(FederatedRoundError, match="halted"):
        run_rounds(grid, server, rounds=1, sites=3, secure=SecureSum(), max_empty_rounds=1)
    assert server.ledger.steps == 0


def test_a_site_that_requires_secure_aggregation_refuses_plain_rounds_and_fit_messages_in_the_clear() -> None:
    std = share_std(1.1, CLIP, 3)

    def make(context: Context) -> Site:
        site = _make_site(context)
        site.noise_std = std
        return site

    app = site_app(make, require_secure_aggregation=True)
    grid = LocalGrid(app, [{"site": name} for name in SIZES])
    server = _server(noise_at="sites", sites=3)
    with pytest.raises(FederatedRoundError):
        run_rounds(grid, server, rounds=1, sites=3, max_empty_rounds=1)
    assert server.seen_shares == [] and server.ledger.steps == 0  # no site's sum reached the server
    # Flower's legacy fit format outside the protocol's masking stage: refused, the sum stays at the site.
    fitins = FitIns(ndarrays_to_parameters([server.theta().numpy()]), {"request": 0, "planned_share": std})
    message = Message(compat.fitins_to_recorddict(fitins, True), dst_node_id=1, message_type="train")
    with pytest.raises(SiteFailure):
        site_app(make)(message, grid.contexts[1])
    assert SecureSum().summed == 0
