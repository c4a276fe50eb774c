"""Federated P3SGD on Flower: a ``ClientApp`` per hospital, a ``ServerApp`` for the consortium, one patient ledger.

The messages carry only what the mechanism allows to leave a site:

* ``query`` (once, at start): the site's public name, C and sample rate, and, where the consortium shares an id key,
  HMAC digests of its patient ids (to refuse ids two sites share, without the server seeing or testing them). Not its
  patient count: that is private (one patient changes it); the server's N is declared by the consortium.
* ``train`` (each round): θ_t, the round number and the public bound N·C in; the clipped sum out (``reply``,
  projected onto the ball of radius N·C), with the site's name and the std of the noise share it added (public
  settings); no counts, losses or metrics.

The server side is `run_rounds`, a plain function over a Flower ``Grid``: the ``ServerApp`` of `server_app` calls it
on the deployment runtime's grid (``flwr run`` against ``flower-superlink`` and one ``flower-supernode`` per
hospital), `LocalGrid` runs the same messages through the same ``ClientApp`` in one process (tests, benchmarks).
"""

from __future__ import annotations

import contextvars
import copy
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.task_identity import TaskIdentity

from lightning_dp.errors import PrivacyConfigError, PrivacyStateError
from lightning_dp.federated.server import FederatedServer, RoundOutcome
from lightning_dp.federated.site import DUMMY_BATCH_FAILED, Site, SiteStartError

if TYPE_CHECKING:
    from lightning_dp.federated.secure import SecureSum

__all__ = [
    "SiteFailure",
    "FederatedRoundError",
    "FederatedStartError",
    "LocalGrid",
    "RoundLog",
    "end_line",
    "round_line",
    "run_rounds",
    "save_model",
    "server_app",
    "site_app",
]

_log = logging.getLogger(__name__)

HELLO = "query"
TRAIN = "train"


class FederatedStartError(PrivacyConfigError):
    """The consortium cannot start: a site is missing, failed at start, or the sites disagree with the server."""


class FederatedRoundError(RuntimeError):
    """Rounds cannot go on: with the noise at the sites, too few shares arrived ``max_empty_rounds`` times in a row."""


# ---------------------------------------------------------------------------------------------------- the site side
class SiteFailure(RuntimeError):
    """What a site tells the server when it cannot answer: a fixed text, never the error (it may quote patient data)."""


def _sealed(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    """The handler, with any error logged at the site and replaced by `SiteFailure` (Flower forwards its text)."""

    def run(message: Message, context: Context) -> Message:
        try:
            return handler(message, context)
        except Exception:  # noqa: BLE001 - the error's text stays in the site's log
            _log.exception("the site could not answer the server's %r message", message.metadata.message_type)
            raise SiteFailure("the site could not answer (its own log says why)") from None

    return run


_IN_SECURE_AGGREGATION: contextvars.ContextVar[bool] = contextvars.ContextVar("in_secure_aggregation", default=False)


def _secure_aggregation_when_asked(message: Message, context: Context, call_next: Any) -> Message:
    """Flower's ``secaggplus_mod`` on the rounds the server runs through SecAgg+ (`SecureSum`), not on plain ones."""
    if message.metadata.message_type == TRAIN and RECORD_KEY_CONFIGS in message.content.config_records:
        token = _IN_SECURE_AGGREGATION.set(True)
        try:
            return secaggplus_mod(message, context, call_next)
        finally:
            _IN_SECURE_AGGREGATION.reset(token)
    return call_next(message, context)


def _secure_reply(site: Site, message: Message) -> Message:
    """The site's noised clipped sum in the format SecAgg+ masks (one weight per site: the protocol's mean × m').

    Answered only inside the protocol's masking stage (never in the clear), with a share at least the server's plan,
    and only if the protocol's coordinate clipping leaves the site's noised sum whole (see `lightning_dp.federated.
    secure`).
    """
    if not _IN_SECURE_AGGREGATION.get():
        raise PrivacyConfigError(f"Site {site.name!r}: a fit message outside SecAgg+ would carry the sum in the clear.")
    fitins = compat.recorddict_to_fitins(message.content, keep_input=True)
    planned = float(fitins.config["planned_share"])
    bound = fitins.config.get("reply_bound")
    if site.noise_std < planned * (1 - 1e-9):
        raise PrivacyConfigError(
            f"Site {site.name!r}: its noise share {site.noise_std:.6g} is below the server's plan {planned:.6g}. "
            "HINT: compute it with the consortium's settings (calibrated_multiplier with sites and min_shares)."
        )
    theta = torch.from_numpy(np.array(parameters_to_ndarrays(fitins.parameters)[0], copy=True))
    noised = site.reply(theta, int(fitins.config["request"]), None if bound is None else float(bound))
    if float(noised.abs().max()) > float(fitins.config["clipping_range"]):
        raise PrivacyConfigError(f"Site {site.name!r}: SecAgg+'s coordinate clipping would remove this site's noise.")
    fitres = FitRes(
        Status(Code.OK, ""),
        ndarrays_to_parameters([noised.detach().cpu().numpy()]),
        num_examples=1,
        metrics={"noise_std": site.noise_std},
    )
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=message)


def _node_site_name(context: Context) -> str | None:
    """The hospital's public name in its node config (``site``), if it has one."""
    name = context.node_config.get("site")
    return None if name is None else str(name)


#: What a site that cannot build tells the server (a fixed text: the error may quote its data).
BUILD_FAILED = "it could not build its site from its data and settings (its own log says why)"


def site_app(
    make_site: Callable[[Context], Site],
    id_key: Callable[[Context], bytes | None] | None = None,
    require_secure_aggregation: Callable[[Context], bool] | bool = False,
    dummy_batch: Callable[[Context], Any] | None = None,
    name_of: Callable[[Context], str | None] = _node_site_name,
) -> ClientApp:
    """A Flower ``ClientApp`` for one hospital: it builds its `Site` with ``make_site(context)`` and answers rounds.

    Args:
        make_site: builds the site from Flower's ``Context`` (``context.node_config`` names the hospital's data on
            that machine; ``context.run_config`` holds the consortium's public settings). Built once per process
            and run (Flower starts a fresh process per message by default; the site's coins depend only on its
            secret and the request, `Site.patients_of_round`).
        id_key: the consortium's id key for the start-up collision check (`Site.id_digests`), or ``None``. Read it
            from the site's own settings (``context.node_config`` or a file), never from ``context.run_config``.
        require_secure_aggregation: the site answers rounds only through SecAgg+ (a plain round is refused): the
            site's own guarantee that the server never sees its sum, whatever the run config says. A bool, or read
            from the context (e.g. ``lambda c: bool(c.node_config.get("require-secure-aggregation", False))``).
        dummy_batch: a batch of the consortium's declared input format built from public settings alone (e.g.
            zeros of the declared image shape: ``context.run_config``), never from the site's data. When the site is
            built, its model's ``training_step`` runs forward and backward on it (`Site.check_training_step`); a
            model that cannot take it fails the site's start-up, so a run in which every patient's update would fail
            is refused before the first round instead of training nothing. ``None``: no check.
        name_of: the hospital's public name from the context, to name it in a failed start (default: the node
            config's ``site``); it must be the name `make_site` gives the site.

    A site that cannot start (``make_site`` raised, or the dummy batch failed) answers the server's start-up query
    with its name and a fixed text (`BUILD_FAILED`, `lightning_dp.federated.site.DUMMY_BATCH_FAILED`); the real error
    goes to the site's own log. The server then refuses the consortium, naming that hospital.

    Returns:
        The ``ClientApp``. Its ``train`` handler replies with the clipped sum (and the site's public name and noise
        share) alone, or, in a round the server runs through SecAgg+ (`lightning_dp.federated.secure.SecureSum`),
        with the masked noised sum; an error anywhere replies with the fixed `SiteFailure` text, the error stays in
        the site's log.
    """
    app = ClientApp(mods=[_secure_aggregation_when_asked])
    built: dict[tuple[int, int], Site] = {}

    def site_of(context: Context) -> Site:
        key = (int(context.run_id), int(context.node_id))
        if key not in built:
            site = make_site(context)
            if dummy_batch is not None:
                site.check_training_step(dummy_batch(context))
            built[key] = site
        return built[key]

    @app.query()
    @_sealed
    def hello(message: Message, context: Context) -> Message:
        try:
            site = site_of(context)
            facts = ConfigRecord(
                {
                    "name": site.name,
                    "sample_rate": site.sample_rate,
                    "clip_norm": site.parts.clip_norm,
                }
            )
            key = None if id_key is None else id_key(context)
            if key is not None:
                facts["id_digests"] = site.id_digests(key, salt=str(context.run_id))
        except Exception as err:  # noqa: BLE001 - the error's text stays in the site's log
            _log.exception("the site could not start")
            name = name_of(context)
            facts = ConfigRecord({"failed": _start_failure(err)})
            if name is not None:
                facts["name"] = name
        return Message(RecordDict({"site": facts}), reply_to=message)

    @app.train()
    @_sealed
    def train(message: Message, context: Context) -> Message:
        site = site_of(context)
        if "theta" not in message.content.array_records:  # a SecAgg+ round: Flower's legacy fit format
            return _secure_reply(site, message)
        required = require_secure_aggregation
        if required(context) if callable(required) else required:
            raise PrivacyConfigError(
                f"Site {site.name!r} answers only through secure aggregation; this round is plain."
            )
        if str(_field(message, "round", "noise_at")) == "sites" and site.noise_std <= 0:
            raise PrivacyConfigError(
                f"Site {site.name!r}: the server expects noise at the sites and this site has no share "
                "(noise_std=0); it would send its un-noised sum. HINT: set the site's noise_std (share_std)."
            )
        theta = torch.from_numpy(_field(message, "theta", "theta").numpy().copy())
        bound = _optional_field(message, "round", "reply_bound")
        clipped_sum = site.reply(
            theta, int(_field(message, "round", "request")), None if bound is None else float(bound)
        )
        content = RecordDict(
            {
                "clipped_sum": ArrayRecord({"clipped_sum": Array(clipped_sum.detach().cpu().numpy())}),
                "site": ConfigRecord({"name": site.name, "noise_std": site.noise_std}),
            }
        )
        return Message(content, reply_to=message)

    return app


def _start_failure(err: Exception) -> str:
    """The fixed text a site that cannot start sends (never the error's own text, which may quote patient data)."""
    if isinstance(err, SiteStartError):
        return DUMMY_BATCH_FAILED
    return BUILD_FAILED


# -------------------------------------------------------------------------------------------------- the server side
@dataclass
class RoundLog:
    """What the server did in a round (public: no site's count or loss): ε after it, refusals and dropouts."""

    round: int
    epsilon: float
    noise_std: float
    sites_replied: int
    refused: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def _wait_for_sites(grid: Grid, sites: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    nodes = sorted(grid.get_node_ids())
    while len(nodes) < sites and time.monotonic() < deadline:
        time.sleep(0.2)
        nodes = sorted(grid.get_node_ids())
    if len(nodes) < sites:
        raise FederatedStartError(
            f"only {len(nodes)} of the {sites} expected sites connected within {timeout:g} s. HINT: start one "
            "flower-supernode per hospital against this SuperLink, or lower the expected number of sites."
        )
    return nodes


def _replies_by_node(messages: list[Message], replies: Iterable[Message]) -> dict[int, Message]:
    """The replies by the node each message went to.

    Matched by the message each one answers: Flower's own replies for a message it could not deliver (a node that
    stopped sending heartbeats, a message that expired) come from the SuperLink, not from the node.
    """
    node_of = {message.metadata.message_id: message.metadata.dst_node_id for message in messages}
    by_node: dict[int, Message] = {}
    for reply in replies:
        node = node_of.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
        by_node[node] = reply
    return by_node


def _why_no_answer(reply: Message | None, timeout: float) -> str:
    """Why a site's answer is missing, in words: Flower's own reason where it gave one, else the deadline."""
    if reply is None:
        return f"no reply (within the {timeout:g} s deadline)"
    code = reply.error.code
    if code == ErrorCode.NODE_UNAVAILABLE:
        return "no reply (Flower: the node stopped sending heartbeats; it is down or cut off)"
    if code in (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE):
        return "no reply (Flower: the message or its reply expired, or the node left the federation)"
    if code == ErrorCode.CLIENT_APP_CRASHED:
        return "failed (Flower: the site's ClientApp process crashed; its own log says why)"
    return f"failed ({reply.error.reason})"


def _hello(
    grid: Grid, nodes: list[int], server: FederatedServer, timeout: float, require_id_digests: bool = False
) -> dict[int, str]:
    """Asks every site for its public facts and refuses a consortium the server cannot run (see `run_rounds`).

    Returns the sites' names by node. No site's patient count is asked for: it is private, and N is the consortium's
    declaration (the server's ``num_patients``), never checked against the data.
    """
    messages = [Message(RecordDict(), dst_node_id=node, message_type=HELLO) for node in nodes]
    replies = _replies_by_node(messages, grid.send_and_receive(messages, timeout=timeout))
    names: dict[int, str] = {}
    digests: dict[str, list[str]] = {}
    for node in nodes:
        reply = replies.get(node)
        if reply is None or reply.has_error():
            why = _why_no_answer(reply, timeout)
            raise FederatedStartError(
                f"a site (Flower node {node}) did not start: {why}. HINT: check that hospital's SuperNode and its log."
            )
        facts: Any = reply.content["site"]
        if "failed" in facts:
            who = f"site {str(facts['name'])!r}" if "name" in facts else f"a site (Flower node {node})"
            raise FederatedStartError(
                f"{who} failed at start: {facts['failed']}. HINT: its operator reads the real error in its own log."
            )
        name = str(facts["name"])
        if name in names.values():
            raise FederatedStartError(f"two sites are named {name!r}. HINT: give each hospital its own name.")
        clip = float(facts.get("clip_norm", float("nan")))
        if clip != server.clip_norm:
            raise FederatedStartError(
                f"site {name!r} clips each patient's update to C = {clip:g}, the server's ledger assumes C = "
                f"{server.clip_norm:g}. HINT: give every site the consortium's clip norm."
            )
        rate = float(facts.get("sample_rate", float("nan")))
        if rate != server.sample_rate:
            raise FederatedStartError(
                f"site {name!r} samples its patients at q = {rate:g}, the server's ledger at q = "
                f"{server.sample_rate:g}; the ledger would not describe the run. HINT: give every site the "
                "consortium's sample rate."
            )
        names[node] = name
        if "id_digests" in facts:
            digests[name] = list(facts["id_digests"])
    if require_id_digests and len(digests) != len(names):
        missing = sorted(set(names.values()) - set(digests))
        raise FederatedStartError(
            f"the consortium checks patient ids at start, and site(s) {missing} sent no id digests. HINT: give every "
            "hospital the consortium's id key file (its node config's id key setting), never the run config."
        )
    if digests:
        if len(digests) != len(names):
            raise FederatedStartError(
                "some sites sent patient-id digests and some did not. HINT: give every site the consortium's id key."
            )
        seen: set[str] = set()
        shared = 0
        for values in digests.values():
            shared += len(seen.intersection(values))
            seen.update(values)
        if shared:
            raise FederatedStartError(
                "patient ids appear at more than one site (neither the ids nor their number are shown); one "
                "patient's images would be two units and the patient-level ε would not hold. HINT: link the records so "
                "that each patient belongs to exactly one site, or rename ids that are different patients."
            )
    return names


def _field(message: Message, record: str, key: str) -> Any:
    """``message.content[record][key]`` (Flower's records are typed as a union of every value kind)."""
    content: Any = message.content
    return content[record][key]


def _optional_field(message: Message, record: str, key: str) -> Any:
    """``message.content[record][key]``, or None if the message has no such field."""
    try:
        return _field(message, record, key)
    except KeyError:
        return None


def _declared_share(reply: Message) -> float | None:
    """The std of the noise share the site says it added (a public setting), or None."""
    try:
        return float(_field(reply, "site", "noise_std"))
    except (KeyError, TypeError, ValueError):
        return None


def _array(reply: Message) -> torch.Tensor | None:
    """The reply's clipped sum as a tensor, or None if the reply carries none."""
    try:
        array = _field(reply, "clipped_sum", "clipped_sum").numpy()
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return torch.from_numpy(np.array(array, copy=True))


def _save(server: FederatedServer, path: Path) -> None:
    """Writes the server's state atomically: a crash leaves the previous checkpoint whole."""
    _write_atomically(server.state_dict(), path)


def _write_atomically(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(path.name + ".tmp")
    torch.save(obj, scratch)
    os.replace(scratch, path)


def save_model(server: FederatedServer, path: str | Path) -> Path:
    """Writes the server's model, θ included, as a ``state_dict`` (``torch.save``): what the consortium trained.

    The file loads into the model every party builds (``model.load_state_dict(torch.load(path, weights_only=True))``);
    θ is the released model (post-processing of the noised rounds, no further charge), and every other tensor (frozen
    parameters, buffers that are not released) is the server's own copy of the public initial model. Written
    atomically. Returns the path.
    """
    target = Path(path)
    state = {name: tensor.detach().cpu().clone() for name, tensor in server.state.module.state_dict().items()}
    _write_atomically(state, target)
    return target


def run_rounds(
    grid: Grid,
    server: FederatedServer,
    rounds: int,
    *,
    sites: int,
    round_timeout: float = 600.0,
    start_timeout: float = 60.0,
    checkpoint: str | Path | None = None,
    resume: bool = False,
    on_round: Callable[[RoundLog], None] | None = None,
    max_empty_rounds: int = 3,
    secure: SecureSum | None = None,
    require_id_digests: bool = False,
) -> list[RoundLog]:
    """The server's loop: start-up checks, then rounds until ``rounds`` are released (or the budget stops it).

    Start-up refuses, with one line naming the site (never a patient id): fewer than ``sites`` sites connected; a site
    that fails to build (no patients, bad data) or whose model fails on the declared input (`site_app`'s
    ``dummy_batch``); two sites with one name; a site's C or q unlike the ledger's; patient ids shared between sites
    (when the sites send digests; with ``require_id_digests``, a site that sends none is refused too, so that a
    hospital without the consortium's id key cannot switch the check off). It never asks for the sites' patient
    counts: N is the consortium's declaration (``server.num_patients``), fixed before the data are counted, and the
    normalizer q·N and the bound N·C on a reply are the same whatever the sites hold.

    Each round is a new request (`FederatedServer.new_request`: the sites' coins are keyed by it) that sends θ_t to
    every site, waits at most ``round_timeout`` s, and releases once (`FederatedServer.round`): a site that errs,
    times out, sends a malformed sum or (noise at the server) a sum heavier than N·C contributes nothing and the round
    is charged as usual (a site that clips its patients never sends one: it projects its sum onto that ball). The
    loop stops before a round the budget would not allow.

    With ``checkpoint``, the server's state (θ, ledger, counters; not the noise generator) is written atomically
    when a request goes out and after its replies are in. ``resume=True`` continues from it (an error if it is
    missing: a missing privacy state is never a fresh start); ``resume=False`` refuses to overwrite one that exists.

    With ``secure`` (a `lightning_dp.federated.secure.SecureSum`; noise at the sites, each site's ``ClientApp`` from
    `site_app` with a `Site` whose ``noise_std`` is its share), each round's sum is formed by Flower's SecAgg+ and the
    server sees nothing else.

    Returns:
        One `RoundLog` per round released in this call.
    """
    path = None if checkpoint is None else Path(checkpoint)
    if path is None and resume:
        raise PrivacyStateError(
            "run_rounds: resume=True without a checkpoint: there is no ledger to continue. HINT: pass the run's "
            "checkpoint path."
        )
    if path is not None and resume:
        if not path.exists():
            raise PrivacyStateError(
                f"run_rounds: resume=True but there is no checkpoint at {path}: the ledger of the run would be lost. "
                "HINT: point checkpoint at the run's file, or start a new run with resume=False."
            )
        server.load_state_dict(torch.load(path, weights_only=False))
    elif path is not None and path.exists():
        raise PrivacyStateError(
            f"run_rounds: a checkpoint exists at {path} and resume=False: starting afresh would drop its ledger. "
            "HINT: resume=True to continue that run, or choose another path for a new one."
        )
    nodes = _wait_for_sites(grid, sites, start_timeout)
    names = _hello(grid, nodes, server, start_timeout, require_id_digests)
    bounds = {name: server.reply_bound for name in names.values()}  # public: the same N·C for every site
    logs: list[RoundLog] = []
    empty = 0
    while server.steps < rounds and server.allows_next_round():
        started = time.monotonic()
        number = server.steps
        request = server.new_request()
        if path is not None:
            _save(server, path)  # the request is on record before any site answers it
        replies: dict[str, torch.Tensor | None] = {}
        problems: dict[str, str] = {}
        if secure is not None:
            outcome = secure(grid, server, {node: bounds[name] for node, name in names.items()}, request)
        else:
            outcome, replies, problems = _plain_round(grid, server, names, bounds, number, request, round_timeout)
        if path is not None:
            _save(server, path)
        if outcome.result is None:  # noise at the sites, fewer than min_shares arrived: nothing released or charged
            empty += 1
            if empty >= max_empty_rounds:
                raise FederatedRoundError(
                    f"too few noise shares arrived in {empty} attempts at round {number + 1}; nothing was released or "
                    f"charged ({'; '.join(f'{k}: {v}' for k, v in {**problems, **outcome.refused}.items())}). "
                    "HINT: check the sites' logs, then restart the server with resume=True."
                )
            continue
        empty = 0
        sites_replied = secure.summed if secure is not None else len(replies) - len(outcome.refused)
        log = RoundLog(
            round=number + 1,
            epsilon=server.epsilon(),
            noise_std=outcome.result.released.noise_std,
            sites_replied=sites_replied,
            refused={**problems, **outcome.refused},
            seconds=time.monotonic() - started,
        )
        logs.append(log)
        if on_round is not None:
            on_round(log)
    return logs


def _plain_round(
    grid: Grid,
    server: FederatedServer,
    names: dict[int, str],
    bounds: dict[str, float],
    number: int,
    request: int,
    round_timeout: float,
) -> tuple[RoundOutcome, dict[str, torch.Tensor | None], dict[str, str]]:
    """θ_t to every site, their sums back, one release (`FederatedServer.round`)."""
    theta = server.theta().detach().cpu().numpy()
    content: dict[str, Any] = {
        "theta": ArrayRecord({"theta": Array(theta)}),
        "round": ConfigRecord(
            {"number": number, "request": request, "noise_at": server.noise_at, "reply_bound": server.reply_bound}
        ),
    }
    messages = [
        Message(RecordDict(content), dst_node_id=node, message_type=TRAIN, group_id=str(request)) for node in names
    ]
    by_node = _replies_by_node(messages, grid.send_and_receive(messages, timeout=round_timeout))
    replies: dict[str, torch.Tensor | None] = {}
    shares: dict[str, float] = {}
    problems: dict[str, str] = {}
    for node, name in names.items():
        reply = by_node.get(node)
        if reply is None or reply.has_error():
            problems[name] = _why_no_answer(reply, round_timeout)
        else:
            replies[name] = _array(reply)
            declared = _declared_share(reply)
            if declared is not None:
                shares[name] = declared
    outcome: RoundOutcome = server.round(replies, shares, bounds)
    return outcome, replies, problems


def server_app(
    make_server: Callable[[Context], FederatedServer],
    *,
    report: Callable[[Context], str | Path | None] | None = None,
) -> ServerApp:
    """A Flower ``ServerApp`` that runs `run_rounds` with settings from the run config.

    Run-config keys (``[tool.flwr.app.config]`` in the app's pyproject, or ``flwr run … --run-config``):
    ``rounds`` (int), ``sites`` (expected number of hospitals), ``round-timeout`` and ``start-timeout`` (seconds),
    ``checkpoint`` (a path; empty: none), ``resume`` (true: continue from ``checkpoint``; it must exist),
    ``log-dir`` (TensorBoard; empty: none), ``report`` (the privacy report's path; empty: none),
    ``model`` (the trained model's ``state_dict``, written by `save_model` at the end; empty or absent: none),
    ``secure-aggregation`` (true: every round's sum by SecAgg+, with the noise at the sites),
    ``check-patient-ids`` (true: every site must send its patients' id digests at start, `run_rounds`'
    ``require_id_digests``). Relative paths resolve against the working folder of the ``ServerApp``'s process: the
    folder ``flower-superlink`` was started in.

    Each round prints one line: ε (patient level, and hospital level with a site clip), the noise std per coordinate
    of the released update (z·C/(q·N), public), the number of sites summed and why any other site was not; the run
    ends with `end_line` (rounds released, why it stopped, the final ε), also when a resumed run has nothing to run.

    Args:
        make_server: builds the `FederatedServer` (model, N, q, C, noise or target ε) from the ``Context``.
        report: where to write the privacy report (JSON) at the end; ``None``: run config ``report``, if set.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        config = context.run_config
        server = make_server(context)
        writer = _tensorboard(str(config.get("log-dir", "")))

        def on_round(log: RoundLog) -> None:
            print(round_line(log, server), flush=True)
            if writer is not None:
                writer.add_scalar("privacy/epsilon", log.epsilon, log.round)
                writer.add_scalar("privacy/noise_std", log.noise_std, log.round)
                writer.add_scalar("federated/sites_replied", log.sites_replied, log.round)
                if server.site_clip is not None:
                    # Two relations (docs/federated.md): all of one hospital's patients removed, or its data replaced.
                    writer.add_scalar("privacy/hospital_epsilon", server.hospital_epsilon(), log.round)
                    writer.add_scalar(
                        "privacy/hospital_epsilon_replace_one", server.hospital_epsilon(replace_one=True), log.round
                    )

        rounds = int(config["rounds"])
        logs = run_rounds(
            grid,
            server,
            rounds,
            sites=int(config["sites"]),
            round_timeout=float(config.get("round-timeout", 600.0)),
            start_timeout=float(config.get("start-timeout", 60.0)),
            checkpoint=str(config.get("checkpoint", "")) or None,
            resume=bool(config.get("resume", False)),
            on_round=on_round,
            secure=_secure_sum(config),
            require_id_digests=bool(config.get("check-patient-ids", False)),
        )
        print(end_line(server, rounds, len(logs)), flush=True)
        if writer is not None:
            writer.close()
        target = report(context) if report is not None else (str(config.get("report", "")) or None)
        if target is not None:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            Path(target).write_text(json.dumps(server.report(), indent=2))
        model = str(config.get("model", ""))
        if model:
            save_model(server, model)

    return app


def round_line(log: RoundLog, server: FederatedServer) -> str:
    """The console's line for a round: public numbers only (ε, the noise std, which sites were summed and why not).

    Example:
        >>> from torch import nn
        >>> server = FederatedServer(nn.Linear(2, 2), num_patients=100, sample_rate=0.1, clip_norm=1.0)
        >>> log = RoundLog(round=1, epsilon=0.5, noise_std=0.1, sites_replied=2, refused={"c": "no reply"})
        >>> round_line(log, server)
        'round 1: ε = 0.5000 (patient, δ = 1e-05), noise std 0.1 per coordinate, 2 sites replied; c: no reply'
    """
    hospital = (
        f", hospital ε = {server.hospital_epsilon():.4f} (removed; {server.hospital_epsilon(replace_one=True):.4f} "
        "replaced)"
        if server.site_clip is not None
        else ""
    )
    return (
        f"round {log.round}: ε = {log.epsilon:.4f} (patient, δ = {server.ledger.delta:.2g}){hospital}, "
        f"noise std {log.noise_std:.4g} per coordinate, {log.sites_replied} sites replied"
        + "".join(f"; {name}: {why}" for name, why in log.refused.items())
    )


def end_line(server: FederatedServer, rounds: int, released: int) -> str:
    """The console's last line: how many rounds are released, why the run stopped, the final ε (public numbers only).

    A resumed run whose budget is spent, or whose rounds were all released, runs no round: this line says so.

    Example:
        >>> from torch import nn
        >>> server = FederatedServer(nn.Linear(2, 2), num_patients=100, sample_rate=0.1, clip_norm=1.0, noise=1.0)
        >>> end_line(server, rounds=0, released=0)
        'done: 0 of 0 rounds released (0 in this run), ε = 0.0000 (patient, δ = 1e-05).'
    """
    head = f"{server.steps} of {rounds} rounds released ({released} in this run), ε = {server.epsilon():.4f} "
    head += f"(patient, δ = {server.ledger.delta:.2g})"
    if server.stop_reason:
        return f"stopped: {head}. {server.stop_reason} HINT: nothing more can be released under this budget."
    if released == 0 and rounds > 0:
        return f"done: {head}: nothing left to run. HINT: raise rounds in the run config to train further."
    return f"done: {head}."


def _secure_sum(config: Any) -> SecureSum | None:
    """SecAgg+ for every round if the run config asks for it (``secure-aggregation = true``)."""
    if not bool(config.get("secure-aggregation", False)):
        return None
    from lightning_dp.federated.secure import SecureSum

    return SecureSum(timeout=float(config.get("round-timeout", 600.0)))


def _tensorboard(log_dir: str) -> Any:
    if not log_dir:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir)


# ---------------------------------------------------------------------------------------------- one process, no Ray
class LocalGrid(Grid):
    """A Flower ``Grid`` that hands each message to a site's ``ClientApp`` in this process (no network, no Ray).

    The same messages as the deployment runtime, through the same ``ClientApp``: for tests, benchmarks and the
    single-machine comparison. ``node_configs`` gives each site's node config (its data); ``drop`` a function
    ``(node_id, message) -> bool`` that makes a site miss a message (a dropout or a timeout).

    Example:
        >>> grid = LocalGrid(ClientApp(), [{"site": "a"}, {"site": "b"}])
        >>> len(list(grid.get_node_ids()))
        2
    """

    _runs = 0

    def __init__(
        self,
        client_app: ClientApp,
        node_configs: Iterable[Mapping[str, Any]],
        run_config: Mapping[str, Any] | None = None,
        drop: Callable[[int, Message], bool] | None = None,
    ) -> None:
        self.client_app = client_app
        self.run_config = dict(run_config or {})
        LocalGrid._runs += 1  # a run id per grid, as Flower gives each `flwr run` its own (a ClientApp caches by it)
        self.run_id = LocalGrid._runs
        self.contexts = {
            node: Context(
                run_id=self.run_id,
                node_id=node,
                node_config=dict(config),
                state=RecordDict(),
                run_config=self.run_config,
            )
            for node, config in enumerate(node_configs, start=1)
        }
        self.drop = drop
        # Flower stamps each message with the sending task's identity; a ServerApp process has one, this process may
        # not (a test, a benchmark): it then sends as run 1's server (node 0, task 0).
        for name in ("run_id", "node_id", "task_id"):
            if getattr(TaskIdentity, f"_{name}") is None:
                setattr(TaskIdentity, name, 1 if name == "run_id" else 0)
        self._outbox: dict[str, Message] = {}
        self._count = 0

    def set_run(self, run: Any) -> None:
        """Nothing to set: one run per grid."""

    @property
    def run(self) -> Any:
        """No Flower run object in one process."""
        return None

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        """A message as the deployment grid builds one."""
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        """The sites' node ids (1, 2, …)."""
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Runs each message through its site's ``ClientApp`` now; an exception becomes an error reply."""
        ids = []
        for message in messages:
            self._count += 1
            message_id = f"local-{self._count}"
            message.metadata.__dict__["_message_id"] = message_id
            node = message.metadata.dst_node_id
            if self.drop is not None and self.drop(node, message):
                ids.append(message_id)
                continue
            try:  # a copy, as the network delivers one: a site must not change what the server (or another site) holds
                reply = self.client_app(copy.deepcopy(message), self.contexts[node])
            except Exception as err:  # noqa: BLE001 - a failing site is a dropout with a reason, as on Flower
                reply = Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=message)
            self._outbox[message_id] = reply
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to ``message_ids`` that exist (a dropped message has none)."""
        return [self._outbox.pop(i) for i in message_ids if i in self._outbox]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Pushes, then pulls: the sites answered synchronously, each within ``timeout`` s or not at all.

        As the deployment's grid, a reply that took a site longer than ``timeout`` seconds never arrives (the sites
        answer one after the other here, and each is timed alone, as if they ran side by side).
        """
        ids: list[str] = []
        for message in messages:
            started = time.monotonic()
            pushed = list(self.push_messages([message]))
            if timeout is not None and time.monotonic() - started > timeout:
                for late in pushed:
                    self._outbox.pop(late, None)
            ids += pushed
        return self.pull_messages(ids)
