"""Megatron-core (0.19): our attention and fused experts as entries of its layer specs.

Two swaps, both spec entries, built and called as Megatron's own modules are:

- :class:`FlashCoreAttention` (``attention.py``) at ``self_attention.submodules.core_attention``: causal and
  bidirectional attention, GQA, packed sequences (``PackedSeqParams``, ``thd``) through our varlen kernels, the
  config's sliding window, additive attention bias;
- :class:`FlashExperts` (``experts.py``) at the MoE layer's ``experts``: every local expert's SwiGLU MLP in one
  ``grouped_experts`` call over the rows Megatron's token dispatcher grouped by expert.

:func:`get_gpt_layer_flash_spec` returns Megatron's local GPT layer spec with both; :func:`with_flash_modules` swaps
them into any ``TransformerLayer`` spec. Megatron-core is the optional extra ``megatron``
(``pip install flashmoe-science[megatron]``, Python 3.12+ as Megatron-core 0.17+ declares); nothing else in the
library imports it. Megatron-core 0.16 is not supported: its MoE router calls TransformerEngine's GEMM
unconditionally (a ``NameError`` without TransformerEngine). The supported range is `integrations.versions`'s;
importing this package on another release raises a RuntimeError naming it.
"""

from flashmoe_science.integrations import versions

versions.require("megatron")  # before its internals are imported: a release they moved in fails in one line

from flashmoe_science.integrations.megatron.attention import FlashCoreAttention  # noqa: E402
from flashmoe_science.integrations.megatron.experts import FlashExperts  # noqa: E402
from flashmoe_science.integrations.megatron.spec import get_gpt_layer_flash_spec, with_flash_modules  # noqa: E402

__all__ = ["FlashCoreAttention", "FlashExperts", "get_gpt_layer_flash_spec", "with_flash_modules"]
