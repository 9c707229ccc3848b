"""The one test-model helper: the tiny preset's model in float32, with overrides."""

import dataclasses

from composer_jax import config, presets


def tiny_model_config(**overrides) -> config.ModelConfig:
    """`presets.tiny().model` in float32 compute, with `overrides` (shapes, layers, routing)."""
    return dataclasses.replace(presets.tiny().model, **{"dtype": "float32", **overrides})
