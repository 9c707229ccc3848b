"""The K loop shared by the Hopper kernels: a ring of SMEM slots fed by TMA, consumed by wgmma.

Step i waits for its slot, issues its wgmma, then waits until at most one wgmma group is in
flight -- the one just issued -- before refilling the slot step i-1 read with step i+stages-1.
wgmma reads shared memory asynchronously, so refilling a slot before that wait would let the TMA
overwrite operands a running wgmma still reads (the race JAX's own Hopper matmul avoids the same
way, with delay_release=1 and wgmma_wait(1)).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def wgmma_k_loop(
    num_steps,
    stages: int,
    loaded,
    issue_loads: Callable[[jax.Array, jax.Array], None],
    issue_wgmma: Callable[[jax.Array], None],
) -> None:
    """Runs `num_steps` (static or traced) K steps through `stages` slots.

    `issue_loads(step, slot)` starts the TMA copies of a step into a slot, arriving on
    `loaded.at[slot]`; `issue_wgmma(slot)` issues the step's wgmma on that slot.
    """
    if stages < 2:
        raise ValueError(f"the pipeline needs at least 2 stages, got {stages}")
    for step in range(stages - 1):
        if isinstance(num_steps, int):
            if step < num_steps:
                issue_loads(jax.numpy.int32(step), jax.numpy.int32(step))
        else:
            pl.when(step < num_steps)(
                lambda step=step: issue_loads(jax.numpy.int32(step), jax.numpy.int32(step))
            )

    def body(step, carry):
        slot = jax.lax.rem(step, stages)
        plgpu.barrier_wait(loaded.at[slot])
        issue_wgmma(slot)
        plgpu.wgmma_wait(1)
        refill = step + stages - 1

        @pl.when(refill < num_steps)
        def _():
            issue_loads(refill, jax.lax.rem(refill, stages))

        return carry

    jax.lax.fori_loop(0, num_steps, body, None)
