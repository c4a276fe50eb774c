"""The noise at the sites, summed by Flower's secure aggregation (SecAgg+): the server sees the noised sum alone.

Each site adds its noise share to its clipped sum (`Site` with ``noise_std``), and Flower's SecAgg+ protocol
(``secaggplus_mod``, which `site_app`'s ``ClientApp`` applies to the rounds that ask for it, and
``SecAggPlusWorkflow`` on the server, driven by `SecureSum`) masks every site's vector so that the
server can unmask the sum of the surviving sites' vectors and nothing else. `FederatedServer.secure_round` releases
that sum and charges the shares it holds.

What the protocol does to the numbers, all at the site, after the noise (post-processing): every coordinate of a
site's noised sum is clipped to ``[-clipping_range, clipping_range]`` and quantized to ``quantization_range`` levels
(the server's sum carries a rounding error of at most m·clipping_range/quantization_range per coordinate). Pick
``clipping_range`` well above a site's noised coordinates (default 6·z·C, six times the *total* noise std).

Trust model (docs/federated.md): the sites are honest and each adds the share it declares; the server is
honest-but-curious; SecAgg+ reveals a sum only when at least ``reconstruction_threshold`` of a site's neighbours
survive, which is why `FederatedServer`'s ``min_shares`` is that threshold.
"""

from __future__ import annotations

import math
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

from lightning_dp.errors import PrivacyConfigError
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
        clipping_range: every coordinate of a site's noised sum is clipped to ±this before quantization (post-
            processing at the site). ``None``: 6·z·C of the server's planned noise.
        quantization_range: the levels of the quantization (Flower's default 2²²).
        timeout: seconds each of the protocol's four stages waits for the sites.
    """

    def __init__(
        self, clipping_range: float | None = None, quantization_range: int = 4_194_304, timeout: float | None = None
    ) -> None:
        self.clipping_range = clipping_range
        self.quantization_range = quantization_range
        self.timeout = timeout

    def __call__(self, grid: Grid, server: FederatedServer, nodes: list[int], request: int) -> RoundOutcome:
        """Runs the protocol for ``request`` and releases the sum it reveals (nothing, if it halts)."""
        if server.noise_at != "sites" or server.sites is None:
            raise PrivacyConfigError(
                "SecureSum: secure aggregation carries the sites' noise shares. "
                "HINT: FederatedServer(noise_at='sites')."
            )
        planned = server.share_std(server.steps) * math.sqrt(server.sites)  # z·C
        workflow = SecAggPlusWorkflow(
            num_shares=1.0,  # every site shares its keys with every other
            reconstruction_threshold=server.min_shares / server.sites,
            max_weight=1.0,  # each site weighs 1: no down-scaling before the quantization
            clipping_range=self.clipping_range or 6.0 * planned,
            quantization_range=self.quantization_range,
            timeout=self.timeout,
        )
        run_id = int(getattr(getattr(grid, "run", None), "run_id", 0) or 0)
        clients = SimpleClientManager()
        for node in nodes:
            clients.register(GridClientProxy(node, grid, run_id))
        strategy = _OneRound({"request": request, "number": server.steps, "noise_at": "sites"})
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
        if not strategy.results:  # the protocol halted (too few sites): no sum was revealed
            return RoundOutcome(None, {"secure aggregation": "halted: too few sites finished the protocol"})
        mean = parameters_to_ndarrays(strategy.results[0][1].parameters)[0]
        total = torch.from_numpy(np.asarray(mean, dtype=np.float32) * len(strategy.results))
        shares = [float(fitres.metrics.get("noise_std", 0.0)) for _, fitres in strategy.results]
        return server.secure_round(total, shares)
