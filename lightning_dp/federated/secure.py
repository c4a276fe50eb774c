"""The noise at the sites, summed by Flower's secure aggregation (SecAgg+): the server sees the noised sum alone.

Each site adds its noise share to its clipped sum (`Site` with ``noise_std``), and Flower's SecAgg+ protocol
(``secaggplus_mod``, which `site_app`'s ``ClientApp`` applies to the rounds that ask for it, and
``SecAggPlusWorkflow`` on the server, driven by `SecureSum`) masks every site's vector so that the
server can unmask the sum of the surviving sites' vectors and nothing else. `FederatedServer.secure_round` releases
that sum and charges the shares it holds.

What the protocol does to the numbers, at the site, after the noise: every coordinate of a site's noised sum is
clipped to ``[-clipping_range, clipping_range]`` and quantized to ``quantization_range`` levels. Clipping a site's
noised sum before the sum is *not* post-processing of the sum: where it engages it removes that site's noise. So
the range is at least max_s N_s·C + 12·σ_share (a site's clipped sum has no coordinate above N_s·C, and a share's
coordinate passes 12 σ with probability 2Φ(−12) ≈ 3.6e-33), a smaller one is refused, and a site whose noised sum
would still be clipped refuses to take part (that refusal depends on its data with probability below m·d·3.6e-33
for d coordinates: far below any δ). The quantization then rounds each coordinate to 2·range/quantization_range.

Trust model (docs/federated.md): the sites are honest and each adds the share it declares; the server is
honest-but-curious; SecAgg+ reveals a sum only when at least ``reconstruction_threshold`` of a site's neighbours
survive, which is why `FederatedServer`'s ``min_shares`` is that threshold.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, RecordDict
from flwr.common import FitIns, FitRes, Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat
from flwr.server import ServerConfig
from flwr.server.client_manager import ClientManager, SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid

from lightning_dp.errors import PrivacyBudgetExceededError, PrivacyConfigError
from lightning_dp.federated.server import FederatedServer, RoundOutcome

__all__ = ["SecureSum"]


class _OneRound(Strategy):
    """The legacy strategy SecAgg+ drives: θ_t to every site, and the unmasked result kept as it is."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.results: list[tuple[ClientProxy, FitRes]] = []
        self.failures: list[Any] = []

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return None

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        return [(proxy, FitIns(parameters, dict(self.config))) for proxy in client_manager.all().values()]

    def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> tuple[Parameters | None, dict[str, Any]]:
        self.results, self.failures = list(results), list(failures)
        return None, {}

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager) -> list[Any]:
        return []

    def aggregate_evaluate(self, server_round: int, results: Any, failures: Any) -> tuple[float | None, dict[str, Any]]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Any]] | None:
        return None


class SecureSum:
    """One round's sum by SecAgg+ over the given sites' nodes, released by `FederatedServer.secure_round`.

    Args:
        clipping_range: every coordinate of a site's noised sum is clipped to ±this before quantization. ``None``
            (default): N·C + 12·σ_share (N·C: the public bound every site projects its sum onto), the least that
            never clips a site's noise in practice; a smaller value is refused.
        quantization_range: the levels of the quantization (Flower's default 2²²).
        timeout: seconds each of the protocol's four stages waits for the sites.
    """

    def __init__(
        self, clipping_range: float | None = None, quantization_range: int = 4_194_304, timeout: float | None = None
    ) -> None:
        self.clipping_range = clipping_range
        self.quantization_range = quantization_range
        self.timeout = timeout
        self.summed = 0  #: how many sites' vectors the last round's sum holds

    def least_range(self, server: FederatedServer, bounds: Mapping[int, float]) -> float:
        """max bound + 12·σ_share: no site's projected sum is clipped, nor its noise but with probability ~1e-33."""
        return max(bounds.values()) + 12.0 * server.share_std(server.steps)

    def __call__(self, grid: Grid, server: FederatedServer, bounds: Mapping[int, float], request: int) -> RoundOutcome:
        """Runs the protocol for ``request`` over the nodes of ``bounds`` (node → N·C) and releases what it reveals.

        Nothing is released or charged if the protocol halts (too few sites finished it, or a site dropped before
        masking: Flower's unmask stage then asks the others for key shares they never received).
        """
        if server.noise_at != "sites" or server.sites is None:
            raise PrivacyConfigError(
                "SecureSum: secure aggregation carries the sites' noise shares. "
                "HINT: FederatedServer(noise_at='sites')."
            )
        if not server.allows_next_round():
            raise PrivacyBudgetExceededError(f"{server.stop_reason} HINT: ask allows_next_round() before a round.")
        least = self.least_range(server, bounds)
        clipping_range = least if self.clipping_range is None else float(self.clipping_range)
        if clipping_range < least:
            raise PrivacyConfigError(
                f"SecureSum: clipping_range={clipping_range:g} would clip a site's noised sum (a site's coordinates "
                f"reach N·C = {max(bounds.values()):g}, plus its noise share): its noise would be removed uncharged. "
                f"HINT: clipping_range >= {least:g}, or None."
            )
        workflow = SecAggPlusWorkflow(
            num_shares=1.0,  # every site shares its keys with every other
            reconstruction_threshold=server.min_shares / server.sites,
            max_weight=1.0,  # each site weighs 1: no down-scaling before the quantization
            clipping_range=clipping_range,
            quantization_range=self.quantization_range,
            timeout=self.timeout,
        )
        run_id = int(getattr(getattr(grid, "run", None), "run_id", 0) or 0)
        clients = SimpleClientManager()
        for node in bounds:
            clients.register(GridClientProxy(node, grid, run_id))
        config = {
            "request": request,
            "number": server.steps,
            "noise_at": "sites",
            "planned_share": server.share_std(server.steps),
            "clipping_range": clipping_range,
            "reply_bound": server.reply_bound,
        }
        strategy = _OneRound(config)
        context = LegacyContext(
            Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config={}),
            config=ServerConfig(num_rounds=1),
            strategy=strategy,
            client_manager=clients,
        )
        theta = ndarrays_to_parameters([server.theta().detach().cpu().numpy()])
        context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(theta, True)
        context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: request})
        workflow(grid, context)
        self.summed = len(strategy.results)
        if not strategy.results:
            return RoundOutcome(
                None,
                {
                    "secure aggregation": "halted: fewer than min_shares sites finished, "
                    "or a site dropped before masking"
                },
            )
        mean = parameters_to_ndarrays(strategy.results[0][1].parameters)[0]
        total = torch.from_numpy(np.asarray(mean, dtype=np.float32) * len(strategy.results))
        shares = [float(fitres.metrics.get("noise_std", 0.0)) for _, fitres in strategy.results]
        return server.secure_round(total, shares)
