"""vLLM serving on this library's kernels: a ``vllm.general_plugins`` entry point (``pip install
"flashmoe-science[vllm]"``).

`register` runs in every vLLM process. It registers the attention backend in vLLM's ``CUSTOM`` slot, chosen with
``vllm serve MODEL --attention-backend CUSTOM`` or ``LLM(model, attention_backend="CUSTOM")``, and, where
``FLASHMOE_SCIENCE_VLLM_MOE=1``, the fused MoE for unquantized MoE layers. On a vLLM release outside the supported
range it registers nothing and logs one line saying so. Only ``backend`` and ``moe`` import vLLM.
"""

from __future__ import annotations

import logging
import os

from flashmoe_science.integrations.vllm.switches import MOE_SWITCH

BACKEND_CLASS = "flashmoe_science.integrations.vllm.backend.FlashMoEAttentionBackend"

logger = logging.getLogger(__name__)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: idempotent (vLLM may call it more than once per process)."""
    from flashmoe_science.integrations.versions import unsupported

    reason = unsupported("vllm")
    if reason is not None:
        logger.warning("flashmoe-science's vLLM plugin is off: %s", reason)
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS)
    if os.environ.get(MOE_SWITCH, "0") == "1":
        from flashmoe_science.integrations.vllm.moe import register_moe

        register_moe()
