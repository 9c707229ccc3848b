"""Low-precision MoE training: MXFP8 / NVFP4 formats and the quantized grouped GEMM."""
