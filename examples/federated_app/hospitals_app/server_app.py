"""The consortium's server (the ``ServerApp``): θ out, clipped sums in, noise once, one patient-level ledger."""

from __future__ import annotations

from flwr.app import Context

from hospitals_app.task import build_model
from lightning_dp.federated import FederatedServer
from lightning_dp.federated.flower import server_app


def make_server(context: Context) -> FederatedServer:
    config = context.run_config
    site_clip = float(config.get("site-clip", 0.0))  # type: ignore[arg-type]
    min_shares = int(config.get("min-shares", 0))  # type: ignore[arg-type]
    return FederatedServer(
        build_model(config),
        num_patients=int(config["num-patients"]),  # type: ignore[arg-type]
        sample_rate=float(config["sample-rate"]),  # type: ignore[arg-type]
        clip_norm=float(config["clip-norm"]),  # type: ignore[arg-type]
        target_epsilon=float(config["target-epsilon"]),  # type: ignore[arg-type]
        rounds=int(config["rounds"]),  # type: ignore[arg-type]
        site_clip=site_clip if site_clip > 0 else None,
        noise_at="sites" if config.get("noise-at") == "sites" else "server",
        sites=int(config["sites"]),  # type: ignore[arg-type]
        min_shares=min_shares if min_shares > 0 else None,
    )


app = server_app(make_server)
