"""Reference models, and fixers that make ordinary models trainable with per-sample gradients."""

from lightning_dp.models.classifier import Architecture, ImageClassifier, build_backbone
from lightning_dp.models.fixers import ModelProblem, fix_model, group_norm_for, is_frozen_batch_norm, validate_model

__all__ = [
    "Architecture",
    "ImageClassifier",
    "ModelProblem",
    "build_backbone",
    "fix_model",
    "group_norm_for",
    "is_frozen_batch_norm",
    "validate_model",
]
