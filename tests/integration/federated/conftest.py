"""The Flower app under flower_app/ is run by `flwr run`, not collected."""

collect_ignore = ["flower_app"]
