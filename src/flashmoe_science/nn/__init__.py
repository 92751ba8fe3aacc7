"""nn.Modules built on the functional API."""

from flashmoe_science.nn.attention import Attention, SwiGLU, TransformerBlock
from flashmoe_science.nn.moe import FusedMoE, replace_hf_moe_blocks

__all__ = ["Attention", "FusedMoE", "SwiGLU", "TransformerBlock", "replace_hf_moe_blocks"]
