"""An alias kept for one release (issue 34): the silhouette generator is in `data.synthetic.segmentation` now.

Its code lives in `lightning_dp.data.synthetic.segmentation.silhouettes`. Import from there, from
`lightning_dp.data.synthetic`, or from ``lightning_dp.data`` (`generate_synthetic_silhouettes`,
`synthetic_silhouettes`).
"""

from lightning_dp.data.synthetic.segmentation.silhouettes import (
    SHAPES,
    SILHOUETTE_SITES,
    SILHOUETTES_VERSION,
    Shape,
    SilhouetteSite,
    SilhouetteStyle,
    check_silhouette_parameters,
    generate_synthetic_silhouettes,
    render_silhouette_patient,
    silhouette,
    silhouette_site,
    synthetic_silhouettes,
)

__all__ = [
    "SHAPES",
    "SILHOUETTES_VERSION",
    "SILHOUETTE_SITES",
    "Shape",
    "SilhouetteSite",
    "SilhouetteStyle",
    "check_silhouette_parameters",
    "generate_synthetic_silhouettes",
    "render_silhouette_patient",
    "silhouette",
    "silhouette_site",
    "synthetic_silhouettes",
]
