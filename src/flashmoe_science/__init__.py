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

__version__ = "0.1.0"

# Each public name and the module it comes from, imported on first use (PEP 562): importing or planning attention
# loads no MoE module, and the MoE layer no attention module.
_FRONT_DOORS = {
    "flash_attention_science": "flashmoe_science.attention.api",
    "flash_attention_varlen": "flashmoe_science.attention.varlen",
    "flash_attention_decode": "flashmoe_science.attention.decode",
    "quantize_fp8": "flashmoe_science.attention.fp8",
    "fused_moe": "flashmoe_science.moe.api",
    "fused_experts": "flashmoe_science.moe.api",
    "moe_route": "flashmoe_science.moe.api",
}
__all__ = [*_FRONT_DOORS, "__version__"]


def __getattr__(name: str):
    if name not in _FRONT_DOORS:
        raise AttributeError(f"module 'flashmoe_science' has no attribute {name!r}")
    import importlib

    value = globals()[name] = getattr(importlib.import_module(_FRONT_DOORS[name]), name)  # looked up once
    return value
