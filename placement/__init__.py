"""Placement planning: model shapes and, from them, instance layouts. Imports neither Ray nor torch."""

from placement.model_presets import MODEL_PRESETS, ModelShape, model_shape

__all__ = ["MODEL_PRESETS", "ModelShape", "model_shape"]
