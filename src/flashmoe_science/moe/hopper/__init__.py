"""Gluon kernels of the MoE layer for Hopper (sm_90): one module per kernel (dx_sm90: dx, and dh with the SwiGLU
backward in its epilogue; wgrad_sm90: dw1, dw2), the GEMM pipeline they share in common (what every sm_90 kernel
shares is flashmoe_science.gluon.sm90). All run in moe_backward on Hopper with 128-row tiles."""
