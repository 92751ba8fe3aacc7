"""Gluon kernels of the MoE layer for Hopper (sm_90): one module per kernel (dx_sm90, wgrad_sm90), the shared
pieces in common. dx_sm90 runs in moe_backward on Hopper; wgrad_sm90 is not wired in yet."""
