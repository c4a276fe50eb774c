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
    return report


def _text(report: dict[str, Any]) -> str:
    lines = [
        "Privacy report",
        f"  unit: {report['unit']} (neighbouring datasets differ by {_NEIGHBOURS.get(report['unit'], report['unit'])})",
        f"  delta: {report['delta']:.3g}",
        f"  steps (rounds): {report['steps']}",
        f"  accounting: {report['accounting']}" + ("" if report["guarantee"] else "  (NOT a guarantee)"),
    ]
    guarantee = "epsilon" in report
    label = "epsilon" if guarantee else "the paper's epsilon, NOT a guarantee,"
    for name, eps in report["epsilon" if guarantee else "epsilon_paper_not_a_guarantee"].items():
        lines.append(f"  {label} [{name}]: {eps:.4f}" if isinstance(eps, float) else f"  {label} [{name}]: {eps}")
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
