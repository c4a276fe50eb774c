"""The hospital's side (one ``flower-supernode`` per hospital): its patients never leave; the clipped sum does."""

from __future__ import annotations

from typing import Any

from flwr.app import Context

from hospitals_app.task import build_datamodule, build_model, dummy_batch, read_id_key
from lightning_dp.federated import Site, calibrated_multiplier, share_std
from lightning_dp.federated.flower import site_app
from lightning_dp.training.patient_rounds import LocalSGD


def noise_share(config: Any) -> float:
    """With the noise at the sites, this site's share z·C/√m, computed from the consortium's public settings."""
    if str(config.get("noise-at", "server")) != "sites":
        return 0.0
    min_shares = int(config.get("min-shares", 0))
    z = calibrated_multiplier(
        int(config["num-patients"]),
        float(config["sample-rate"]),
        int(config["rounds"]),
        float(config["target-epsilon"]),
        sites=int(config["sites"]),
        min_shares=min_shares if min_shares > 0 else None,
    )
    return share_std(z, float(config["clip-norm"]), int(config["sites"]))


def make_site(context: Context) -> Site:
    config = context.run_config
    node = context.node_config
    declared = node.get("declared-patients", node.get("patients"))  # this site's share of N, compared locally only
    return Site.from_lightning(
        str(context.node_config["site"]),
        build_model(config),
        build_datamodule(context),
        sample_rate=float(config["sample-rate"]),  # type: ignore[arg-type]
        clip_norm=float(config["clip-norm"]),  # type: ignore[arg-type]
        local=LocalSGD(
            lr=float(config["local-lr"]),  # type: ignore[arg-type]
            batch_size=int(config["local-batch-size"]),  # type: ignore[arg-type]
            max_images=int(config.get("local-max-images", 64)),  # type: ignore[arg-type]
        ),
        noise_std=noise_share(config),
        declared_patients=None if declared is None else int(declared),  # type: ignore[arg-type]
    )


# The site checks its model on zeros of the declared input before it answers the server (dummy_batch), and sends
# salted HMAC digests of its patients' ids under the key in its own `id-key-file` (read_id_key). A hospital that must
# never show the server its sum starts its SuperNode with --node-config '... require-secure-aggregation=true': it
# then answers only SecAgg+ rounds.
app = site_app(
    make_site,
    id_key=read_id_key,
    require_secure_aggregation=lambda context: bool(context.node_config.get("require-secure-aggregation")),
    dummy_batch=dummy_batch,
)
