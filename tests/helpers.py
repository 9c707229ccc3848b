"""The one test-model helper: the tiny preset's model in float32, with overrides."""

import dataclasses

from composer_jax import config


def tiny_model_config(**overrides) -> config.ModelConfig:
    """`config.tiny().model` in float32 compute, with `overrides` (shapes, layers, routing)."""
    return dataclasses.replace(config.tiny().model, **{"dtype": "float32", **overrides})
