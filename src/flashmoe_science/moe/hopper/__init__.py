"""Gluon kernels of the MoE layer for Hopper (sm_90): one module per kernel. Not wired into the dispatch yet."""
