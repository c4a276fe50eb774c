"""`ObserverAudit`: neighbouring worlds replayed end to end with equal secrets, every channel diffed (§9).

For a pipeline (`FitPipeline`, `TunePipeline`, `FederatedPipeline`) and a set of adversarial units it runs, each in a
folder of its own and with every secret draw answered by one `SecretTape`:

1. **D twice** (same tape): every channel and every release must be equal — a run that differs from itself under
   equal secrets draws randomness the tape does not hold (it cannot be replayed, and nothing says it is secret).
2. **D and D′ = D plus one unit** (same tape): every channel must be equal, the secret draws included (their
   purposes, in order); the releases must be as many, with equal normalizers and multipliers, and the first one
   (from the same public θ₀) may move by at most C: ‖r′ − r‖·n ≤ C·(1 + tolerance). Later releases start from
   different weights, so only their shape, normalizer and multiplier are compared.
3. **D with one secret purpose varied** (for each purpose the pipeline's guarantee rests on): the purpose must be
   drawn at all, the releases must change (the draw decides them; a draw from a public value — a seed, a step or
   round number, torch's global generator — leaves them as they were), and every other channel must stay equal (a
   channel that follows a secret but is not the release publishes that secret, as a search's trial count does).
   A pipeline's ``hidden`` purposes (a search's K) need not change the release, and the draws they lead to may
   differ: only the published channels are compared, over variations until ``HIDDEN_VARIATIONS`` of them changed
   what ran (their secret draws differ from D's: another K), at most ``HIDDEN_TRIES``.

Beside the channels, three rules of the release itself:

* **Sensitivity as charged.** Every release must be charged for the sensitivity the pipeline declares
  (``clip_norm``: C, or PATE's S = √d), the one the move is held to. A pipeline whose releases all read the same
  public state (``every_release``: PATE's queries, all answered by the same teachers) holds every release, not only
  the first, to it.
* **Contributors.** A pipeline whose sensitivity rests on how many contributors one unit can change (PATE: a patient
  is in one teacher's partition) declares ``max_changed_contributors`` and reports a digest per contributor: D twice
  and a varied secret must change none, D′ at most that many.
* **Each world's rules** (``Observation.rules``, e.g. every release charged by the ledger, a rerun that releases
  nothing): broken in any world, they are findings.

Units a pipeline cannot hold (``inapplicable``: unit → why) are reported with the reason, not run.

The verdict names each channel that differs and shows both values, shortened. ``derived`` values (weights and
optimizer state in checkpoints, validation metrics) are post-processing of the releases and are not compared.
A pipeline's ``declared_refusals`` (text of a refusal it declares, made before anything is released: a consortium's
shared-id check at start, public by agreement; PATE's teachers refusing an image the data holder must fix) are
reported as declared when a unit triggers them, and that world is not compared further: it released nothing but the
refusal. What it does not see: leaks at steps after the first through the release itself (the release's own
sensitivity at every step is `SensitivityAudit`'s; PATE's queries are all held to S), timing as such (durations are
stripped; a deadline that a unit trips shows as the sites summed), and parties in other processes (secrets are held in
this process).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from lightning_dp.audit.observer.channels import Observation
from lightning_dp.audit.observer.secrets import SecretTape

__all__ = ["Finding", "ObserverAudit", "ObserverResult", "Pipeline", "diff"]

#: fp round-off allowed over C for the first release (two equal noise vectors subtracted in fp32).
TOLERANCE = 0.02
#: How many variations of a hidden purpose that change what runs (K differs: other secret draws) are compared with D,
#: and in at most how many tries (two geometric K of mean 2 are equal with probability 1/3).
HIDDEN_VARIATIONS, HIDDEN_TRIES = 2, 10
#: A varied secret must move some release by more than this, relative to its norm (fp32 round-off is ~1e-7).
CHANGED = 1e-5


class Pipeline(Protocol):
    name: str
    clip_norm: float
    purposes: tuple[str, ...]

    def run(self, unit: str | None, folder: Path) -> Observation: ...


@dataclass(frozen=True)
class Finding:
    """One difference an observer sees: the comparison, the channel, and both values (shortened)."""

    check: str
    channel: str
    left: str
    right: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.channel}: {self.left} ≠ {self.right}"


def _short(value: Any, width: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _first_difference(a: Any, b: Any) -> tuple[str, str]:
    if isinstance(a, list) and isinstance(b, list):
        for x, y in zip(a, b):
            if x != y:
                return _short(x), _short(y)
        n = min(len(a), len(b))  # one is the other plus entries: show the first one only one world has
        return (_short(a[n]) if len(a) > n else "<none>"), (_short(b[n]) if len(b) > n else "<none>")
    return _short(a), _short(b)


def diff(check: str, a: Observation, b: Observation, draws: tuple[list[str], list[str]] | None = None) -> list[Finding]:
    """Every channel of ``a`` and ``b`` that differs (the releases' shapes, normalizers and multipliers included)."""
    found = []
    for key in sorted(set(a.channels) | set(b.channels)):
        left, right = a.channels.get(key, "<absent>"), b.channels.get(key, "<absent>")
        if left != right:
            found.append(Finding(check, key, *_first_difference(left, right)))
    shape = [(r.step, tuple(r.vector.shape), r.normalizer, r.multiplier) for r in a.releases]
    other = [(r.step, tuple(r.vector.shape), r.normalizer, r.multiplier) for r in b.releases]
    if shape != other:
        found.append(Finding(check, "releases (step, shape, normalizer, multiplier)", *_first_difference(shape, other)))
    if draws is not None and draws[0] != draws[1]:
        found.append(Finding(check, "secret draws (purposes, in order)", *_first_difference(*draws)))
    return found


@dataclass
class ObserverResult:
    """The audit's verdict: every finding, the first release's move per unit (in units of C), what ran."""

    pipeline: str
    units: list[str]
    findings: list[Finding] = field(default_factory=list)
    #: Differences in what only the data holder sees (its console, the training checkpoint): reported, not failed.
    notes: list[Finding] = field(default_factory=list)
    #: Refusals the pipeline declares, before any release (a consortium's shared-id check, public by agreement; the
    #: data holder's own check of an image): reported, not failed.
    declared: list[Finding] = field(default_factory=list)
    moved: dict[str, float] = field(default_factory=dict)
    #: Which releases ``moved`` covers and in what unit: the first one in C, or (PATE) every one in S.
    scope: str = "first release"
    bound: str = "C"
    purposes_drawn: list[str] = field(default_factory=list)
    #: The contributors (PATE's teachers) each unit changed.
    changed: dict[str, list[str]] = field(default_factory=dict)
    #: Units asked for that the pipeline cannot hold, with the reason.
    inapplicable: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict[str, Any]:
        """The verdict as JSON-ready data (findings and notes as their four strings)."""
        return {
            "pipeline": self.pipeline,
            "units": self.units,
            "passed": self.passed,
            "moved": self.moved,
            "purposes_drawn": self.purposes_drawn,
            "changed": self.changed,
            "inapplicable": self.inapplicable,
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "notes": [dataclasses.asdict(f) for f in self.notes],
            "declared": [dataclasses.asdict(f) for f in self.declared],
        }

    def summary(self) -> str:
        moved = ", ".join(f"{u}: {m:.4f}·{self.bound}" for u, m in self.moved.items())
        head = f"observer audit of {self.pipeline}: {'PASSED' if self.passed else 'FAILED'}"
        lines = [f"{head} (units {', '.join(self.units)}; {self.scope} moved {moved or 'n/a'})"]
        if self.changed:
            changed = "; ".join(f"{u}: {', '.join(c) or 'none'}" for u, c in self.changed.items())
            lines.append(f"  contributors changed: {changed}")
        lines += [f"  {finding}" for finding in self.findings]
        if self.inapplicable:
            lines.append(f"  units not applicable ({len(self.inapplicable)}; not run):")
            lines += [f"    {unit}: {why}" for unit, why in self.inapplicable.items()]
        if self.declared:
            lines.append(f"  refusals the pipeline declares ({len(self.declared)}; before any release; not failed):")
            lines += [f"    {finding}" for finding in self.declared]
        if self.notes:
            lines.append(f"  seen by the data holder only ({len(self.notes)}; not failed):")
            lines += [f"    {note}" for note in self.notes]
        return "\n".join(lines)


class ObserverAudit:
    """Replays ``pipeline`` on D and on D plus each of ``units`` with equal secrets, and diffs what an observer sees.

    Args:
        pipeline: what the user runs (`FitPipeline`, `FederatedPipeline`), with its public declarations.
        units: adversarial units to add (`lightning_dp.audit.observer.units`).
        tolerance: fp round-off allowed over C for the first release's move.
        vary: secret purposes to vary (default: the pipeline's ``purposes``).
        folder: where the worlds run (default: a temporary folder, removed at the end).
        coins_rate: the sample rate at which a pipeline declared at q = 1 is run to vary its coins.
        master: the tape's master secret (default: from the OS; a fixed one makes a test reproducible).
    """

    def __init__(
        self,
        pipeline: Pipeline,
        units: Sequence[str],
        *,
        tolerance: float = TOLERANCE,
        vary: Sequence[str] | None = None,
        master: int | None = None,
        folder: str | Path | None = None,
        coins_rate: float = 0.5,
    ) -> None:
        self.pipeline = pipeline
        self.units = list(units)
        self.tolerance = float(tolerance)
        hidden = tuple(getattr(pipeline, "hidden", ()))
        self.vary = list([*pipeline.purposes, *hidden] if vary is None else vary)
        self.hidden = set(hidden)
        self.folder = None if folder is None else Path(folder)
        self.coins_rate = float(coins_rate)
        self.master = master
        self._found: list[Finding] = []

    def run(self) -> ObserverResult:
        if self.folder is not None:
            return self._run(self.folder)
        with tempfile.TemporaryDirectory(prefix="observer-") as tmp:
            return self._run(Path(tmp))

    def _world(
        self, tape: SecretTape, unit: str | None, folder: Path, pipeline: Pipeline | None = None
    ) -> tuple[Observation, list[str]]:
        with tape.held():
            obs = (pipeline or self.pipeline).run(unit, folder)
        self._rules(folder.name, obs)
        return obs, list(tape.draws)

    def _rules(self, world: str, obs: Observation) -> None:
        """Each world's own rules: its broken ``rules``, and releases charged for another sensitivity than declared."""
        for rule, (expected, found) in obs.rules.items():
            if expected != found:
                self._found.append(Finding(f"rule in {world}", rule, _short(expected), _short(found)))
        declared = float(self.pipeline.clip_norm)
        for r in obs.releases:
            if not math.isclose(r.clip_norm, declared, rel_tol=1e-9):
                channel = f"release at step {r.step}: sensitivity charged"
                self._found.append(Finding(f"rule in {world}", channel, f"{declared:.6g}", f"{r.clip_norm:.6g}"))
                break

    def _contributors(self, check: str, a: Observation, b: Observation, allowed: int) -> list[str]:
        """The contributors that differ between ``a`` and ``b``; more than ``allowed`` is a finding."""
        changed = sorted(
            k for k in set(a.contributors) | set(b.contributors) if a.contributors.get(k) != b.contributors.get(k)
        )
        if len(changed) > allowed:
            self._found.append(
                Finding(check, "contributors changed", f"at most {allowed}", f"{len(changed)}: {', '.join(changed)}")
            )
        return changed

    def _for(self, purpose: str) -> Pipeline:
        """The pipeline that shows ``purpose`` deciding the release: the coins (a site's secret) at q < 1."""
        if purpose not in ("coins", "site"):
            return self.pipeline
        changes: dict[str, Any] = {}
        if getattr(self.pipeline, "sample_rate", None) == 1.0:
            changes["sample_rate"] = self.coins_rate
        if getattr(self.pipeline, "augment", False):
            # The coins' secret also keys the units' streams (augmentation): without augmentation they decide only
            # the order of a patient's images in one local batch, a change of round-off, below CHANGED.
            changes["augment"] = False
        return dataclasses.replace(self.pipeline, **changes) if changes else self.pipeline  # type: ignore[type-var]

    @staticmethod
    def _compare(
        result: ObserverResult, check: str, a: Observation, b: Observation, draws: tuple[list[str], list[str]] | None
    ) -> None:
        result.findings += diff(check, a, b, draws)
        for key in sorted(set(a.holder) | set(b.holder)):
            left, right = a.holder.get(key, "<absent>"), b.holder.get(key, "<absent>")
            if left != right:
                result.notes.append(Finding(check, key, *_first_difference(left, right)))

    def _run(self, root: Path) -> ObserverResult:
        result = ObserverResult(self.pipeline.name, self.units)
        self._found = result.findings
        inapplicable = dict(getattr(self.pipeline, "inapplicable", {}))
        tape = SecretTape() if self.master is None else SecretTape(self.master)
        base, draws = self._world(tape, None, root / "D")
        result.purposes_drawn = sorted(set(draws))
        again, draws_again = self._world(tape, None, root / "D-again")
        self._compare(result, "D twice", base, again, (draws, draws_again))
        result.findings += self._releases_equal("D twice", base, again, getattr(self.pipeline, "replay_tolerance", 0.0))
        self._contributors("D twice", base, again, 0)
        allowed = getattr(self.pipeline, "max_changed_contributors", None)
        every = bool(getattr(self.pipeline, "every_release", False))
        if every:
            result.scope, result.bound = "every release", "S"
        for unit in self.units:
            if unit in inapplicable:  # reported with its reason, not run
                result.inapplicable[unit] = inapplicable[unit]
                continue
            other, other_draws = self._world(tape, unit, root / f"D+{unit}")
            outcome = str(other.channels.get("outcome", ""))
            declared = [d for d in getattr(self.pipeline, "declared_refusals", ()) if d in outcome]
            if declared and outcome != base.channels.get("outcome"):  # one declared bit, before anything is released
                result.declared.append(Finding(f"D vs D+{unit}", "outcome", str(base.channels.get("outcome")), outcome))
                continue
            self._compare(result, f"D vs D+{unit}", base, other, (draws, other_draws))
            if allowed is not None:
                result.changed[unit] = self._contributors(f"D vs D+{unit}", base, other, int(allowed))
            pairs = list(zip(base.releases, other.releases))[: None if every else 1]
            moves = [
                float((y.vector - x.vector).norm()) * x.normalizer / min(x.clip_norm, y.clip_norm)  # as charged
                for x, y in pairs
                if x.vector.shape == y.vector.shape
            ]
            if moves:
                moved = max(moves)
                result.moved[unit] = moved
                if not moved <= 1 + self.tolerance:
                    result.findings.append(
                        Finding(
                            f"D vs D+{unit}",
                            result.scope,
                            f"moved ≤ 1.00·{result.bound}",
                            f"moved {moved:.4f}·{result.bound}",
                        )
                    )
        for purpose in self.vary:
            if purpose not in draws:
                result.findings.append(
                    Finding(f"secret {purpose}", "secret draws", f"a draw of {purpose!r}", f"none (drew {draws})")
                )
                continue
            pipeline = self._for(purpose)
            reference = base
            if pipeline is not self.pipeline:  # the coins decide nothing at q = 1: both worlds at q < 1
                reference, reference_draws = self._world(tape, None, root / f"D@{purpose}", pipeline)
            else:
                reference_draws = draws
            if purpose in self.hidden:  # K: how many trials ran (and so the draws) may differ; nothing published may
                informative = 0
                for k in range(1, HIDDEN_TRIES + 1):
                    hidden, hidden_draws = self._world(
                        tape.varied(purpose, k), None, root / f"D~{purpose}{k}", pipeline
                    )
                    self._compare(result, f"secret {purpose} varied", reference, hidden, None)
                    informative += hidden_draws != reference_draws  # the hidden value changed what ran (K differs)
                    if informative == HIDDEN_VARIATIONS:
                        break
                else:
                    result.findings.append(
                        Finding(
                            f"secret {purpose} varied",
                            "secret draws",
                            f"{HIDDEN_VARIATIONS} variations that change what runs",
                            f"{informative} in {HIDDEN_TRIES} tries",
                        )  # fmt: skip
                    )
                continue
            varied, varied_draws = self._world(tape.varied(purpose), None, root / f"D~{purpose}", pipeline)
            self._compare(result, f"secret {purpose} varied", reference, varied, (reference_draws, varied_draws))
            self._contributors(f"secret {purpose} varied", reference, varied, 0)
            if not self._changed(reference, varied):
                result.findings.append(
                    Finding(
                        f"secret {purpose} varied",
                        "releases",
                        "changed by the secret",
                        "unchanged: decided by public values",
                    )
                )
        return result

    @staticmethod
    def _changed(a: Observation, b: Observation) -> bool:
        if not a.releases and not b.releases:  # a pipeline that publishes a model, not its steps: its weights
            return any(
                isinstance(v, torch.Tensor) and not torch.equal(v, b.derived.get(k, v)) for k, v in a.derived.items()
            )
        for x, y in zip(a.releases, b.releases):
            if x.vector.shape != y.vector.shape:
                return True
            if float((x.vector - y.vector).norm()) > CHANGED * max(float(x.vector.norm()), 1e-12):
                return True
        return len(a.releases) != len(b.releases)

    def _releases_equal(self, check: str, a: Observation, b: Observation, tolerance: float) -> list[Any]:
        """Equal releases (to ``tolerance``·C in the sum, a pipeline's own rounding; 0: bit for bit)."""
        for x, y in zip(a.releases, b.releases):
            if x.vector.shape != y.vector.shape:
                continue
            gap = float((x.vector - y.vector).norm()) * x.normalizer / self.pipeline.clip_norm
            if gap > tolerance or (tolerance == 0 and not bool((x.vector == y.vector).all())):
                return [Finding(check, f"release at step {x.step}", "equal under equal secrets", f"{gap:.3g}·C apart")]
        return []
