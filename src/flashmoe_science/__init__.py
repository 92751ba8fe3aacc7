"""flashmoe-science: fast, exact attention and Mixture-of-Experts kernels for PyTorch."""

# The kernel modules, and with them the shared mask and MoE-sort rules that the CPU reference is planned beside, are
# Triton functions defined at import: without triton nothing here imports, so say what to install.
try:
    import triton  # noqa: F401
except ModuleNotFoundError as _error:
    if _error.name != "triton":
        raise
    raise ImportError('flashmoe-science needs triton, which is not installed: pip install "triton>=3.6" (Linux; '
                      "on a CPU its kernels run only under TRITON_INTERPRET=1, but the package imports them)") from None

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.decode import flash_attention_decode
from flashmoe_science.attention.fp8 import quantize_fp8
from flashmoe_science.attention.varlen import flash_attention_varlen
from flashmoe_science.moe import fused_experts, fused_moe, moe_route

__version__ = "0.1.0"

__all__ = ["flash_attention_science", "flash_attention_varlen", "flash_attention_decode", "quantize_fp8",
           "fused_moe", "fused_experts", "moe_route", "__version__"]
