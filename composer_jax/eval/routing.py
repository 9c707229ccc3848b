"""Where a model's tokens go: the experts each MoE layer picks per token, and the load per expert.

    stats = routing_stats(model, tokenizer.encode(text, add_bos=True, special=False))
    stats.load_share_LE        # share of the layer's (token, slot) picks per expert
    stats.imbalance_L          # max / mean expert load per layer (1 = perfectly balanced)
    plot_expert_load(stats)    # heat map of the shares

The forward pass is the model's own (`Transformer.__call__` returns the chosen experts and the
per-expert load of every MoE layer, what router replay and the balance rule use).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class RoutingStats:
    experts_LTK: np.ndarray  # experts chosen per MoE layer, token and slot (router's order)
    load_LE: np.ndarray  # (token, slot) picks per MoE layer and expert
    first_moe_layer: int  # index of the first MoE layer in the stack (the dense ones come first)

    @property
    def load_share_LE(self) -> np.ndarray:
        return self.load_LE / np.maximum(self.load_LE.sum(axis=1, keepdims=True), 1)

    @property
    def imbalance_L(self) -> np.ndarray:
        """Max over mean expert load per layer."""
        mean = np.maximum(self.load_LE.mean(axis=1), 1e-9)
        return self.load_LE.max(axis=1) / mean

    @property
    def unused_experts_L(self) -> np.ndarray:
        return (self.load_LE == 0).sum(axis=1)

    def table(self) -> str:
        """One line per MoE layer: imbalance, unused experts, the busiest expert."""
        lines = ["layer  max/mean  unused  busiest (share)"]
        for i, (load, ratio) in enumerate(zip(self.load_share_LE, self.imbalance_L)):
            busiest = int(load.argmax())
            lines.append(
                f"{self.first_moe_layer + i:5d}  {ratio:8.2f}  {int((load == 0).sum()):6d}  "
                f"{busiest:3d} ({load[busiest]:.2f})"
            )
        return "\n".join(lines)


def routing_stats(model, tokens_T) -> RoutingStats:
    """Experts chosen for one sequence (a 1-D token array or list) by every MoE layer."""
    tokens = jnp.asarray(tokens_T, jnp.int32)
    if tokens.ndim != 1 or tokens.shape[0] == 0:
        raise ValueError(f"expected a non-empty 1-D token sequence, got shape {tokens.shape}")
    if model.cfg.num_moe_layers == 0:
        raise ValueError("the model has no MoE layers")
    graphdef, state = nnx.split(model)
    indices, load = _route(graphdef, state, tokens[None])
    return RoutingStats(np.asarray(indices[:, 0]), np.asarray(load), model.cfg.first_k_dense)


@functools.partial(jax.jit, static_argnums=0)
def _route(graphdef, state, tokens_BT):
    m = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
    out = m(tokens_BT, positions, jnp.ones_like(tokens_BT), with_mtp=False)
    return out.router_indices_LBTK, out.expert_load_LE


def plot_expert_load(stats: RoutingStats, ax=None, title: str = "expert load"):
    """Heat map of each MoE layer's load share per expert; returns the axes."""
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(6, 1.2 + 0.5 * stats.load_LE.shape[0]))
    image = ax.imshow(stats.load_share_LE, aspect="auto", cmap="viridis")
    layers = range(stats.first_moe_layer, stats.first_moe_layer + stats.load_LE.shape[0])
    ax.set_yticks(range(stats.load_LE.shape[0]), [str(i) for i in layers])
    ax.set(xlabel="expert", ylabel="layer", title=title)
    ax.figure.colorbar(image, ax=ax, label="share of picks")
    return ax
