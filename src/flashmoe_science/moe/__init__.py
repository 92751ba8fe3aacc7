"""Fused Mixture-of-Experts: routing, GPU token sort, grouped SwiGLU expert GEMMs with fused combine."""

from flashmoe_science.moe.api import describe_moe, fused_experts, fused_moe, grouped_experts, moe_route

__all__ = ["fused_moe", "moe_route", "fused_experts", "grouped_experts", "describe_moe"]
