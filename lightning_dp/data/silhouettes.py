"""An alias kept for one release (issue 34): the silhouette generator is in `data.synthetic.segmentation` now.

Its code lives in `lightning_dp.data.synthetic.segmentation.silhouettes`. Import from there, from
`lightning_dp.data.synthetic`, or from ``lightning_dp.data`` (`generate_synthetic_silhouettes`,
`synthetic_silhouettes`).
"""

from lightning_dp.data.synthetic.segmentation.silhouettes import *  # noqa: F403
from lightning_dp.data.synthetic.segmentation.silhouettes import __all__ as __all__
