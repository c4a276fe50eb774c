"""Reference models."""

from lightning_dp.models.classifier import Architecture, ImageClassifier, build_backbone

__all__ = ["Architecture", "ImageClassifier", "build_backbone"]
