"""The observer's audit: neighbouring worlds replayed end to end with equal secrets, every channel compared.

ALGORITHMS.md §9: a guarantee covers everything an observer sees. Rooms:

* `secrets`: `SecretTape`, every secret draw of a run replayed in its neighbour, one purpose varied at will;
* `channels`: what an observer sees (releases, console, log records, warnings, files, refusals, the patients of
  each split), normalized;
* `units`: the adversarial units a neighbour adds (huge, whale, one image, unreadable, non-finite, raising, empty);
* `pipelines`: what a user runs — ``lightning-dp fit`` (`FitPipeline`), ``lightning-dp tune`` (`TunePipeline`), the
  federated apps (`FederatedPipeline`), PATE's teachers, vote and student (`PatePipeline`);
* `verdict`: `ObserverAudit`, the comparisons and the findings.
"""

from lightning_dp.audit.observer.pipelines import FederatedPipeline, FitPipeline, PatePipeline, TunePipeline
from lightning_dp.audit.observer.secrets import SecretTape
from lightning_dp.audit.observer.verdict import Finding, ObserverAudit, ObserverResult, diff

__all__ = [
    "FederatedPipeline",
    "Finding",
    "FitPipeline",
    "ObserverAudit",
    "ObserverResult",
    "PatePipeline",
    "SecretTape",
    "TunePipeline",
    "diff",
]
