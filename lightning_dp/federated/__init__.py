"""P3SGD across hospitals: the patient round at each site, the noise and one patient-level ledger at the server.

The transport-free core is here; `lightning_dp.federated.flower` carries it on Flower (a ``ClientApp`` per hospital,
a ``ServerApp``, the server loop), and needs the ``federated`` extra (``pip install -e ".[federated]"`` in the
repository root: lightning-dp is not on PyPI).

* `Site` (``site.py``): a hospital's side of a round. It loads θ_t, includes each of *its own* patients independently
  with probability q (so the union over sites is a Poisson sample at rate q of all N patients), runs each included
  patient's local update on that patient's images alone with the library's patient round
  (`lightning_dp.training.patient_rounds`), clips each to C and replies with the **sum** of the clipped updates:
  nothing else computed from private data leaves the site.
* `FederatedServer` (``server.py``): sums the replies it accepts, adds N(0, z²C²) **once**, divides by the public
  q·N, applies θ_{t+1} = θ_t + server_lr·Δ̃ and charges one Poisson-subsampled Gaussian at patient level per round,
  through the same `PrivateStep` as `P3SGD`: the ledger, the noise std and ε are those of single-machine P3SGD on
  the union of the patients. A reply of the wrong shape or dtype, or with a non-finite value, is refused and counts
  as a site that did not reply (its patients contribute nothing; the round is charged as usual).

The guarantee is for add/remove all images of one patient at one site; a patient seen at two hospitals whose records
are not linked counts as two patients.
"""

from lightning_dp.federated.server import (
    FederatedServer,
    RoundOutcome,
    SharedNoiseRelease,
    calibrated_multiplier,
    share_std,
)
from lightning_dp.federated.site import Site

__all__ = ["FederatedServer", "RoundOutcome", "SharedNoiseRelease", "Site", "calibrated_multiplier", "share_std"]
