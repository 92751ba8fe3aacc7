"""nn.Modules built on the functional API."""

from flashmoe_science.nn.moe import FusedMoE, replace_hf_moe_blocks

__all__ = ["FusedMoE", "replace_hf_moe_blocks"]
