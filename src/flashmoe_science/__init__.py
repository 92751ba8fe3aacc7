"""flashmoe-science: fast, exact attention and Mixture-of-Experts kernels for PyTorch."""

from flashmoe_science.attention.api import flash_attention_science

__version__ = "0.1.0"

__all__ = ["flash_attention_science", "__version__"]
