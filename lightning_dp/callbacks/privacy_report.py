"""The end-of-run privacy report (text + JSON), shared by every DP callback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_dp.accounting import PrivacyLedger, get_accountant
from lightning_dp.accounting.accountants import AccountantName

__all__ = ["privacy_report", "write_privacy_report"]

_ACCOUNTANTS: tuple[AccountantName, ...] = ("rdp", "prv", "moments")
_NEIGHBOURS = {"patient": "all images of one patient", "sample": "one sample"}


def privacy_report(ledger: PrivacyLedger, accounting: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """ε per accountant and what was recorded, as a JSON-able dict."""
    epsilons: dict[str, float | str] = {}
    for name in _ACCOUNTANTS:
        try:
            epsilons[name] = get_accountant(name).epsilon(ledger)
        except Exception as err:  # noqa: BLE001 - a failing optional accountant must not lose the report
            epsilons[name] = f"unavailable: {err}"
    paper = accounting == "paper"
    report: dict[str, Any] = {
        "unit": ledger.unit,
        "delta": ledger.delta,
        # A paper's count is not a guarantee: it is never under "epsilon", the key a reader takes as the bound.
        ("epsilon_paper_not_a_guarantee" if paper else "epsilon"): epsilons,
        "steps": ledger.steps,
        "accounting": accounting,
        "guarantee": not paper,
        "mechanisms": [{"event": e.to_dict(), "count": c} for e, c in ledger.entries[:50]],
        "mechanism_entries": len(ledger.entries),
    }
    if accounting == "paper":
        report["warning"] = (
            "accounting='paper' charges each round at the selected noise scale, as Wu et al. (2019) did; "
            "the selection depends on private data, so these ε values are NOT a differential-privacy guarantee."
        )
    report.update(extra or {})
    headline = report.get("accountant")
    if not paper and isinstance(headline, str) and isinstance(epsilons.get(headline), float):
        # Which ε is the guarantee: the callback's own accountant, the one privacy/epsilon and a PrivacyBudget use.
        report["headline"] = {
            "accountant": headline,
            "epsilon": epsilons[headline],
            "what": "the guarantee: the ε of the callback's accountant, logged as privacy/epsilon and used by a "
            "PrivacyBudget; the other accountants' ε are shown for comparison (each a valid bound on the same run, so "
            "the smallest is a valid guarantee too)",
        }
    return report


def _text(report: dict[str, Any]) -> str:
    unit = report["unit"]
    lines = [
        "Privacy report",
        f"  unit: {unit} (neighbouring datasets differ by {_NEIGHBOURS.get(unit, unit)})",
    ]
    if report.get("num_units") is not None:
        lines.append(f"  dataset size: N = {report['num_units']} {unit}s")
    lines.append(f"  delta: {report['delta']:.3g}")
    for key, label in (("clip_norm", "clip norm"), ("sample_rate", "sample rate (per step)")):
        if report.get(key) is not None:
            lines.append(f"  {label}: {report[key]:.4g}")
    planned = report.get("planned_steps")
    lines.append(f"  steps (rounds): {report['steps']}" + ("" if planned is None else f" of {planned} planned"))
    lines.append(f"  accounting: {report['accounting']}" + ("" if report["guarantee"] else "  (NOT a guarantee)"))
    headline = report.get("headline")
    if headline is not None:
        name = headline["accountant"]
        lines.append(
            f"  epsilon: {headline['epsilon']:.4f}  <- the guarantee ({name} accountant: the ε logged as "
            "privacy/epsilon and used by a PrivacyBudget)"
        )
        others = [
            f"{other} {eps:.4f}" if isinstance(eps, float) else f"{other} {eps}"
            for other, eps in report["epsilon"].items()
            if other != name
        ]
        if others:
            lines.append(
                f"  other accountants, for comparison: {', '.join(others)} (each a valid bound on the same run: the "
                "smallest is a valid guarantee too)"
            )
    else:
        guarantee = "epsilon" in report
        label = "epsilon" if guarantee else "the paper's epsilon, NOT a guarantee,"
        for name, eps in report["epsilon" if guarantee else "epsilon_paper_not_a_guarantee"].items():
            lines.append(f"  {label} [{name}]: {eps:.4f}" if isinstance(eps, float) else f"  {label} [{name}]: {eps}")
    if "stopped_early" in report:
        lines.append(f"  NOTE: {report['stopped_early']}")
    if "warning" in report:
        lines.append(f"  WARNING: {report['warning']}")
    lines.append(
        "  checkpoints: training checkpoints hold the noise and sampling seeds; keep them private and publish the "
        "model via lightning_dp.publishable_checkpoint()"
    )
    for key in ("stopped_by_budget", "private_diagnostics_logged", "noise_schedule", "acceptance"):
        if key in report:
            lines.append(f"  {key}: {report[key]}")
    if "tcdp_closed_form" in report:
        tcdp = report["tcdp_closed_form"]
        if tcdp.get("epsilon") is None:
            lines.append(f"  tCDP closed form (Zhang et al.): not shown — {tcdp.get('not_shown', 'not computed')}")
        else:
            verdict = "valid" if tcdp["valid"] else "NOT a valid bound here: " + "; ".join(tcdp["failed_conditions"])
            lines.append(f"  tCDP closed form (Zhang et al.): {tcdp['epsilon']:.4f} — {verdict}")
    if "claims_not_guarantees" in report:
        claim = report["claims_not_guarantees"]["epsilon_accepted_steps_only"]
        lines.append(f"  accepted steps only (the papers' count, NOT a guarantee): {claim:.4f}")
    return "\n".join(lines)


def write_privacy_report(
    ledger: PrivacyLedger, log_dir: str | Path, accounting: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Writes ``privacy_report.json`` and ``privacy_report.txt`` in ``log_dir``, prints the text, returns the dict."""
    report = privacy_report(ledger, accounting, extra)
    folder = Path(log_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "privacy_report.json").write_text(json.dumps(report, indent=2))
    text = _text(report)
    (folder / "privacy_report.txt").write_text(text + "\n")
    print("\n" + text)
    return report
