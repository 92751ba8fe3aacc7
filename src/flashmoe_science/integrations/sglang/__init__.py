"""SGLang serving on this library's kernels: a ``sglang.srt.plugins`` entry point (``pip install
"flashmoe-science[sglang]"``).

SGLang runs `register` in each of its processes (the launcher or ``Engine``, before the arguments are parsed, and each
scheduler process, where the forwards run). It registers the attention backend ``flashmoe``, chosen with
``python -m sglang.launch_server --attention-backend flashmoe --page-size 16 ...`` or
``sglang.Engine(..., attention_backend="flashmoe", page_size=16)``; where ``FLASHMOE_SCIENCE_SGLANG_MOE=1``, also the
fused MoE for unquantized MoE layers (``moe``). On an SGLang release outside the supported range it registers nothing
and logs one line saying so. `register` imports SGLang's registry and argument modules, ``backend`` and ``moe`` its
model-side classes, ``metadata`` nothing of SGLang.
"""

from __future__ import annotations

import logging
import os

NAME = "flashmoe"
# "1": `register` replaces SGLang's method for unquantized MoE layers by ours (integrations/sglang/moe.py)
MOE_SWITCH = "FLASHMOE_SCIENCE_SGLANG_MOE"

logger = logging.getLogger(__name__)


def create_backend(model_runner):
    """SGLang's factory for the backend (imports it only when an engine builds it)."""
    from flashmoe_science.integrations.sglang.backend import FlashMoEAttnBackend

    return FlashMoEAttnBackend(model_runner)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: idempotent."""
    from flashmoe_science.integrations.versions import unsupported

    reason = unsupported("sglang")
    if reason is not None:
        logger.warning("flashmoe-science's SGLang plugin is off: %s", reason)
        return
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if NAME not in ATTENTION_BACKEND_CHOICES:  # so --attention-backend flashmoe parses
        add_attention_backend_choices([NAME])
    if NAME not in ATTENTION_BACKENDS:
        register_attention_backend(NAME)(create_backend)
    if os.environ.get(MOE_SWITCH, "0") == "1":
        from flashmoe_science.integrations.sglang.moe import register_moe

        register_moe()
