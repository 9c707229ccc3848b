"""Pallas Mosaic GPU kernels for the low-precision MoE grouped GEMM, with jnp references."""
