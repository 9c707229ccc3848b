"""Pallas Mosaic GPU kernels for the low-precision MoE grouped GEMM, with jnp references.

Hopper (`hopper_grouped_gemm`, `hopper_warp_specialized`, `hopper_wgrad`) and Blackwell
(`blackwell_grouped_gemm`, `blackwell_persistent`, `blackwell_wgrad`) kernels share their work
units (`ragged_tiles`), layouts (`grouped_layout`), the Hopper K loop (`pipeline`) and block sizes
(`tiling`); `mgpu_compat` bridges JAX 0.11 and 0.12. JAX alone: `composer_jax.quant` calls in,
nothing here imports the model. On CPU the Hopper kernels run in Mosaic GPU interpret mode; the
Blackwell ones (block-scaled tcgen05 cannot be interpreted) are lowered for CUDA, and their
schedule or operand slices replayed on the host; `pytest -m gpu` runs kernels compiled on a GPU.
"""
