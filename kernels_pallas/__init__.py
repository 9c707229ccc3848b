"""Pallas kernels: block-scaled grouped GEMM and quantisation, each with a jnp reference (to come)."""
