"""Fused Mixture-of-Experts: routing, GPU token sort, grouped SwiGLU expert GEMMs with fused combine.

The public names below come from ``moe.api`` on first use (PEP 562), so that importing a module of this package
(the planner's families: ``architectures.py``) does not import the front door, which imports the planner."""

__all__ = ["fused_moe", "moe_route", "fused_experts", "grouped_experts", "describe_moe"]


def __getattr__(name: str):
    if name in __all__:
        from flashmoe_science.moe import api

        return getattr(api, name)
    raise AttributeError(f"module 'flashmoe_science.moe' has no attribute {name!r}")
