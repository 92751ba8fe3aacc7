"""flashmoe-science: fast, exact attention and Mixture-of-Experts kernels for PyTorch."""

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.decode import flash_attention_decode
from flashmoe_science.attention.fp8 import quantize_fp8
from flashmoe_science.attention.varlen import flash_attention_varlen
from flashmoe_science.moe import fused_experts, fused_moe, moe_route

__version__ = "0.1.0"

__all__ = ["flash_attention_science", "flash_attention_varlen", "flash_attention_decode", "quantize_fp8",
           "fused_moe", "fused_experts", "moe_route", "__version__"]
