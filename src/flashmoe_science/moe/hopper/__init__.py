"""Gluon kernels of the MoE layer for Hopper (sm_90) and their family in the planner (``backend``: which expert GEMMs
they take and why not, the measured configs, the runners). One module per kernel (dx_sm90: dx, the forward's down,
and dh with the SwiGLU backward in its epilogue; wgrad_sm90: dw1, dw2), the GEMM pipeline they share in common (what
every sm_90 kernel shares is flashmoe_science.gluon.sm90)."""
