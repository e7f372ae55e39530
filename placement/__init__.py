"""Placement planning: model shapes, hardware, latency models and a simulator of deployments, from
which instance layouts are chosen. Imports neither Ray nor torch."""

from distserve.core.model_presets import MODEL_PRESETS, ModelShape, model_shape

__all__ = ["MODEL_PRESETS", "ModelShape", "model_shape"]
