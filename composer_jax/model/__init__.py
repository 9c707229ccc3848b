"""DeepSeek-V3 / Kimi-K2 model: `Transformer`, `compute_logits`, parameter accounting."""

from composer_jax.model.transformer import (
    ForwardOutput,
    Transformer,
    compute_logits,
    init_model,
    param_rngs,
)

__all__ = ["ForwardOutput", "Transformer", "compute_logits", "init_model", "param_rngs"]
