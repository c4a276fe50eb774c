"""Reference models, and fixers that make ordinary models trainable with per-sample gradients."""

from lightning_dp.models.classifier import Architecture, ImageClassifier, TrainableGroup, build_backbone
from lightning_dp.models.fixers import (
    ModelProblem,
    fix_model,
    group_norm_for,
    is_eval_batch_norm,
    is_frozen_batch_norm,
    validate_model,
)
from lightning_dp.models.pretrained import adapt_torchvision_weights
from lightning_dp.models.segmentation import (
    SegmentationModule,
    SegmentationTrainable,
    build_segmentation_model,
    segmentation_loss,
    segmentation_trainable_names,
)

__all__ = [
    "Architecture",
    "ImageClassifier",
    "ModelProblem",
    "SegmentationModule",
    "SegmentationTrainable",
    "TrainableGroup",
    "adapt_torchvision_weights",
    "build_backbone",
    "build_segmentation_model",
    "fix_model",
    "group_norm_for",
    "is_eval_batch_norm",
    "is_frozen_batch_norm",
    "segmentation_loss",
    "segmentation_trainable_names",
    "validate_model",
]
