"""The test consortium: sites of 4, 3 and 5 tiny patients; a site whose node config names ``fail-round`` errs then."""

from __future__ import annotations

import torch
from flwr.app import Context
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_dp.federated import FederatedServer, Site
from lightning_dp.federated.flower import server_app, site_app
from lightning_dp.sanitization import ModelState
from lightning_dp.training.patient_rounds import LocalSGD, PatientData, RoundParts

CLIP = 0.5


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


def make_site(context: Context) -> Site:
    name = str(context.node_config["site"])
    count = int(context.node_config["patients"])  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    x = torch.randn(3 * count, 6, generator=g)
    data = PatientData(
        TensorDataset(x, (x[:, 0] > 0).long()),
        [[3 * k, 3 * k + 1, 3 * k + 2] for k in range(count)],
        [f"{name}-{k}" for k in range(count)],
    )
    net = Net()
    site = Site(
        name,
        RoundParts(net, ModelState(net), net.training_step, data, LocalSGD(lr=0.2, batch_size=8), CLIP),
        sample_rate=float(context.run_config["sample-rate"]),
    )  # type: ignore[arg-type]
    fail = context.node_config.get("fail-round")
    if fail is not None:
        reply = site.reply

        def failing(theta: Tensor, round_number: int, bound: float | None = None) -> Tensor:
            if round_number == int(fail):  # type: ignore[arg-type]
                raise RuntimeError("the site's disk is full")
            return reply(theta, round_number, bound)

        site.reply = failing  # type: ignore[method-assign]
    return site


def make_server(context: Context) -> FederatedServer:
    config = context.run_config
    return FederatedServer(
        Net(),
        num_patients=int(config["num-patients"]),  # type: ignore[arg-type]
        sample_rate=float(config["sample-rate"]),
        clip_norm=CLIP,  # type: ignore[arg-type]
        noise=float(config["noise"]),
        seed=3,
    )  # type: ignore[arg-type]


client = site_app(make_site)
server = server_app(make_server)
